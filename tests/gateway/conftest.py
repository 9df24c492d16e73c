"""Fixtures for the gateway tests: the gateway app served by uvicorn on 127.0.0.1:0 (in a thread of
this process, real HTTP), fake AR/DiT stage processes (tests/gateway/fake_stages.py, real gRPC), and
helpers to read the gateway's Prometheus metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from pipeline_harness import metric_samples

from gateway.app import build_app
from mammoth_core.settings import GatewaySettings

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def metric_value(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples ``name`` with ``labels`` on ``base_url/metrics`` (0 when absent)."""
    return sum(metric_samples(f"{base_url}/metrics", name, labels))


class GatewayThread:
    """`build_app(settings)` under uvicorn on 127.0.0.1:0 in a background thread."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.app = build_app(settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, lifespan="on",
                                log_config=None, access_log=False, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.server.capture_signals = _no_signals  # type: ignore[method-assign]
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> "GatewayThread":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(f"{self.url}/readyz").status_code == 200:
                return
            time.sleep(0.02)
        raise RuntimeError("gateway never became ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.url, name, **labels)


def _no_signals():
    import contextlib

    return contextlib.nullcontext()


@dataclasses.dataclass
class FakeStage:
    role: str
    proc: subprocess.Popen
    address: str
    events_path: pathlib.Path

    def events(self) -> list[dict]:
        if not self.events_path.exists():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines() if line]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def spawn_fake(role: str, tmp: pathlib.Path, *args: str) -> FakeStage:
    """Start a fake stage process and wait until it listens (it reports SERVING at once)."""
    n = len(list(tmp.glob(f"{role}-*.ready")))
    ready = tmp / f"{role}-{n}.ready"
    events = tmp / f"{role}-{n}.events"
    proc = subprocess.Popen([sys.executable, str(HERE / "fake_stages.py"), role, "--ready-file",
                             str(ready), "--events", str(events), *args],
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 30
    while not (ready.exists() and ready.stat().st_size):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"fake {role} did not start")
        time.sleep(0.02)
    return FakeStage(role, proc, json.loads(ready.read_text())["address"], events)


@pytest.fixture
def fakes(tmp_path):
    """Factory of fake stage processes, all killed at teardown."""
    started: list[FakeStage] = []

    def make(role: str, *args: str) -> FakeStage:
        stage = spawn_fake(role, tmp_path, *args)
        started.append(stage)
        return stage

    yield make
    for stage in started:
        if stage.proc.poll() is None:
            stage.proc.send_signal(signal.SIGKILL)
            stage.proc.wait()


def small_settings(**overrides) -> GatewaySettings:
    """Gateway settings for fast tests: tiny sizes allowed, few steps."""
    values = dict(host="127.0.0.1", port=0, default_steps=4, default_size="64x64",
                  min_pixels=16 * 16, max_pixels=512 * 512, max_steps=50,
                  request_timeout_seconds=30.0, health_interval_seconds=0.2,
                  image_ttl_seconds=60.0, queue_size=8, max_prompt_chars=200)
    values.update(overrides)
    return GatewaySettings(**values)


@pytest.fixture
def gateway_factory():
    """Start gateways (`GatewayThread`) with `small_settings(**overrides)`; stopped at teardown."""
    started: list[GatewayThread] = []

    def make(**overrides) -> GatewayThread:
        gw = GatewayThread(small_settings(**overrides)).start()
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


@dataclasses.dataclass
class RealStage:
    """A real ``mammoth ar|dit`` process started by `spawn_stage`."""

    role: str
    proc: subprocess.Popen
    address: str
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.metrics_url.rsplit("/metrics", 1)[0], name, **labels)


def spawn_stage(role: str, checkpoint: pathlib.Path, tmp: pathlib.Path, *args: str,
                env: dict[str, str] | None = None) -> RealStage:
    """Start ``python -m mammoth_app.cli ROLE`` on a free port; wait for its ready file."""
    n = len(list(tmp.glob(f"real-{role}-*.ready")))
    ready = tmp / f"real-{role}-{n}.ready"
    cmd = [sys.executable, "-m", "mammoth_app.cli", role, "--host", "127.0.0.1", "--checkpoint",
           str(checkpoint), "--port", "0", "--metrics-port", "0", "--torch-threads", "1",
           "--log-level", "warning", "--ready-file", str(ready), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MAMMOTH_CACHE_DIR": str(tmp / "cache"), **(env or {})}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 180
    while not (ready.exists() and ready.stat().st_size):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{role} did not start")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return RealStage(role, proc, info["address"],
                     f"http://127.0.0.1:{info['metrics_port']}/metrics")


@pytest.fixture
def real_stages(tiny_checkpoint, tmp_path):
    """Factory of real stage processes, killed at teardown. They hold per-role stage tokens (the
    gateway presents ``make.gateway_token_file``); an AR may push to the DiTs started before it."""
    from mammoth_app.local import generate_role_tokens

    started: list[RealStage] = []
    tokens = generate_role_tokens(tmp_path)

    def make(role: str, *args: str) -> RealStage:
        dits = [s.address for s in started if s.role == "dit"]
        if role == "ar" and dits:
            args = (*args, "--dit-allow-list", ",".join(dits))
        stage = spawn_stage(role, tiny_checkpoint, tmp_path, *args, env=tokens)
        started.append(stage)
        return stage

    make.gateway_token_file = tokens["MAMMOTH_GATEWAY_TOKEN_FILE"]
    yield make
    for stage in started:
        if stage.proc.poll() is None:
            stage.proc.kill()
            stage.proc.wait()
