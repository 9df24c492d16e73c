"""`helm template | kubectl apply -f -` against the emulated API server, then the operator started
exactly as the chart's Deployment starts it reconciles the example pipeline; and the rendered RBAC
equals what the operator's requests need.

The emulator is the operator helper's `MammothEmulator` (tests/operator/mammoth_emulator.py), with
the RBAC and ServiceAccount resources declared so kubectl can apply the chart. Two identities are
told apart by bearer token, as on a real cluster: the administrator (kubectl) and the operator's
ServiceAccount (the operator process). The emulator enforces no RBAC; instead every request the
operator sends is recorded and compared with the rendered Role/ClusterRole rules, both ways.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import yaml

import chart_tools
from chart_tools import CI_VALUES_DIR, EXAMPLE_PIPELINE, REPO_ROOT, by_kind, helm_template, load_documents

sys.path.insert(0, str(REPO_ROOT / "tests" / "operator"))
kmock = pytest.importorskip("kmock")
mammoth_emulator = pytest.importorskip("mammoth_emulator")

ADMIN_TOKEN = "admin-token"
OPERATOR_TOKEN = "operator-serviceaccount-token"
PIPELINE_NAMESPACE = "team-a"  # in the served namespaces of both modes below
EXTRA_RESOURCES = [  # what the chart applies that the operator tests never needed
    ("v1/serviceaccounts", "ServiceAccount", True, ["sa"]),
    ("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole", False, []),
    ("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding", False, []),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True, []),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True, []),
]


class ChartEmulator(mammoth_emulator.MammothEmulator):
    """The operator tests' emulator, plus what `kubectl apply` of the chart needs: the RBAC and
    ServiceAccount resources. Requests bearing the operator's token are authorized against the
    rendered RBAC (`authorizer`, set per install), owner-reference permission checks included."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.subject_token = OPERATOR_TOKEN
        for key, kind, namespaced, short in EXTRA_RESOURCES:
            self.resources[key] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=namespaced,
                verbs=mammoth_emulator.VERBS, shortnames=short, subresources=[])


