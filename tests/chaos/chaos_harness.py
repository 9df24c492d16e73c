"""Chaos suite harness: real ``mammoth ar|dit|gateway`` processes on loopback that tests kill,
stop, restart and flood (DESIGN.md, "Request path": nothing outlives a request).

The pipeline runs in a fast test configuration: the built-in tiny checkpoint, 64x64 images, two
denoising steps, one torch thread per stage. Counts are reduced by default (CI); set
``MAMMOTH_CHAOS_FULL=1`` for the full counts of docs/RELIABILITY.md::

    MAMMOTH_CHAOS_FULL=1 .venv/bin/python -m pytest tests/chaos

Every test here is marked ``chaos`` (``-m 'not chaos'`` leaves them out).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
from pipeline_harness import metric_samples

ROOT = pathlib.Path(__file__).resolve().parents[2]
FULL = os.environ.get("MAMMOTH_CHAOS_FULL", "") not in ("", "0")
SIZE = "64x64"
STEPS = 2
#: The gateway's request budget, seconds: a few 512x512 requests at once take 20-30 s on the shared
#: 2-core CI host, and a request retried after a fault runs twice.
REQUEST_TIMEOUT = 60


def count(ci: int, full: int) -> int:
    """``full`` under ``MAMMOTH_CHAOS_FULL=1``, else the reduced CI count ``ci``."""
    return full if FULL else ci


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples ``name`` with ``labels`` scraped from ``url`` (0 when absent)."""
    return sum(metric_samples(url, name, labels))


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (``VmRSS`` of /proc/PID/status), bytes."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@dataclasses.dataclass
class Proc:
    """One component process."""

    role: str
    proc: subprocess.Popen
    address: str
    metrics_url: str
    argv: list[str]
    log: pathlib.Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics_url, name, **labels)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def sigterm(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def sigstop(self) -> None:
        """Freeze the process (SIGSTOP): its sockets stay open, nothing answers."""
        self.proc.send_signal(signal.SIGSTOP)

    def sigcont(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)


class Cluster:
    """Start, stop and inspect component processes; everything is killed at teardown."""

    def __init__(self, checkpoint: pathlib.Path, tmp: pathlib.Path, env: dict[str, str] | None = None):
        from mammoth_app.local import generate_role_tokens

        self.checkpoint = checkpoint
        self.tmp = tmp
        # Per-role stage tokens, as `mammoth up` and the operator give every component.
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "MAMMOTH_CACHE_DIR": str(tmp / "cache"),
                    **generate_role_tokens(tmp), **(env or {})}
        self.procs: list[Proc] = []
        self._n = 0

    def _spawn(self, role: str, argv: list[str], timeout: float = 120.0, nofile: int | None = None) -> Proc:
        self._n += 1
        ready = self.tmp / f"{role}-{self._n}.ready.json"
        log = self.tmp / f"{role}-{self._n}.log"
        cmd = [sys.executable, "-m", "mammoth_app.cli", role, *argv, "--ready-file", str(ready)]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_open_files_limit(nofile))
        deadline = time.monotonic() + timeout
        while not (ready.exists() and ready.stat().st_size):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{role} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        address = info["address"]
        if role == "gateway":
            metrics_url = f"http://{address}/metrics"
        else:
            metrics_url = f"http://127.0.0.1:{info['metrics_port']}/metrics"
        p = Proc(role, proc, address, metrics_url, argv, log)
        self.procs.append(p)
        return p

    def stage(self, role: str, *extra: str, port: int = 0) -> Proc:
        """Start ``mammoth ar|dit`` (tiny checkpoint, one torch thread) and wait until SERVING.
        An AR may push to the DiTs started before it (``--dit-allow-list``)."""
        argv = ["--host", "127.0.0.1", "--checkpoint", str(self.checkpoint), "--port", str(port),
                "--metrics-port", "0", "--torch-threads", "1", "--log-level", "warning", *extra]
        dits = [p.address for p in self.procs if p.role == "dit"]
        if role == "ar" and dits and "--dit-allow-list" not in extra:
            argv += ["--dit-allow-list", ",".join(dits)]
        return self._spawn(role, argv)

    def gateway(self, ars: list[Proc], dits: list[Proc], *extra: str,
                health_interval: float | None = 0.2, nofile: int | None = None,
                request_timeout: float = REQUEST_TIMEOUT) -> Proc:
        """Start ``mammoth gateway`` on a free port; ready once >= 1 AR and >= 1 DiT are SERVING.

        ``health_interval`` (seconds) is the gateway's health poll period; None keeps the default
        setting (the fault-timing tests measure at default settings). ``nofile``: the process's
        open-file limit (``RLIMIT_NOFILE``), default inherited. ``request_timeout``: the gateway's
        request budget, seconds.
        """
        argv = ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
                "--ar", ",".join(p.address for p in ars), "--dit", ",".join(p.address for p in dits),
                "--default-steps", str(STEPS), "--default-size", SIZE, "--min-pixels", "1024",
                "--request-timeout-seconds", str(request_timeout), *extra]
        if health_interval is not None:
            argv += ["--health-interval-seconds", str(health_interval)]
        return self._spawn("gateway", argv, nofile=nofile)

    def fake_stage(self, role: str, *extra: str) -> Proc:
        """Start a fake stage (tests/gateway/fake_stages.py: real gRPC, no model) and wait for it."""
        self._n += 1
        ready = self.tmp / f"fake-{role}-{self._n}.ready"
        log = self.tmp / f"fake-{role}-{self._n}.log"
        argv = [str(ROOT / "tests" / "gateway" / "fake_stages.py"), role, "--ready-file", str(ready), *extra]
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.stat().st_size):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"fake {role} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.02)
        p = Proc(f"fake-{role}", proc, json.loads(ready.read_text())["address"], "", argv, log)
        self.procs.append(p)
        return p

    def restart(self, p: Proc) -> Proc:
        """Start ``p``'s command again on the same port (after it died)."""
        argv = list(p.argv)
        argv[argv.index("--port") + 1] = str(p.port)
        return self._spawn(p.role, argv)

    def close(self) -> None:
        for p in self.procs:
            if p.alive():
                p.proc.send_signal(signal.SIGKILL)  # also ends a SIGSTOPped process
                p.proc.wait()


