"""A local pipeline (real AR, DiT and gateway processes on loopback) for tests.

Imported as ``pipeline_harness`` (``tests/`` is put on ``sys.path`` by ``tests/conftest.py``); the
``pipeline`` fixture there uses it, and tests that need a pipeline of their own call
`start_local_pipeline` directly; `launch_stage` and `wait_all` start single stage processes side by
side. (``from conftest import ...`` is ambiguous across test folders.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_samples(url: str, name: str, labels: dict[str, str] | None = None) -> list[float]:
    """Values of the samples ``name`` whose labels include ``labels``, scraped from ``url``
    (a Prometheus ``/metrics`` URL); empty when the metric is not exposed."""
    text = httpx.get(url, timeout=10).text
    return [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items())
    ]


class RunningPipeline:
    """Handles on a started local pipeline: component processes, addresses, metrics URLs, the stage
    tokens ``mammoth up`` generated in ``workdir`` (``tokens["gateway"|"ar"]``, empty when the caller configured
    auth) and ``spare_dit_port``: a port the AR may also push to (for tests that play a DiT)."""

    def __init__(self, components, trace_dir: pathlib.Path, workdir: pathlib.Path | None = None,
                 spare_dit_port: int = 0):
        self.components = {c.name: c for c in components}
        self.trace_dir = trace_dir
        self.spare_dit_port = spare_dit_port
        self.workdir = workdir or trace_dir.parent
        folder = self.workdir / "tokens"
        self.tokens = {role: (folder / f"{role}.token").read_text().strip()
                       for role in ("gateway", "ar") if (folder / f"{role}.token").is_file()}

    def auth(self, role: str = "gateway") -> tuple[tuple[str, str], ...]:
        """gRPC call metadata carrying the ``role`` token (empty without generated tokens)."""
        from mammoth_core.grpc_common import auth_metadata

        return auth_metadata(self.tokens.get(role))

    @property
    def url(self) -> str:
        return f"http://{self.components['gateway'].address}"

    def metrics_url(self, name: str) -> str:
        comp = self.components[name]
        if name == "gateway":
            return f"{self.url}/metrics"
        host = comp.address.rsplit(":", 1)[0]
        return f"http://{host}:{comp.info['metrics_port']}/metrics"

    def metric(self, name: str, metric: str, labels: dict[str, str] | None = None) -> float:
        """Sum of the samples of ``metric`` (with matching labels) scraped from component ``name``.

        Raises:
            KeyError: the component does not expose ``metric`` (with those labels).
        """
        values = metric_samples(self.metrics_url(name), metric, labels)
        if not values:
            raise KeyError(f"{metric}{labels or ''} not exposed by {name}")
        return sum(values)


def rank_pids(pid: int) -> list[int]:
    """The rank processes a stage ``pid`` spawned (``multiprocessing`` spawn children; not its
    resource tracker): one per extra rank of ``--tensor-parallel-size`` / ``--dit-parallel``."""
    children: set[int] = set()
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        children.update(int(c) for c in (task / "children").read_text().split())
    return [c for c in children if b"spawn_main" in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()]


ROOT = pathlib.Path(__file__).resolve().parents[1]
_READY_NUMBERS = itertools.count()


@dataclasses.dataclass
class LaunchedStage:
    """A ``mammoth ar|dit`` process started by `launch_stage`, not yet known to be ready."""

    role: str
    proc: subprocess.Popen
    ready: pathlib.Path

    def wait(self, timeout: float = 180) -> dict:
        """Block until the stage wrote its ready file (it is SERVING); returns the file's JSON
        (``address``, ``port``, ``metrics_port``).

        Raises:
            RuntimeError: the process exited first, or ``timeout`` s passed (it is killed).
        """
        deadline = time.monotonic() + timeout
        while not (self.ready.exists() and self.ready.stat().st_size):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"{self.role} did not start (exit status {self.proc.poll()})")
            time.sleep(0.05)
        return json.loads(self.ready.read_text())


def launch_stage(role: str, checkpoint: pathlib.Path, tmp: pathlib.Path, *args: str,
                 env: dict[str, str] | None = None, first_on_path: pathlib.Path | None = None) -> LaunchedStage:
    """Start ``python -m mammoth_app.cli ROLE`` on 127.0.0.1 (``--port 0`` unless ``args`` give one,
    one torch thread, cache in ``tmp/cache``) without waiting: stages launched together load side
    by side. ``env`` is the whole environment (default: this one); ``PYTHONPATH`` is the repository,
    after ``first_on_path`` if given (a ``sitecustomize.py`` there runs at the child's start: fault
    injection from outside the code under test)."""
    ready = tmp / f"{role}-{os.getpid()}-{next(_READY_NUMBERS)}.ready.json"
    cmd = [sys.executable, "-m", "mammoth_app.cli", role, "--host", "127.0.0.1", "--checkpoint",
           str(checkpoint), "--port", "0", "--metrics-port", "0", "--torch-threads", "1",
           "--log-level", "warning", "--cache-dir", str(tmp / "cache"), "--ready-file", str(ready), *args]
    path = os.pathsep.join(str(p) for p in (first_on_path, ROOT) if p)
    env = {**(os.environ if env is None else env), "PYTHONPATH": path}
    return LaunchedStage(role, subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True), ready)


def wait_all(launched: Sequence[LaunchedStage], timeout: float = 180) -> list[dict]:
    """`LaunchedStage.wait` for each, in order; if one fails, all are killed and it raises."""
    try:
        return [one.wait(timeout) for one in launched]
    except BaseException:
        for one in launched:
            if one.proc.poll() is None:
                one.proc.kill()
                one.proc.wait()
        raise


def start_local_pipeline(checkpoint: pathlib.Path, tmp: pathlib.Path, **kwargs) -> RunningPipeline:
    """Start AR, DiT and gateway processes on loopback with request traces written to ``tmp``."""
    from mammoth_app.local import free_port, start_pipeline

    trace_dir = tmp / "traces"
    trace_dir.mkdir(parents=True, exist_ok=True)
    spare = free_port()
    env = {"MAMMOTH_TRACE_DIR": str(trace_dir), "MAMMOTH_CACHE_DIR": str(tmp / "cache"),
           "MAMMOTH_DIT_ALLOW_LIST": f"127.0.0.1:{spare}"}
    env.update(kwargs.pop("extra_env", {}))
    components = start_pipeline(
        checkpoint=str(checkpoint), gateway_port=0, slots=kwargs.pop("slots", 2), extra_env=env,
        workdir=tmp, log_level=kwargs.pop("log_level", "warning"), ready_timeout=120, **kwargs,
    )
    return RunningPipeline(components, trace_dir, tmp, spare)


async def until_health(channel, status: int, services: Sequence[str], within_s: float = 10.0) -> None:
    """Poll a stage's ``grpc.health.v1`` on ``channel`` until every one of ``services`` reports
    ``status`` (a `HealthCheckResponse` value); fails the test after ``within_s`` seconds."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + within_s
    for service in services:
        while (reply := await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status != status:
            assert time.monotonic() < deadline, f"health {service!r} still {reply.status}"
            await asyncio.sleep(0.05)


def has_ipv6_loopback() -> bool:
    """Whether this machine can listen on ``::1`` (the IPv6 tests skip without it)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False