class EmulatorServer:
    """`MammothEmulator` served on 127.0.0.1 from its own event-loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="emulator", daemon=True)
        self.thread.start()
        self.emulator = self._call(self._start())

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _start(self):
        emulator = ChartEmulator()
        await emulator.__aenter__()
        self.server = kmock.Server(emulator)
        await self.server.__aenter__()
        return emulator

    @property
    def url(self) -> str:
        return str(self.server.url).rstrip("/")

    def get_json(self, path: str) -> dict | None:
        """GET ``path`` as the administrator; None on 404."""
        response = httpx.get(self.url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
        return None if response.status_code == 404 else response.raise_for_status().json()

    def requests(self) -> list:
        """Every request received so far (KMock's request log)."""
        return list(self.emulator)

    def close(self) -> None:
        async def stop():
            await self.server.__aexit__(None, None, None)
            await self.emulator.__aexit__(None, None, None)
        try:
            self._call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def write_kubeconfig(path: Path, server: str, token: str, namespace: str = "default") -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "user", "user": {"token": token}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "user",
                                                        "namespace": namespace}}],
    }))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Scenario:
    """One install of the chart on the emulator with the operator running from its Deployment."""

    server: EmulatorServer
    kubectl: Callable[..., subprocess.CompletedProcess]
    rendered: list[dict]
    operator: subprocess.Popen
    operator_log: Path
    liveness_url: str
    mode: str = ""
    values: Path | None = None

    def get(self, path: str) -> dict | None:
        response = httpx.get(self.server.url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        return None if response.status_code == 404 else response.raise_for_status().json()


def operator_command(deployment: dict) -> tuple[list[str], dict[str, str]]:
    """The container's command line (image ENTRYPOINT `mammoth` + args) and its literal env."""
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert "command" not in container
    entrypoint = shutil.which("mammoth", path=str(Path(sys.executable).parent)) or shutil.which("mammoth")
    assert entrypoint, "the `mammoth` console script is not installed (pip install -e .)"
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[item["name"]] = deployment["metadata"]["namespace"]
    return [entrypoint, *container["args"]], env


MODES = {"cluster-wide": None, "namespaced": CI_VALUES_DIR / "namespaced-values.yaml"}


@pytest.fixture(scope="module", params=sorted(MODES))
def installed(request, helm, kubectl, tmp_path_factory) -> Iterator[Scenario]:
    """The chart installed on a fresh emulator in one RBAC mode (cluster-wide, or the namespaces
    of ci/namespaced-values.yaml), the operator running from its Deployment; shared by the tests
    of one mode (the operator's start is the slow part)."""
    values = MODES[request.param]
    tmp_path = tmp_path_factory.mktemp(request.param)
    started: list[tuple[EmulatorServer, subprocess.Popen | None]] = []

    def install(values: Path | None, extra_set: list[str] = ()) -> Scenario:
        server = EmulatorServer()
        started.append((server, None))
        admin = write_kubeconfig(tmp_path / "admin.kubeconfig", server.url, ADMIN_TOKEN)
        operator_cfg = write_kubeconfig(tmp_path / "operator.kubeconfig", server.url, OPERATOR_TOKEN,
                                        chart_tools.RELEASE_NAMESPACE)

        def run_kubectl(*args: str, input: str | None = None, check: bool = True):
            # the emulator serves no OpenAPI document; schemas are checked by kubernetes-validate
            # (test_chart_manifests.py) and custom resources by the emulator's CRD validation
            if args and args[0] == "apply":
                args = (*args, "--validate=false")
            env = dict(os.environ, KUBECONFIG=str(admin), HOME=str(tmp_path))
            proc = subprocess.run([str(kubectl), *args], input=input, capture_output=True, text=True,
                                  env=env, timeout=60)
            if check and proc.returncode:
                raise AssertionError(f"kubectl {' '.join(args)}: {proc.stdout}\n{proc.stderr}")
            return proc

        port = free_port()
        text = helm_template(helm, values=[values] if values else [], include_crds=True,
                             set_values=[f"livenessPort={port}", f"metricsPort={free_port()}",
                                         *extra_set]).stdout
        rendered = load_documents(text)
        cluster, namespaced = granted(rendered)
        server.emulator.authorizer = lambda p: p[:3] in cluster or (p[3] and (*p[:3], p[3]) in namespaced)
        run_kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            for namespace in (chart_tools.RELEASE_NAMESPACE, "team-a", "team-b")]))
        # the CRD first, as Helm does with crds/ (kubectl maps kinds through discovery)
        crds = [d for d in rendered if d["kind"] == "CustomResourceDefinition"]
        rest = [d for d in rendered if d["kind"] != "CustomResourceDefinition"]
        run_kubectl("apply", "-f", "-", input=yaml.safe_dump_all(crds))
        applied = run_kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rest))
        for doc in rest:
            assert f"{doc['kind'].lower()}.".split(".")[0] in applied.stdout.lower(), applied.stdout

        [deployment] = by_kind(rendered, "Deployment")
        argv, env = operator_command(deployment)
        log = tmp_path / "operator.log"
        environment = dict(os.environ, **env, KUBECONFIG=str(operator_cfg), HOME=str(tmp_path))
        environment.pop("KUBERNETES_SERVICE_HOST", None)
        process = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=environment,
                                   cwd=tmp_path, start_new_session=True)
        started[-1] = (server, process)
        liveness = f"http://127.0.0.1:{port}/healthz"
        return Scenario(server, run_kubectl, rendered, process, log, liveness)

    scenario = install(values, ["examplePipeline.enabled=false"])
    scenario.mode = request.param
    scenario.values = values
    try:
        yield scenario
    finally:
        _stop(started)


def _stop(started) -> None:
    for server, process in started:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        server.close()


