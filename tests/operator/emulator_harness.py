"""Helpers and fixtures of the operator tests: the emulated API server, a kubeconfig, kubectl, the
running operator (``conftest.py`` re-exports the fixtures).

The emulator (:class:`mammoth_emulator.MammothEmulator`) runs its own event loop in a background
thread, on 127.0.0.1; the operator runs in kopf's ``KopfRunner`` thread; the tests are plain
functions that talk HTTP to the emulator (``api`` fixture) or run the real ``kubectl``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import pathlib
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import kmock
import pytest
import yaml

from mammoth_emulator import MammothEmulator

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "charts" / "mammoth-operator" / "crds" / "mammothpipelines.mammoth.dev.yaml"
EXAMPLE_FILE = ROOT / "mammothpipeline.yaml"
NAMESPACE = "default"
PIPELINES = "/apis/mammoth.dev/v1alpha1/namespaces/default/mammothpipelines"


def load_yaml(path: pathlib.Path) -> Any:
    with path.open() as f:
        return yaml.safe_load(f)


class EmulatorThread:
    """The emulator served from its own event loop thread (so tests and the operator may block)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kmock", daemon=True)
        self.thread.start()
        self.emulator: MammothEmulator = self._call(self._start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _start(self) -> MammothEmulator:
        emulator = MammothEmulator()
        await emulator.__aenter__()
        self._server = kmock.Server(emulator)
        await self._server.__aenter__()
        return emulator

    async def _stop(self) -> None:
        await self._server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    @property
    def url(self) -> str:
        return str(self._server.url).rstrip("/")

    def close(self) -> None:
        try:
            self._call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


class Api:
    """A tiny synchronous client of the emulator (plain JSON over HTTP)."""

    def __init__(self, base: str, emulator: MammothEmulator) -> None:
        self.base = base
        self.emulator = emulator
        self.http = httpx.Client(base_url=base, timeout=10)

    def get(self, path: str) -> dict[str, Any] | None:
        r = self.http.get(path)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def create(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body)

    def patch(self, path: str, body: dict[str, Any]) -> httpx.Response:
        r = self.http.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"})
        return r

    def pipeline(self, name: str) -> dict[str, Any] | None:
        return self.get(f"{PIPELINES}/{name}")

    def child(self, kind: str, name: str) -> dict[str, Any] | None:
        return self.get(child_path(kind, name))

    def mark_ready(self, kind_name: str) -> None:
        """Pretend the Deployment controller rolled out every pod of a Deployment and they passed readiness."""
        deploy = self.child("Deployment", kind_name)
        assert deploy is not None, kind_name
        replicas = deploy["spec"].get("replicas", 1)
        status = {
            "observedGeneration": deploy["metadata"]["generation"],
            "replicas": replicas, "updatedReplicas": replicas, "readyReplicas": replicas,
            "availableReplicas": replicas,
            "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                           {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}],
        }
        r = self.patch(child_path("Deployment", kind_name) + "/status", {"status": status})
        r.raise_for_status()


_PATHS = {
    "ConfigMap": "/api/v1/namespaces/default/configmaps",
    "Service": "/api/v1/namespaces/default/services",
    "Deployment": "/apis/apps/v1/namespaces/default/deployments",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/default/poddisruptionbudgets",
    "HorizontalPodAutoscaler": "/apis/autoscaling/v2/namespaces/default/horizontalpodautoscalers",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies",
    "Secret": "/api/v1/namespaces/default/secrets",
    "MammothPipeline": PIPELINES,
}
CHILD_RESOURCES = {
    "v1/configmaps", "v1/secrets", "v1/services", "apps/v1/deployments", "policy/v1/poddisruptionbudgets",
    "autoscaling/v2/horizontalpodautoscalers", "networking.k8s.io/v1/networkpolicies",
}


def child_path(kind: str, name: str) -> str:
    return f"{_PATHS[kind]}/{name}"


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (AssertionError, KeyError, TypeError) as e:
            last_error, value = e, None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (f" (last error: {last_error!r})" if last_error else ""))


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return cond
    return None


def example_pipeline(name: str = "tiny", **spec_overrides: Any) -> dict[str, Any]:
    """The repository's example resource, renamed and with top-level spec keys replaced."""
    body = copy.deepcopy(load_yaml(EXAMPLE_FILE))
    body["metadata"] = {"name": name, "namespace": NAMESPACE}
    body["spec"].update(copy.deepcopy(spec_overrides))
    return body


@pytest.fixture
def emulator_thread() -> Iterator[EmulatorThread]:
    server = EmulatorThread()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def emulator(emulator_thread: EmulatorThread) -> MammothEmulator:
    return emulator_thread.emulator


