"""Issue #14: the operator is level-triggered and safe on a real cluster (extended emulator, real kubectl).

Each test failed on the operator before the fix (see docs/OPERATOR.md, "Guarantees").
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from kmock._internal import enums

from emulator_harness import PIPELINES, Api, OperatorProcess, condition, example_pipeline, free_port, wait_for
from test_operator import handled, patch_spec, wait_applied

HASH = "mammoth.dev/config-hash"
DEPLOYMENTS = "apps/v1/deployments"
DEPLOYMENTS_PATH = "/apis/apps/v1/namespaces/default/deployments"


def _warnings(emulator, since: int, reason: str) -> list[str]:
    return [w["body"].get("message") for w in emulator.writes[since:]
            if w["resource"].endswith("/events") and w["body"].get("reason") == reason]


def _writes(emulator, since: int, resource: str, name: str | None = None) -> list[tuple]:
    return [(w["verb"], w["name"], w.get("subresource")) for w in emulator.writes[since:]
            if w["resource"] == resource and (name is None or w["name"] == name) and w["verb"] in ("create", "patch")]


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


def _late_controller_write(api, emulator, operator_log, resource: str, plural: str, child: str,
                           controller_write, spec: dict) -> list[tuple]:
    """A controller's write to ``child`` (``controller_write()``) whose watch event is held back
    (``MammothEmulator.watch_lag`` on ``resource``) while the pipeline's spec changes to ``spec``;
    then both late events are delivered and handled. Returns the child's writes since the controller's
    (the operator's) and asserts no ``Repaired`` warning came of it."""
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    wait_for(lambda: handled(api, "tiny"), what="kopf done with tiny")
    logged = len(operator_log.records)
    emulator.watch_lag.add(resource)
    try:
        controller_write()
        since = len(emulator.writes)
        patch_spec(api, "tiny", spec)
        wait_applied(api, "tiny", 2)
    finally:
        emulator.watch_lag.discard(resource)
    # both held events handled: the controller's write's (its spec as before) and the operator's patch's
    wait_for(lambda: _observed(operator_log, logged, plural, child) >= 2, timeout=30,
             what=f"both late events of {child} handled")
    time.sleep(1.0)  # a repair runs inside the event's handler, or right after the run it waited for
    writes = _writes(emulator, since, resource, child)
    assert _warnings(emulator, since, "Repaired") == [], writes
    return writes


def test_a_late_event_older_than_the_operators_own_write_repairs_nothing(api, running_operator, emulator, operator_log):
    """A watch delivers a child's events late (in order): here the Deployment controller's status write
    to tiny-ar, made before the operator patched the replicas, arrives after the reconcile finished.
    The operator took the event's object (replicas 1) for drift and patched the replicas a second
    time, with a ``Repaired`` Warning saying the child had drifted from the spec, which it had not."""
    writes = _late_controller_write(api, emulator, operator_log, DEPLOYMENTS, "deployments", "tiny-ar",
                                    lambda: api.mark_ready("tiny-ar"), {"ar": {"replicas": 3}})
    assert writes == [("patch", "tiny-ar", None)]
    assert api.child("Deployment", "tiny-ar")["spec"]["replicas"] == 3


def test_a_late_event_after_a_metadata_only_write_repairs_nothing(api, running_operator, emulator, operator_log):
    """The same with a write that does not raise ``metadata.generation``: turning autoscaling on patches
    only the Deployment's applied record (replicas is create-only). The late status event of the same
    generation was taken as current and its old record as drift (break-it pass: two patches and a
    false ``Repaired``)."""
    writes = _late_controller_write(api, emulator, operator_log, DEPLOYMENTS, "deployments", "tiny-ar",
                                    lambda: api.mark_ready("tiny-ar"),
                                    {"ar": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}})
    assert writes == [("patch", "tiny-ar", None)]


def test_a_late_service_event_repairs_nothing(api, running_operator, emulator, operator_log):
    """The same for a kind without a generation: a late event of the gateway Service (its LoadBalancer
    status, written before the operator patched the Service) is no drift."""
    def load_balancer_status() -> None:
        r = api.patch("/api/v1/namespaces/default/services/tiny-gateway/status",
                      {"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.7"}]}}})
        assert r.status_code == 200, r.text

    writes = _late_controller_write(api, emulator, operator_log, "v1/services", "services", "tiny-gateway",
                                    load_balancer_status, {"gateway": {"service": {"type": "ClusterIP", "port": 8080}}})
    assert writes == [("patch", "tiny-gateway", None)]
    assert api.child("Service", "tiny-gateway")["spec"]["ports"][0]["port"] == 8080


