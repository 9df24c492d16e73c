"""Issue #14: the operator is level-triggered and safe on a real cluster (extended emulator, real kubectl).

Each test failed on the operator before the fix (see docs/OPERATOR.md, "Guarantees").
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from emulator_harness import PIPELINES, Api, OperatorProcess, condition, example_pipeline, free_port, wait_for
from test_operator import patch_spec, wait_applied

HASH = "mammoth.dev/config-hash"


def _template_annotations(api: Api, component: str) -> dict:
    return api.child("Deployment", f"tiny-{component}")["spec"]["template"]["metadata"]["annotations"]


def _status_patches(emulator, since: int = 0) -> list[dict]:
    return [w["body"].get("status") or {} for w in emulator.writes[since:]
            if w["resource"] == "mammoth.dev/v1alpha1/mammothpipelines" and w.get("subresource") == "status"]


def test_drift_is_repaired_within_seconds_and_reported(api, running_operator, kubectl, emulator):
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    old_uid = api.child("Deployment", "tiny-dit")["metadata"]["uid"]
    since = len(emulator.writes)

    kubectl("delete", "deployment", "tiny-dit")
    t0 = time.monotonic()
    wait_for(lambda: (d := api.child("Deployment", "tiny-dit")) and d["metadata"]["uid"] != old_uid,
             timeout=15, what="the deleted DiT Deployment recreated")
    print(f"deleted DiT Deployment recreated after {time.monotonic() - t0:.2f} s")
    missing = [s for s in _status_patches(emulator, since)
               if any(c["type"] == "Degraded" and c["status"] == "True" and c["reason"] == "ChildMissing"
                      for c in s.get("conditions") or [])]
    assert missing, _status_patches(emulator, since)
    assert "Deployment tiny-dit" in next(c for c in missing[0]["conditions"] if c["type"] == "Degraded")["message"]
    wait_for(lambda: condition(api.pipeline("tiny"), "Degraded")["status"] == "False", timeout=15, what="Degraded=False")

    kubectl("scale", "deployment", "tiny-ar", "--replicas=3")
    t0 = time.monotonic()
    wait_for(lambda: api.child("Deployment", "tiny-ar")["spec"]["replicas"] == 1, timeout=15, what="AR replicas back to 1")
    print(f"hand-scaled AR back to 1 replica after {time.monotonic() - t0:.2f} s")

    kubectl("patch", "service", "tiny-gateway", "--type=merge", "-p", json.dumps({"spec": {"sessionAffinity": "None"}}))
    wait_for(lambda: api.child("Service", "tiny-gateway")["spec"]["sessionAffinity"] == "ClientIP",
             timeout=15, what="gateway Service repaired")


def test_enabling_and_disabling_autoscaling_keeps_the_replica_count(api, running_operator):
    assert api.create(PIPELINES, example_pipeline(ar={"replicas": 3})).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    assert api.child("Deployment", "tiny-ar")["spec"]["replicas"] == 3
    patch_spec(api, "tiny", {"ar": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 5}}})
    wait_applied(api, "tiny", 2)
    assert api.child("HorizontalPodAutoscaler", "tiny-ar") is not None
    assert api.child("Deployment", "tiny-ar")["spec"]["replicas"] == 3  # a null here would default to 1
    patch_spec(api, "tiny", {"ar": {"autoscaling": {"enabled": False}}})
    wait_applied(api, "tiny", 3)
    assert api.child("HorizontalPodAutoscaler", "tiny-ar") is None
    assert api.child("Deployment", "tiny-ar")["spec"]["replicas"] == 3


def test_forbidden_apply_is_retried_and_reported(api, running_operator, emulator):
    emulator.subject_token = "test-token"  # the operator's identity in these tests
    denied = threading.Event()
    denied.set()
    emulator.authorizer = lambda p: not (denied.is_set() and p[1] == "deployments" and p[2] == "create")
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    degraded = wait_for(lambda: (c := condition(api.pipeline("tiny"), "Degraded")) and c["reason"] == "ApplyFailed" and c,
                        what="Degraded/ApplyFailed")
    assert "403" in degraded["message"]
    denied.clear()  # an administrator fixes the RBAC: no spec change needed
    wait_for(lambda: api.child("Deployment", "tiny-gateway") is not None, timeout=40, what="children created after 403")
    wait_for(lambda: condition(api.pipeline("tiny"), "Degraded")["status"] == "False", timeout=15, what="Degraded=False")


def test_delete_finishes_with_the_operator_stopped(api, crd_installed, operator_log, kubectl):
    operator = OperatorProcess(operator_log)
    operator.start()
    try:
        assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
        wait_applied(api, "tiny", 1)
        time.sleep(1)
    finally:
        operator.stop()
    assert api.pipeline("tiny")["metadata"].get("finalizers") in (None, [])
    kubectl("delete", "mmp", "--all", "--timeout=20s")
    assert api.pipeline("tiny") is None
    assert api.child("Deployment", "tiny-ar") is None  # garbage-collected through the owner reference


def test_each_edit_rolls_only_the_components_that_read_it(api, running_operator):
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    before = {c: _template_annotations(api, c)[HASH] for c in ("ar", "dit", "gateway")}
    patch_spec(api, "tiny", {"requestDefaults": {"steps": 20}})
    wait_applied(api, "tiny", 2)
    after = {c: _template_annotations(api, c)[HASH] for c in ("ar", "dit", "gateway")}
    assert after["ar"] == before["ar"] and after["dit"] == before["dit"]
    assert after["gateway"] != before["gateway"]
    patch_spec(api, "tiny", {"dit": {"slots": 2}})
    wait_applied(api, "tiny", 3)
    last = {c: _template_annotations(api, c)[HASH] for c in ("ar", "dit", "gateway")}
    assert last["dit"] != after["dit"] and last["ar"] == after["ar"] and last["gateway"] == after["gateway"]


def test_an_object_we_do_not_own_is_never_taken_over(api, running_operator, emulator):
    foreign = {"metadata": {"name": "tiny-config", "labels": {"team": "other"}}, "data": {"x": "1"}}
    assert api.create("/api/v1/namespaces/default/configmaps", foreign).status_code in (200, 201)
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    degraded = wait_for(lambda: (c := condition(api.pipeline("tiny"), "Degraded")) and c["reason"] == "NameConflict" and c,
                        what="Degraded/NameConflict")
    assert "ConfigMap tiny-config" in degraded["message"]
    stored = api.child("ConfigMap", "tiny-config")
    assert stored["data"] == {"x": "1"} and not stored["metadata"].get("ownerReferences")


def test_stage_pods_request_cpu_and_memory(api, running_operator):
    body = example_pipeline(model={"source": "hf://org/repo@0123456789abcdef0123456789abcdef01234567"})
    assert api.create(PIPELINES, body).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    for component in ("ar", "dit", "gateway"):
        pod = api.child("Deployment", f"tiny-{component}")["spec"]["template"]["spec"]
        for container in pod["containers"] + pod.get("initContainers", []):
            requests = container["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), (component, container["name"], requests)
        assert pod["automountServiceAccountToken"] is False
        assert pod["terminationGracePeriodSeconds"] <= 600


def test_children_client_times_out_on_a_stuck_server(api, emulator):
    from mammoth_operator import kube

    emulator.stall = lambda request: 30.0
    children = kube.Children(kube.new_api_client(), timeout=2.0)
    outcome: list = []

    def read() -> None:
        try:
            children.read("apps/v1", "Deployment", "default", "x")
        except Exception as e:  # noqa: BLE001 - the outcome is the assertion
            outcome.append(e)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout=8)
    emulator.stall = None
    assert not thread.is_alive(), "the API call hung past its timeout"
    assert outcome, "a stalled read must raise"


def test_liveness_fails_when_the_operator_is_stuck(api, crd_installed, operator_log, emulator):
    import httpx

    port = free_port()
    operator = OperatorProcess(operator_log, liveness_port=port, stale_seconds=3.0)
    operator.start()
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        wait_for(lambda: httpx.get(url, timeout=2).status_code == 200, what="healthy at start")
        emulator.stall = lambda request: 0.0 if request.params.get("watch") else 20.0
        wait_for(lambda: httpx.get(url, timeout=10).status_code >= 500, timeout=30, what="/healthz failing")
    finally:
        emulator.stall = None
        operator.stop()


@pytest.mark.parametrize("change", [
    {"ar": {"podDisruptionBudget": {"maxUnavailable": 0}}},
    {"model": {"source": "hf://org/repo@main"}},
])
def test_crd_refuses_unsafe_specs(api, crd_installed, change):
    r = api.create(PIPELINES, example_pipeline(**change))
    assert r.status_code == 422, r.text


def test_stage_tokens_secret_is_generated_mounted_and_rotated(api, running_operator, kubectl):
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    secret = wait_for(lambda: api.get("/api/v1/namespaces/default/secrets/tiny-stage-tokens"), what="token Secret")
    assert set(secret["data"]) == {"gateway", "ar"}
    assert secret["metadata"]["ownerReferences"][0]["name"] == "tiny"
    for component in ("ar", "dit", "gateway"):
        pod = api.child("Deployment", f"tiny-{component}")["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "role-tokens")
        assert volume["secret"]["secretName"] == "tiny-stage-tokens"
    before = _template_annotations(api, "ar")
    kubectl("delete", "secret", "tiny-stage-tokens")
    rotated = wait_for(lambda: (s := api.get("/api/v1/namespaces/default/secrets/tiny-stage-tokens"))
                       and s["metadata"]["uid"] != secret["metadata"]["uid"] and s, timeout=15, what="Secret recreated")
    assert rotated["data"] != secret["data"]
    wait_for(lambda: _template_annotations(api, "ar") != before, timeout=15, what="AR pods roll onto the new tokens")


def test_network_policy_is_on_by_default_and_covers_the_gateway(api, running_operator):
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    policy = api.child("NetworkPolicy", "tiny-stages")
    assert policy is not None
    components = policy["spec"]["podSelector"]["matchExpressions"][0]["values"]
    assert set(components) == {"ar", "dit", "gateway"}



def test_a_finalizer_left_by_an_older_operator_is_removed(api, running_operator, kubectl):
    body = example_pipeline()
    body["metadata"]["finalizers"] = ["mammoth.dev/finalizer"]  # what the timer-based operator added
    assert api.create(PIPELINES, body).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    wait_for(lambda: not api.pipeline("tiny")["metadata"].get("finalizers"), what="legacy finalizer removed")
    kubectl("delete", "mmp", "tiny", "--timeout=20s")


def _observed(log, since: int, kind_plural: str, name: str) -> int:
    """How many of ``name``'s events kopf's ``observe_<plural>`` handler finished after ``log.records[since]``."""
    return sum(1 for r in log.records[since:] if (getattr(r, "k8s_ref", None) or {}).get("name") == name
               and r.getMessage() == f"Handler 'observe_{kind_plural}' succeeded.")


def test_a_late_event_older_than_the_operators_own_write_repairs_nothing(api, running_operator, emulator, operator_log):
    """A watch delivers a child's events late (in order): here the Deployment controller's status write
    to tiny-ar, made before the operator patched the replicas, arrives after the reconcile finished.
    The operator took the event's object (replicas 1) for drift and patched the replicas a second
    time, with a ``Repaired`` Warning saying the child had drifted from the spec, which it had not.
    The operator now knows what it wrote and repairs nothing from an event older than that write."""
    from test_operator import handled

    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    wait_for(lambda: handled(api, "tiny"), what="kopf done with tiny")
    logged = len(operator_log.records)
    emulator.watch_lag.add("apps/v1/deployments")
    try:
        api.mark_ready("tiny-ar")  # the Deployment controller's write: its event is held back
        since = len(emulator.writes)
        patch_spec(api, "tiny", {"ar": {"replicas": 3}})
        wait_applied(api, "tiny", 2)
    finally:
        emulator.watch_lag.discard("apps/v1/deployments")
    # both held events of tiny-ar handled: the status write's (spec as before) and the operator's patch's
    wait_for(lambda: _observed(operator_log, logged, "deployments", "tiny-ar") >= 2, timeout=30,
             what="both late events of tiny-ar handled")
    time.sleep(1.0)  # a repair runs inside the event's handler, or right after the run it waited for
    writes = [(w["verb"], w["name"], w.get("subresource")) for w in emulator.writes[since:]
              if w["resource"] == "apps/v1/deployments"]
    warnings = [w["body"].get("message") for w in emulator.writes[since:]
                if w["resource"].endswith("/events") and w["body"].get("reason") == "Repaired"]
    assert (writes, warnings) == ([("patch", "tiny-ar", None)], []), (writes, warnings)
    assert api.child("Deployment", "tiny-ar")["spec"]["replicas"] == 3
