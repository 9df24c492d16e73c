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
from pipeline_harness import launch_stage, metric_samples, wait_all

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
    """A real ``mammoth ar|dit`` process started by `StageFactory` (`pipeline_harness.launch_stage`)."""

    role: str
    proc: subprocess.Popen
    address: str
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.metrics_url.rsplit("/metrics", 1)[0], name, **labels)


class StageFactory:
    """Real stage processes holding one set of per-role stage tokens (the gateway presents
    ``gateway_token_file``); an AR may push to every DiT of the factory started before or with it.
    `close` kills whatever is still running."""

    def __init__(self, checkpoint: pathlib.Path, tmp: pathlib.Path) -> None:
        from mammoth_app.local import generate_role_tokens

        self.checkpoint, self.tmp = checkpoint, tmp
        self.tokens = generate_role_tokens(tmp)
        self.gateway_token_file = self.tokens["MAMMOTH_GATEWAY_TOKEN_FILE"]
        self.started: list[RealStage] = []

    def __call__(self, role: str, *args: str) -> RealStage:
        """Start one stage (``role`` ``ar``/``dit``, extra CLI ``args``) and wait until it serves."""
        return self.together((role, *args))[0]

    def together(self, *specs: tuple[str, ...]) -> list[RealStage]:
        """Start one stage per ``(role, *args)`` all at once; return them, in order, once all serve.
        A DiT's port is chosen up front, so the ARs of the same call may push to it."""
        from mammoth_app.local import free_port

        plan, dits = [], [s.address for s in self.started if s.role == "dit"]
        for role, *args in specs:
            if role == "dit":
                port = free_port()
                args, dits = [*args, "--port", str(port)], [*dits, f"127.0.0.1:{port}"]
            plan.append((role, args))
        allow = ("--dit-allow-list", ",".join(dits)) if dits else ()
        env = {**os.environ, **self.tokens}
        launched = [launch_stage(role, self.checkpoint, self.tmp, *args, *(allow if role == "ar" else ()), env=env)
                    for role, args in plan]
        infos = wait_all(launched)
        stages = [RealStage(one.role, one.proc, info["address"],
                            f"http://127.0.0.1:{info['metrics_port']}/metrics")
                  for one, info in zip(launched, infos)]
        self.started += stages
        return stages

    def kill(self, *stages: RealStage) -> None:
        """SIGKILL ``stages`` (those still running) and reap them."""
        for stage in stages:
            _kill(stage.proc)

    def close(self) -> None:
        """Kill every stage the factory started."""
        self.kill(*self.started)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture
def real_stages(tiny_checkpoint, tmp_path):
    """A `StageFactory` for one test: ``real_stages(role, *args)`` starts a real stage process,
    ``real_stages.together(...)`` several at once; all are killed at teardown."""
    factory = StageFactory(tiny_checkpoint, tmp_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def module_stages(tiny_checkpoint, tmp_path_factory):
    """A `StageFactory` shared by the tests of one module; its stages are killed after the module."""
    factory = StageFactory(tiny_checkpoint, tmp_path_factory.mktemp("stages"))
    yield factory
    factory.close()