def test_a_repair_the_api_refuses_is_retried(api, running_operator, emulator):
    """docs/OPERATOR.md ("Refusals are retried, not fatal"): a refused apply gives Degraded/ApplyFailed
    and a retry after 2, 4, 8 ... s. The pipeline's own handler was retried (kopf), but a repair
    started by a child event only logged the failure (break-it pass): the deleted Deployment stayed
    deleted and Degraded stuck until some unrelated event of the pipeline."""
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    wait_for(lambda: handled(api, "tiny"), what="kopf done with tiny")
    emulator.subject_token = "test-token"  # the operator's (and kubectl's) identity; the api fixture has none
    denied = threading.Event()
    denied.set()
    emulator.authorizer = lambda p: not (denied.is_set() and p[1] == "deployments" and p[2] == "create")
    assert api.http.delete("/apis/apps/v1/namespaces/default/deployments/tiny-dit").status_code == 200
    wait_for(lambda: (c := condition(api.pipeline("tiny"), "Degraded")) and c["reason"] == "ApplyFailed",
             timeout=15, what="Degraded/ApplyFailed")
    denied.clear()  # RBAC fixed
    t0 = time.monotonic()
    wait_for(lambda: api.child("Deployment", "tiny-dit"), timeout=30, what="tiny-dit recreated after the refusal ended")
    print(f"recreated {time.monotonic() - t0:.1f} s after the refusal ended")
    wait_for(lambda: condition(api.pipeline("tiny"), "Degraded")["status"] == "False", timeout=15,
             what="Degraded=False")


def test_a_repair_that_times_out_is_retried(api, running_operator, emulator):
    """As above, with a stalled API server (the repair's create times out: the harness's request_timeout 10 s)."""
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    wait_for(lambda: handled(api, "tiny"), what="kopf done with tiny")
    stalled = threading.Event()
    stalled.set()
    emulator.stall = lambda r: 11.0 if (stalled.is_set() and r.method == enums.method.POST
                                        and "deployments" in str(r.resource)) else 0.0
    assert api.http.delete("/apis/apps/v1/namespaces/default/deployments/tiny-dit").status_code == 200
    time.sleep(1.0)
    stalled.clear()  # only the repair's first create is held past the client's 10 s timeout
    wait_for(lambda: (c := condition(api.pipeline("tiny"), "Degraded")) and c["reason"] == "ApplyFailed",
             timeout=20, what="Degraded/ApplyFailed")
    wait_for(lambda: api.child("Deployment", "tiny-dit"), timeout=30, what="tiny-dit recreated")
    wait_for(lambda: condition(api.pipeline("tiny"), "Degraded")["status"] == "False", timeout=15,
             what="Degraded=False")


def _edit_configmap_during_reconcile(api, emulator) -> float:
    """Spec change that rewrites the ConfigMap (first) and the AR Deployment (later, held 3 s); the
    ConfigMap is edited by hand while the AR patch is held. Returns seconds from the edit to the repair."""
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    wait_for(lambda: handled(api, "tiny"), what="kopf done with tiny")
    holding = threading.Event()
    once = [True]

    def stall(r):
        if (once[0] and r.method == enums.method.PATCH and "deployments" in str(r.resource)
                and r.name == "tiny-ar" and r.subresource is None):
            once[0] = False
            holding.set()
            return 3.0
        return 0.0

    emulator.stall = stall
    patch_spec(api, "tiny", {"requestDefaults": {"steps": 30}, "ar": {"replicas": 2}})
    assert holding.wait(10)
    want = api.child("ConfigMap", "tiny-config")["data"]
    assert "30" in want["pipeline.yaml"]
    r = api.patch("/api/v1/namespaces/default/configmaps/tiny-config", {"data": {"pipeline.yaml": "hacked: 1\n"}})
    assert r.status_code == 200
    t0 = time.monotonic()
    emulator.stall = None
    wait_for(lambda: api.child("ConfigMap", "tiny-config")["data"] == want, timeout=20,
             what="hand-edited ConfigMap repaired")
    took = time.monotonic() - t0
    print(f"ConfigMap repaired {took:.1f} s after the hand edit (the reconcile ended about 3 s after it)")
    return took