@pytest.fixture
def kubeconfig(emulator_thread: EmulatorThread, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """A kubeconfig pointing at the emulator, exported as ``KUBECONFIG`` (kopf, the client, kubectl)."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": emulator_thread.url}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester", "namespace": NAMESPACE}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("KUBECONFIG", str(path))
    # The kubernetes client reads $KUBECONFIG once, at import: point its default at this test's file.
    import kubernetes.config.kube_config

    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return path


@pytest.fixture
def api(emulator_thread: EmulatorThread, kubeconfig: pathlib.Path) -> Iterator[Api]:
    client = Api(emulator_thread.url, emulator_thread.emulator)
    try:
        yield client
    finally:
        client.http.close()


@pytest.fixture
def crd_installed(api: Api) -> dict[str, Any]:
    """The CRD created through the API (registers the resource, its schema and CEL rules)."""
    crd = load_yaml(CRD_FILE)
    r = api.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    assert r.status_code in (200, 201), r.text
    return crd


def find_kubectl() -> str | None:
    """``$KUBECTL``, else ``.cache/kube-tools/bin/kubectl`` (scripts/fetch_kube_tools.sh)."""
    candidates = [os.environ.get("KUBECTL"), str(ROOT / ".cache" / "kube-tools" / "bin" / "kubectl"), shutil.which("kubectl")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture
def kubectl(kubeconfig: pathlib.Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the real kubectl against the emulator (skips locally if absent; fails in CI)."""
    binary = find_kubectl()
    if binary is None:
        message = "kubectl not found: run scripts/fetch_kube_tools.sh (or set KUBECTL)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), HOME=str(kubeconfig.parent))
        result = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, env=env)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    return run


class OperatorLog(logging.Handler):
    """Collects the operator's log records (kopf's included) for assertions."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(f"{r.levelname} {r.name}: {r.getMessage()}" for r in self.records)


class OperatorProcess:
    """Starts and stops the operator (kopf's ``KopfRunner`` thread) against the emulator.

    ``liveness_port`` serves kopf's ``/healthz`` on 127.0.0.1; ``stale_seconds`` is the operator's
    ``probe_stale_seconds`` (how old the last successful reconcile or observation may be).
    """

    def __init__(self, log: OperatorLog, liveness_port: int | None = None, stale_seconds: float | None = None) -> None:
        self.log = log
        self.liveness_port = liveness_port
        self.stale_seconds = stale_seconds
        self.runner: Any = None

    def start(self) -> None:
        import kopf
        from kopf.testing import KopfRunner

        from mammoth_operator.config import OperatorConfig
        from mammoth_operator.handlers import register

        overrides: dict[str, Any] = {"request_timeout": 10.0}
        if self.stale_seconds is not None:
            overrides["probe_stale_seconds"] = self.stale_seconds
        config = OperatorConfig(
            images={"ar": "ghcr.io/mammoth-pipeline/mammoth-ar:test", "dit": "ghcr.io/mammoth-pipeline/mammoth-dit:test",
                    "gateway": "ghcr.io/mammoth-pipeline/mammoth-gateway:test"},
            **overrides,
        )
        registry = register(kopf.OperatorRegistry(), config)
        args = ["run", "--standalone", "--namespace", NAMESPACE, "--verbose"]
        if self.liveness_port is not None:
            args.append(f"--liveness=http://127.0.0.1:{self.liveness_port}/healthz")
        self.runner = KopfRunner(args, registry=registry, timeout=30)
        self.runner.__enter__()

    def stop(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            runner.__exit__(None, None, None)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def operator_log() -> Iterator[OperatorLog]:
    handler = OperatorLog()
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    for noisy in ("httpx", "httpcore", "urllib3", "aiohttp", "asyncio", "celpy", "kubernetes"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


@pytest.fixture
def running_operator(api: Api, crd_installed: dict[str, Any], operator_log: OperatorLog) -> Iterator[OperatorProcess]:
    """The operator running against the emulator (the CRD installed first); stopped at teardown."""
    process = OperatorProcess(operator_log)
    process.start()
    try:
        yield process
    finally:
        process.stop()
        text = operator_log.text()
        assert "Patching failed with inconsistencies" not in text, text
        assert api.emulator.pruned == [], "the operator wrote fields the CRD schema prunes"


def child_writes(emulator: MammothEmulator, since: int = 0, verbs: tuple[str, ...] = ("create", "patch")) -> list[dict[str, Any]]:
    """Writes to child resources (not the pipelines, not events) since index ``since`` of the write log."""
    return [w for w in emulator.writes[since:] if w["resource"] in CHILD_RESOURCES and w["verb"] in verbs]