def reconcile_example(scenario: Scenario) -> dict:
    """Apply the CPU example with kubectl and wait until the operator has built and reported it."""
    assert scenario.operator.poll() is None, scenario.operator_log.read_text()
    scenario.kubectl("apply", "-n", PIPELINE_NAMESPACE, "-f", str(EXAMPLE_PIPELINE))
    example = yaml.safe_load(EXAMPLE_PIPELINE.read_text())
    name = example["metadata"]["name"]
    base = f"/apis/mammoth.dev/v1alpha1/namespaces/{PIPELINE_NAMESPACE}/mammothpipelines/{name}"

    def children():
        found = {}
        for stage in ("ar", "dit", "gateway"):
            deploy = scenario.get(f"/apis/apps/v1/namespaces/{PIPELINE_NAMESPACE}/deployments/{name}-{stage}")
            if not deploy:
                return None
            found[stage] = deploy
        return found

    try:
        deployments = wait_for(children, 60, "the operator to create the stage Deployments")
    except AssertionError:
        raise AssertionError(scenario.operator_log.read_text()[-6000:])
    pipeline = scenario.get(base)
    for deploy in deployments.values():
        [owner] = deploy["metadata"]["ownerReferences"]
        assert owner["kind"] == "MammothPipeline" and owner["uid"] == pipeline["metadata"]["uid"]
    # the images the chart told the operator to use
    [container] = by_kind(scenario.rendered, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    for stage, deploy in deployments.items():
        images = [c["image"] for c in deploy["spec"]["template"]["spec"]["containers"]]
        assert env[f"MAMMOTH_OPERATOR_{stage.upper()}_IMAGE"] in images
    # status written by the operator: observedGeneration and conditions
    pipeline = wait_for(lambda: (p := scenario.get(base)) and (p.get("status") or {}).get("conditions") and p,
                        30, "the pipeline status")
    # roll the Deployments out as a controller would; the operator then reports Ready
    for stage in ("ar", "dit", "gateway"):
        scenario.kubectl("patch", "deployment", f"{name}-{stage}", "-n", PIPELINE_NAMESPACE,
                         "--subresource=status", "--type=merge", "-p", json.dumps({"status": {
                             "observedGeneration": deployments[stage]["metadata"]["generation"],
                             "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1,
                             "availableReplicas": 1,
                             "conditions": [{"type": "Available", "status": "True"}]}}))

    def ready():
        current = scenario.get(base)
        conditions = {c["type"]: c["status"] for c in (current.get("status") or {}).get("conditions", [])}
        return conditions.get("Ready") == "True" and current
    try:
        return wait_for(ready, 30, "Ready=True on the pipeline")
    except AssertionError:
        raise AssertionError(f"{scenario.get(base).get('status')}\n{scenario.operator_log.read_text()[-4000:]}")


def test_helm_template_kubectl_apply_then_operator_reconciles_example(installed):
    scenario = installed
    # kopf's liveness endpoint answers, as the kubelet's probe would see it
    probe = by_kind(scenario.rendered, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
    assert probe["httpGet"]["path"] == "/healthz"
    wait_for(lambda: _ok(scenario.liveness_url) or scenario.operator.poll() is not None, 60,
             "the operator's liveness endpoint")
    assert scenario.operator.poll() is None, scenario.operator_log.read_text()[-3000:]
    pipeline = reconcile_example(scenario)
    assert pipeline["status"]["observedGeneration"] == pipeline["metadata"]["generation"]


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------------------------------------
# RBAC: the rendered rules against the operator's own requests


request_permission = mammoth_emulator.request_permission


def operator_permissions(server: EmulatorServer) -> set[tuple[str, str, str, str | None]]:
    """Every permission the operator's requests needed, including the admission plugins' own checks
    (``update`` on ``mammothpipelines/finalizers`` for ``blockOwnerDeletion``)."""
    used = set(server.emulator.checks)
    for request in server.requests():
        if request.headers.get("Authorization") != f"Bearer {OPERATOR_TOKEN}":
            continue
        permission = request_permission(request)
        if permission:
            used.add(permission)
    return used


def granted(rendered: list[dict]) -> tuple[set, set]:
    """(cluster-wide grants, per-namespace grants) as (group, resource, verb[, namespace])."""
    cluster, namespaced = set(), set()
    for role in by_kind(rendered, "ClusterRole"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        cluster.add((group, resource, verb))
    for role in by_kind(rendered, "Role"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        namespaced.add((group, resource, verb, role["metadata"]["namespace"]))
    return cluster, namespaced


# kopf lists/watches these cluster-scoped resources unless `settings.scanning.disabled`; with a
# Role only (namespace mode) the API server answers 403 and kopf carries on without them.
KOPF_TOLERATED_IN_NAMESPACE_MODE = {
    ("", "namespaces", "list", None), ("", "namespaces", "watch", None),
    ("apiextensions.k8s.io", "customresourcedefinitions", "list", None),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch", None),
}
CHILD_KINDS = {  # kubectl resource name -> API path segment (namespaced)
    "configmaps": "/api/v1", "services": "/api/v1", "deployments": "/apis/apps/v1",
    "poddisruptionbudgets": "/apis/policy/v1", "horizontalpodautoscalers": "/apis/autoscaling/v2",
    "networkpolicies": "/apis/networking.k8s.io/v1", "secrets": "/api/v1",
}


def exercise_every_child(scenario: Scenario) -> None:
    """Drive the operator through every call it can make on children, after the example is Ready.

    1. switch the optional children on (HorizontalPodAutoscaler, NetworkPolicy: create);
    2. drift every child (an administrator removes one of its managed labels), then change the
       spec so the operator reconciles: it patches each drifted child back (patch);
    3. switch the optional children and a PodDisruptionBudget off (delete).
    """
    example = yaml.safe_load(EXAMPLE_PIPELINE.read_text())
    name = example["metadata"]["name"]

    def change_spec(patch: dict, what: str) -> None:
        before = len(scenario.server.emulator.writes)
        scenario.kubectl("patch", "mammothpipeline", name, "-n", PIPELINE_NAMESPACE, "--type=merge",
                         "-p", json.dumps({"spec": patch}))
        wait_for(lambda: any(w["resource"] != "mammoth.dev/v1alpha1/mammothpipelines"
                             for w in scenario.server.emulator.writes[before:]), 30, what)
        time.sleep(1.5)  # the status timer runs at least once more

    change_spec({"networkPolicy": {"enabled": True}, "ar": {"autoscaling": {"enabled": True}}},
                "the HPA and NetworkPolicy")
    drifted = 0
    for plural, prefix in CHILD_KINDS.items():
        listing = scenario.get(f"{prefix}/namespaces/{PIPELINE_NAMESPACE}/{plural}") or {"items": []}
        for item in listing["items"]:
            labels = item["metadata"].get("labels") or {}
            key = next((k for k in sorted(labels) if k.startswith("app.kubernetes.io/")), None)
            if key:
                scenario.kubectl("patch", plural, item["metadata"]["name"], "-n", PIPELINE_NAMESPACE,
                                 "--type=merge", "-p", json.dumps({"metadata": {"labels": {key: None}}}))
                drifted += 1
    assert drifted >= len(CHILD_KINDS)
    change_spec({"requestDefaults": {"steps": 9}}, "the operator to repair drifted children")
    change_spec({"networkPolicy": {"enabled": False},
                 "ar": {"autoscaling": {"enabled": False}, "podDisruptionBudget": {"enabled": False}}},
                "the optional children to be deleted")
    deleted = [f"{prefix}/namespaces/{PIPELINE_NAMESPACE}/{plural}/{name}-{suffix}"
               for plural, prefix, suffix in (("horizontalpodautoscalers", "/apis/autoscaling/v2", "ar"),
                                              ("poddisruptionbudgets", "/apis/policy/v1", "ar"))]
    wait_for(lambda: all(scenario.get(path) is None for path in deleted), 30, f"deletion of {deleted}")
    policies = f"/apis/networking.k8s.io/v1/namespaces/{PIPELINE_NAMESPACE}/networkpolicies"
    wait_for(lambda: not (scenario.get(policies) or {}).get("items"), 30, "the NetworkPolicy's deletion")


def test_rbac_rules_are_exactly_what_the_operator_calls(installed):
    """Runs after the reconcile test of the same mode (the example is Ready), with RBAC enforced."""
    scenario, values = installed, installed.values
    example = yaml.safe_load(EXAMPLE_PIPELINE.read_text())["metadata"]["name"]
    if not scenario.get(f"/apis/apps/v1/namespaces/{PIPELINE_NAMESPACE}/deployments/{example}-ar"):
        reconcile_example(scenario)  # run alone (-k): build the example first
    exercise_every_child(scenario)
    used = operator_permissions(scenario.server)
    if os.environ.get("MAMMOTH_SHOW_RBAC"):
        print("\nUSED", *sorted(used, key=str), sep="\n  ")
    cluster, namespaced = granted(scenario.rendered)
    served = set(yaml.safe_load(values.read_text())["watchNamespaces"]) if values else None

    not_granted = []
    for group, resource, verb, namespace in sorted(used, key=str):
        if (group, resource, verb) in cluster:
            continue
        if namespace and (group, resource, verb, namespace) in namespaced:
            continue
        not_granted.append((group, resource, verb, namespace))
    assert set(not_granted) == set(scenario.server.emulator.denied)
    if served is not None:
        # kopf's cluster-scoped discovery of namespaces and CRDs: denied (403) in namespace mode,
        # which kopf tolerates by falling back to the namespaces it was given (and says so)
        tolerated = {p for p in not_granted if p in KOPF_TOLERATED_IN_NAMESPACE_MODE}
        log = scenario.operator_log.read_text()
        if any(p[1] == "namespaces" for p in tolerated):
            assert "Not enough permissions to list namespaces" in log, log[-3000:]
        if any(p[1] == "customresourcedefinitions" for p in tolerated):
            assert "Not enough permissions" in log, log[-3000:]
        not_granted = [p for p in not_granted if p not in tolerated]
    assert not_granted == [], f"the operator calls beyond its RBAC: {not_granted}"

    used_rules = {(g, r, v) for g, r, v, _ in used}
    if served is None:
        unused = cluster - used_rules
        assert by_kind(scenario.rendered, "Role") == []
    else:
        assert cluster == set(), "namespace mode must grant nothing cluster-wide"
        assert {ns for *_, ns in namespaced} == served
        # each Role is the same rule list; one namespace's use shows each rule is needed
        unused = {(g, r, v) for g, r, v, ns in namespaced} - used_rules
    assert unused == set(), f"granted but never used by the operator: {sorted(unused)}"


def test_operator_stops_cleanly_on_sigterm(installed):
    """SIGTERM (what the kubelet sends on a rollout or `helm uninstall`) ends the operator, exit 0."""
    assert installed.operator.poll() is None, installed.operator_log.read_text()[-3000:]
    installed.operator.send_signal(signal.SIGTERM)
    assert installed.operator.wait(timeout=30) == 0, installed.operator_log.read_text()[-3000:]