def test_a_configmap_edited_during_a_reconcile_is_repaired_right_after_it(api, running_operator, emulator):
    """A child event during the pipeline's own reconcile is repaired when it ends. For a ConfigMap (no
    ``metadata.generation`` on a real API server) the operator cannot order the edited state against
    its own write from the objects: the break-it pass found the repair waiting for a recheck 10 s
    later that then failed (``AttributeError: 'indices'``: the timer held kopf's operator-wide memo,
    not the handler's copy), so the edit stayed. It now reads such a child from the API."""
    took = _edit_configmap_during_reconcile(api, emulator)
    assert took < 6.0, f"the ConfigMap was repaired {took:.1f} s after the edit (the reconcile ended ~3 s after it)"


def test_a_child_whose_managed_by_label_was_removed_gets_it_back(api, running_operator, emulator):
    """The operator watches its children by its ``managed-by`` label; a watch sees a child that loses
    the label as ``DELETED``. The break-it pass found the edit never repaired: the emulator (KMock)
    ignored label selectors and sent ``MODIFIED``, which kopf's filter dropped. With the API server's
    selector semantics the operator puts the label back (the child is still controlled by the pipeline)."""
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    wait_for(lambda: handled(api, "tiny"), what="kopf done with tiny")
    r = api.patch("/apis/apps/v1/namespaces/default/deployments/tiny-ar",
                  {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}})
    assert r.status_code == 200, r.text
    wait_for(lambda: (api.child("Deployment", "tiny-ar")["metadata"].get("labels") or {})
             .get("app.kubernetes.io/managed-by") == "mammoth-operator",
             timeout=15, what="managed-by label put back on tiny-ar")


def test_a_pipeline_recreated_while_its_old_children_are_still_observed_converges_in_seconds(
        api, running_operator, emulator):
    """On a real cluster the garbage collector deletes a deleted pipeline's children after it, and the
    operator's watch reports that later still. A pipeline created again under the same name meets
    children owned by the old uid: NameConflict is right at that moment, but its retry waited 16 s
    (the break-it pass: applied 18.3 s after). Such a conflict now says it waits for the garbage
    collector and is retried after 2 s."""
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    wait_for(lambda: handled(api, "tiny"), what="kopf done with tiny")
    since = len(emulator.writes)
    emulator.watch_lag.add(DEPLOYMENTS)  # the old Deployments' DELETED events come 1 s late
    try:
        assert api.http.delete(f"{PIPELINES}/tiny").status_code == 200
        assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
        time.sleep(1.0)
    finally:
        emulator.watch_lag.discard(DEPLOYMENTS)
    t0 = time.monotonic()
    wait_applied(api, "tiny", 1, timeout=60)
    took = time.monotonic() - t0
    conflicts = _warnings(emulator, since, "NameConflict")
    assert took < 6, (took, conflicts)
    assert conflicts and all("garbage collector" in c for c in conflicts), conflicts  # the case was met


def _deny(emulator, rule):
    """Deny the operator's requests (the kubeconfig's token) for which ``rule(permission)`` is true."""
    emulator.subject_token = "test-token"
    emulator.authorizer = lambda p: not rule(p)


def _ready(api, name: str = "tiny") -> None:
    assert api.create(PIPELINES, example_pipeline(name)).status_code in (200, 201)
    wait_applied(api, name, 1)
    wait_for(lambda: handled(api, name), what=f"kopf done with {name}")