def _open_files_limit(nofile: int | None):
    """A ``preexec_fn`` setting ``RLIMIT_NOFILE`` to ``nofile`` (None: no change)."""
    if nofile is None:
        return None

    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return apply


def image_request(url: str, *, stream: bool = False, seed: int = 1, timeout: float = 90.0,
                  size: str = SIZE, steps: int = STEPS) -> httpx.Response:
    """POST one image request and read the whole answer."""
    body = {"prompt": PROMPT, "size": size, "num_inference_steps": steps,
            "seed": seed, "stream": stream}
    return httpx.post(f"{url}/v1/images/generations", json=body, timeout=timeout)


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true (returns True) or ``timeout`` s passed (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def assert_envelope(response: httpx.Response, statuses: tuple[int, ...]) -> dict:
    """The response has one of ``statuses`` and an OpenAI error envelope; returns ``error``."""
    assert response.status_code in statuses, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    return error


#: a size whose AR decode lasts long enough on CPU to be killed mid-stream (32x33 grid tokens)
BIG = "512x512"
PROMPT = "a lighthouse at dusk"


def stream_until_ar_progress(url: str, timeout: float = 90.0, seed: int = 5):
    """Open a streaming ``BIG`` request and return (client, response context, lines iterator) once
    the AR has sent its first progress event (the AR is decoding and pushing rows to the DiT)."""
    client = httpx.Client(timeout=timeout)
    body = {"prompt": PROMPT, "size": BIG, "num_inference_steps": STEPS, "seed": seed, "stream": True,
            "stream_progress": True}
    cm = client.stream("POST", f"{url}/v1/images/generations", json=body)
    response = cm.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data:"):
            event = json.loads(line[5:])
            if event.get("stage") == "ar" and event.get("tokens_generated", 0) > 0:
                return client, cm, lines
    raise AssertionError("no AR progress event")


def sse_events(lines) -> list[dict]:
    """The remaining server-sent events of ``lines``: ``{"event": type, **data}`` each."""
    events = []
    event_type = None
    for line in lines:
        if line.startswith("event:"):
            event_type = line[6:].strip()
        elif line.startswith("data:"):
            events.append({"event": event_type, **json.loads(line[5:])})
    return events


#: ``reference_image`` results of this test session, by seed: every cluster serves the same tiny
#: checkpoint at the same gateway defaults, so the image without faults is the same bytes on each.
_REFERENCES: dict[int, str] = {}


def reference_image(url: str, seed: int = 5) -> str:
    """``b64_json`` of the ``BIG`` image for ``seed`` from a run without faults (the image a run
    with a failover must equal byte for byte). Computed by the first test that asks (on its
    cluster at ``url``), then reused: a ``BIG`` request fewer per test."""
    if seed not in _REFERENCES:
        response = image_request(url, seed=seed, size=BIG, timeout=120.0)
        assert response.status_code == 200, response.text[:500]
        _REFERENCES[seed] = response.json()["data"][0]["b64_json"]
    return _REFERENCES[seed]