def test_a_repair_blocked_by_a_name_conflict_is_retried_once_the_object_goes(api, running_operator, emulator):
    """Docs: a child deleted by hand is put back within seconds; a name taken by an object the pipeline
    does not own is a NameConflict "retried with backoff, 16, 32 ... s (delete or rename the object)".
    Here the DiT Deployment is deleted and, before the operator's repair, someone else's Deployment of
    the same name (without our label) appears; then it is deleted again. The repair's NameConflict was
    only logged (no retry), and the foreign object is not watched (label selector), so its deletion was
    never seen: tiny-dit stayed missing and Degraded/NameConflict stuck (break-it pass). It is now
    retried with the repairs' backoff."""
    _ready(api)
    emulator.watch_lag.add("apps/v1/deployments")  # the repair runs after the foreign object exists
    try:
        assert api.http.delete(f"{DEPLOYMENTS_PATH}/tiny-dit").status_code == 200
        foreign = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "tiny-dit"},
                   "spec": {"selector": {"matchLabels": {"x": "y"}},
                            "template": {"metadata": {"labels": {"x": "y"}},
                                         "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}}
        assert api.create(DEPLOYMENTS_PATH, foreign).status_code in (200, 201)
    finally:
        emulator.watch_lag.discard("apps/v1/deployments")
    wait_for(lambda: (c := condition(api.pipeline("tiny"), "Degraded")) and c["reason"] == "NameConflict",
             timeout=15, what="Degraded/NameConflict")
    assert api.http.delete(f"{DEPLOYMENTS_PATH}/tiny-dit").status_code == 200  # the foreign object goes
    t0 = time.monotonic()
    wait_for(lambda: (d := api.child("Deployment", "tiny-dit")) and
             (d["metadata"].get("labels") or {}).get("app.kubernetes.io/managed-by") == "mammoth-operator",
             timeout=40, what="tiny-dit recreated by the operator after the conflicting object was deleted")
    print(f"recreated {time.monotonic() - t0:.1f} s after the conflict ended")


def test_repair_backoff_grows_per_retry_not_per_failed_event(api, running_operator, emulator, operator_log):
    """Docs: a failed repair is retried after 2, 4, 8 ... s. ``Retries.retry`` counted a failure per
    call, also for events that only joined the timer already waiting, so a burst of failing child events
    (three Deployments deleted while the API refuses creates) made the next delay 2**(events) s, not
    4 s (break-it pass: 'retried in 2 s', '4 s', '8 s', '16 s'; nothing recreated within 12 s)."""
    _ready(api)
    denied = threading.Event()
    denied.set()
    _deny(emulator, lambda p: denied.is_set() and p[1] == "deployments" and p[2] == "create")
    logged = len(operator_log.records)
    for component in ("ar", "dit", "gateway"):
        assert api.http.delete(f"{DEPLOYMENTS_PATH}/tiny-{component}").status_code == 200
        time.sleep(0.3)
    time.sleep(3.0)  # the first retry (2 s) fails too
    denied.clear()
    t0 = time.monotonic()
    delays = [re.search(r"retried in \d+ s", r.getMessage()).group(0) for r in operator_log.records[logged:]
              if "retried in" in r.getMessage()]
    wait_for(lambda: all(api.child("Deployment", f"tiny-{c}") for c in ("ar", "dit", "gateway")),
             timeout=12, what=f"every Deployment recreated within 12 s of the refusal ending; {delays}")
    print(f"recreated {time.monotonic() - t0:.1f} s after the refusal ended")


def test_a_deleted_child_whose_get_fails_still_makes_the_pipeline_degraded(api, running_operator, emulator):
    """Docs: a deleted child makes Degraded=True (ChildMissing) until it is recreated; a refused call
    gives Degraded/ApplyFailed. A repair reads a child missing from its index with a GET; when that GET
    failed (403 here; a timeout the same), ``converge`` raised before its try block, so no status was
    written: the pipeline said Degraded=False while its Deployment was gone (break-it pass)."""
    _ready(api)
    _deny(emulator, lambda p: p[1] == "deployments" and p[2] == "get")
    assert api.http.delete(f"{DEPLOYMENTS_PATH}/tiny-dit").status_code == 200
    wait_for(lambda: (c := condition(api.pipeline("tiny"), "Degraded")) and c["status"] == "True",
             timeout=15, what="Degraded=True while tiny-dit is missing and cannot be read")


def test_a_spec_quantity_in_non_canonical_form_is_no_drift(api, running_operator, emulator):
    """The CRD accepts any quantity (``cpu: "0.5"``, ``memory: 1024Mi``); the API server serves it back
    canonical (``500m``, ``1Gi``). Compared as text, every event of the Deployment (here the Deployment
    controller's status writes) patched it again (a no-op on the server) with a false ``Repaired``
    warning (break-it pass: one template patch and a warning per status write)."""
    body = example_pipeline(ar=dict(example_pipeline()["spec"]["ar"],
                                    resources={"requests": {"cpu": "0.5", "memory": "1024Mi"}}))
    assert api.create(PIPELINES, body).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    wait_for(lambda: handled(api, "tiny"), what="kopf done with tiny")
    requests = api.child("Deployment", "tiny-ar")["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == "500m" and requests["memory"] == "1Gi", requests  # stored canonical
    since = len(emulator.writes)
    for _ in range(3):  # three status writes of the Deployment controller
        api.mark_ready("tiny-ar")
        time.sleep(0.7)
    time.sleep(1.0)
    patches = [w for w in _writes(emulator, since, DEPLOYMENTS, "tiny-ar") if w[2] != "status"]
    assert (patches, _warnings(emulator, since, "Repaired")) == ([], []), patches
