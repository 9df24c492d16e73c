"""The operator against the emulated API server: kubectl apply, updates, restarts, HPA, invalid specs."""

from __future__ import annotations

import json

import time
from typing import Any

import kubernetes_validate
import yaml

from emulator_harness import (EXAMPLE_FILE, PIPELINES, Api, OperatorProcess, child_path, child_writes, condition,
                      example_pipeline, load_yaml, wait_for)
from mammoth_operator.config import GROUP
from mammoth_operator.validation import validate_custom_resource

EXPECTED_CHILDREN = {
    ("ConfigMap", "tiny-config"),
    ("Service", "tiny-ar"), ("Service", "tiny-dit"), ("Service", "tiny-gateway"),
    ("Deployment", "tiny-ar"), ("Deployment", "tiny-dit"), ("Deployment", "tiny-gateway"),
    ("PodDisruptionBudget", "tiny-ar"), ("PodDisruptionBudget", "tiny-dit"), ("PodDisruptionBudget", "tiny-gateway"),
    ("Secret", "tiny-stage-tokens"), ("NetworkPolicy", "tiny-stages"),
}


def observed_generation(api: Api, name: str, generation: int) -> bool:
    obj = api.pipeline(name)
    return bool(obj and (obj.get("status") or {}).get("observedGeneration") == generation)


def wait_applied(api: Api, name: str, generation: int, timeout: float = 20.0) -> dict[str, Any]:
    wait_for(lambda: observed_generation(api, name, generation), timeout=timeout,
             what=f"{name} generation {generation} applied")
    return api.pipeline(name)


def reconcile_succeeded(log, since: int, name: str) -> bool:
    """kopf logged "Handler 'reconcile' succeeded." for pipeline ``name`` in ``log.records[since:]``."""
    return any((getattr(r, "k8s_ref", None) or {}).get("name") == name
               and r.getMessage() == "Handler 'reconcile' succeeded." for r in log.records[since:])


def handled(api: Api, name: str) -> bool:
    """kopf has finished with pipeline ``name``: its diff-base annotation is written and no handler
    progress is left (kopf writes both in one patch after the handler returned, so a pipeline whose
    ``observedGeneration`` is up to date may still be mid-handling)."""
    annotations = ((api.pipeline(name) or {}).get("metadata") or {}).get("annotations") or {}
    return (f"{GROUP}/last-handled-configuration" in annotations
            and not any(key.startswith(f"{GROUP}/reconcile") for key in annotations))


def patch_spec(api: Api, name: str, spec: dict[str, Any]) -> None:
    r = api.patch(f"{PIPELINES}/{name}", {"spec": spec})
    assert r.status_code == 200, r.text


def events(emulator) -> list[dict[str, Any]]:
    return [dict(o) for (r, _, _), o in list(emulator.objects.items()) if r == "v1/events" and not o.deleted]


def mark_all_ready(api: Api, name: str = "tiny") -> None:
    for component in ("ar", "dit", "gateway"):
        api.mark_ready(f"{name}-{component}")


def test_kubectl_apply_creates_every_child(api, running_operator, kubectl, emulator):
    out = kubectl("apply", "-f", str(EXAMPLE_FILE)).stdout
    assert "mammothpipeline.mammoth.dev/tiny created" in out
    owner = wait_applied(api, "tiny", 1)

    # The custom resource, as stored (defaults applied), validates against the CRD schema.
    crd = load_yaml(EXAMPLE_FILE.parent / "charts/mammoth-operator/crds/mammothpipelines.mammoth.dev.yaml")
    _, pruned, violations = validate_custom_resource(crd, owner)
    assert pruned == [] and violations == []

    for kind, name in EXPECTED_CHILDREN:
        child = api.child(kind, name)
        assert child is not None, (kind, name)
        meta = child["metadata"]
        assert meta["ownerReferences"] == [{
            "apiVersion": "mammoth.dev/v1alpha1", "kind": "MammothPipeline", "name": "tiny",
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"]["app.kubernetes.io/instance"] == "tiny"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "mammoth-operator"
        kubernetes_validate.validate(child, "1.35", strict=True)
    created = {(w["resource"], w["name"]) for w in child_writes(emulator, verbs=("create",))}
    assert len(created) == len(EXPECTED_CHILDREN)  # nothing else (no HPA by default)

    ar = api.child("Deployment", "tiny-ar")
    container = ar["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/mammoth-pipeline/mammoth-ar:test"
    assert container["args"] == ["ar", "--config", "/etc/mammoth/pipeline.yaml", "--checkpoint", "builtin://tiny"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert ar["spec"]["template"]["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert ar["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    config = yaml.safe_load(api.child("ConfigMap", "tiny-config")["data"]["pipeline.yaml"])
    assert config["max_message_bytes"] == 67108864 and config["chunk_rows"] == 64

    # Status tells the truth: nothing is ready yet, the rollout is in flight.
    status = wait_for(lambda: api.pipeline("tiny").get("status"), what="status")
    assert condition(api.pipeline("tiny"), "Ready")["status"] == "False"
    assert condition(api.pipeline("tiny"), "Progressing")["status"] == "True"
    assert status["endpoint"] == "http://tiny-gateway.default.svc.cluster.local"
    # User-visible decisions become events.
    wait_for(lambda: any(e["reason"] == "Created" and "Deployment tiny-ar" in e["message"] for e in events(emulator)),
             what="a Created event")


def test_spec_changes_update_children_in_place_and_ready_flips(api, running_operator, emulator):
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    uids = {c: api.child("Deployment", f"tiny-{c}")["metadata"]["uid"] for c in ("ar", "dit", "gateway")}
    creates = len(child_writes(emulator, verbs=("create",)))

    mark_all_ready(api)
    ready = wait_for(lambda: condition(api.pipeline("tiny"), "Ready")["status"] == "True" and api.pipeline("tiny"),
                     what="Ready=True")
    assert ready["status"]["endpoint"] == "http://tiny-gateway.default.svc.cluster.local"
    assert condition(ready, "Progressing")["reason"] == "RolloutComplete"
    assert condition(ready, "Degraded")["status"] == "False"
    assert ready["status"]["ar"]["ready"] == "1/1"

    patch_spec(api, "tiny", {"ar": {"replicas": 2}})
    wait_applied(api, "tiny", 2)
    assert api.child("Deployment", "tiny-ar")["spec"]["replicas"] == 2
    progressing = wait_for(lambda: condition(api.pipeline("tiny"), "Progressing")["reason"] == "RollingUpdate"
                           and api.pipeline("tiny"), what="Progressing=True during the rollout")
    assert condition(progressing, "Progressing")["status"] == "True"
    assert condition(progressing, "Progressing")["message"].startswith("ar: ")

    patch_spec(api, "tiny", {"ar": {"image": "registry.example/ar:2"}, "dit": {"image": "registry.example/dit:2"}})
    wait_applied(api, "tiny", 3)
    assert api.child("Deployment", "tiny-ar")["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/ar:2"
    assert api.child("Deployment", "tiny-dit")["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/dit:2"

    patch_spec(api, "tiny", {"model": {"source": "pvc://weights/mammoth/v2"}})
    wait_applied(api, "tiny", 4)
    for component in ("ar", "dit"):
        pod = api.child("Deployment", f"tiny-{component}")["spec"]["template"]["spec"]
        assert "/models/mammoth/v2" in pod["containers"][0]["args"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]

    # Updated in place: same objects, no new creations.
    assert {c: api.child("Deployment", f"tiny-{c}")["metadata"]["uid"] for c in uids} == uids
    assert len(child_writes(emulator, verbs=("create",))) == creates
    assert condition(api.pipeline("tiny"), "Ready")["status"] == "True"  # old pods still serve

    mark_all_ready(api)
    done = wait_for(lambda: condition(api.pipeline("tiny"), "Progressing")["status"] == "False" and api.pipeline("tiny"),
                    what="rollout complete")
    assert condition(done, "Ready")["status"] == "True"
    assert done["status"]["ar"]["ready"] == "2/2"


def test_restart_with_existing_pipelines_applies_exactly_one_update(api, crd_installed, operator_log, emulator):
    operator = OperatorProcess(operator_log)
    operator.start()
    try:
        for name in ("alpha", "beta", "gamma"):
            assert api.create(PIPELINES, example_pipeline(name)).status_code in (200, 201)
        for name in ("alpha", "beta", "gamma"):
            # three pipelines' 36 children, each write admitted by the in-process emulator: give a
            # loaded 2-core CI host time (20 s was not enough at load average 13)
            wait_applied(api, name, 1, timeout=120.0)
        # stopped between reconciles, not while kopf still writes its own record of one
        wait_for(lambda: all(handled(api, n) for n in ("alpha", "beta", "gamma")), timeout=120.0,
                 what="kopf done with alpha, beta and gamma")
    finally:
        operator.stop()

    patch_spec(api, "beta", {"ar": {"replicas": 3}})  # edited while the operator is down
    since = len(emulator.writes)
    logged = len(operator_log.records)
    operator = OperatorProcess(operator_log)
    operator.start()
    try:
        wait_applied(api, "beta", 2, timeout=120.0)
        # the resume handler has run to completion for all three (not a fixed sleep: under load a
        # sleep could end before alpha's and gamma's resume ran, and the test would check nothing).
        # Idle: about a second. At load average 13 the in-process emulator answered so slowly that
        # the resume's API calls timed out and were retried for over 120 s.
        wait_for(lambda: all(reconcile_succeeded(operator_log, logged, n) for n in ("alpha", "beta", "gamma")),
                 timeout=240.0, what="the resume handler succeeded for alpha, beta and gamma")
        for name in ("alpha", "gamma"):
            assert api.pipeline(name)["status"]["observedGeneration"] == 1
    finally:
        operator.stop()

    writes = child_writes(emulator, since)
    assert [w for w in writes if w["verb"] == "create"] == []
    # the whole writes in the message, with the operator's Events since the restart (a repair posts
    # "Repaired" as an Event, not to the operator's log). Two or three patches to beta-ar were a late
    # child event taken for drift (docs/TESTING.md, "Timing-sensitive tests")
    events = [(w["body"].get("reason"), w["body"].get("message")) for w in emulator.writes[since:]
              if w["resource"].endswith("/events") and w["verb"] == "create"]
    assert [(w["resource"], w["name"]) for w in writes] == [("apps/v1/deployments", "beta-ar")], json.dumps(
        {"writes": [{k: w.get(k) for k in ("verb", "name", "subresource", "body")} for w in writes],
         "events": events})[:8000]
    patch = writes[0]["body"]
    assert patch["spec"] == {"replicas": 3}
    assert "Patching failed with inconsistencies" not in operator_log.text()
    assert emulator.pruned == []


def test_hpa_owns_replicas_when_autoscaling(api, running_operator, emulator):
    body = example_pipeline(ar={"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}})
    assert api.create(PIPELINES, body).status_code in (200, 201)
    wait_applied(api, "tiny", 1)
    hpa = api.child("HorizontalPodAutoscaler", "tiny-ar")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiny-ar"}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "mammoth_ar_running_sequences"
    assert api.child("Deployment", "tiny-ar")["spec"]["replicas"] == 2  # created at minReplicas
    kubernetes_validate.validate(hpa, "1.35", strict=True)

    # The HPA scales the Deployment; the next reconcile must not fight it.
    assert api.patch(child_path("Deployment", "tiny-ar"), {"spec": {"replicas": 4}}).status_code == 200
    patch_spec(api, "tiny", {"ar": {"image": "registry.example/ar:3"}})
    wait_applied(api, "tiny", 2)
    ar = api.child("Deployment", "tiny-ar")
    assert ar["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/ar:3"
    assert ar["spec"]["replicas"] == 4
    assert wait_for(lambda: api.pipeline("tiny")["status"]["ar"]["autoscaled"] is True, what="autoscaled status")

    # Autoscaling off: the HPA goes, the spec's replica count is back in charge.
    patch_spec(api, "tiny", {"ar": {"autoscaling": {"enabled": False}, "replicas": 1}})
    wait_applied(api, "tiny", 3)
    assert api.child("HorizontalPodAutoscaler", "tiny-ar") is None
    assert api.child("Deployment", "tiny-ar")["spec"]["replicas"] == 1


def test_invalid_spec_is_a_condition_and_creates_nothing(api, running_operator, operator_log, emulator):
    emulator.admission = False  # as if admission had not run the CEL rules (older CRD, other server)
    body = example_pipeline(transport={"chunkRows": 4096, "maxMessageBytes": 1048576})
    assert api.create(PIPELINES, body).status_code in (200, 201)
    degraded = wait_for(lambda: (condition(api.pipeline("tiny"), "Degraded") or {}).get("reason") == "InvalidSpec"
                        and observed_generation(api, "tiny", 1) and api.pipeline("tiny"), what="Degraded/InvalidSpec")
    assert condition(degraded, "Degraded")["status"] == "True"
    assert "chunkRows" in condition(degraded, "Degraded")["message"]
    assert condition(degraded, "Ready") | {"lastTransitionTime": None, "message": None, "observedGeneration": None} == {
        "type": "Ready", "status": "False", "reason": "InvalidSpec", "lastTransitionTime": None, "message": None,
        "observedGeneration": None}
    assert degraded["status"]["observedGeneration"] == 1
    time.sleep(1.5)  # no retry storm: the handler ran once and gave up until the spec changes
    assert operator_log.text().count("Handler 'reconcile' is invoked") == 1
    assert child_writes(emulator) == []
    wait_for(lambda: any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in events(emulator)),
             what="an InvalidSpec warning event")

    patch_spec(api, "tiny", {"transport": {"maxMessageBytes": 67108864}})
    fixed = wait_applied(api, "tiny", 2)
    assert api.child("Deployment", "tiny-ar") is not None
    wait_for(lambda: condition(api.pipeline("tiny"), "Degraded")["status"] == "False", what="Degraded=False")
    assert fixed["metadata"]["name"] == "tiny"


def test_admission_rejects_cel_violations_and_unknown_fields(api, crd_installed, kubectl, tmp_path):
    bad = load_yaml(EXAMPLE_FILE)
    bad["spec"]["requestDefaults"]["minPixels"] = 4194304  # > maxPixels
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = kubectl("apply", "-f", str(path), check=False)
    assert result.returncode != 0
    assert "requestDefaults.minPixels must not exceed maxPixels" in result.stderr

    unknown = load_yaml(EXAMPLE_FILE)
    unknown["spec"]["ar"]["replica"] = 2  # typo
    path.write_text(yaml.safe_dump(unknown))
    result = kubectl("apply", "-f", str(path), check=False)
    assert result.returncode != 0 and "spec.ar.replica" in result.stderr
    assert api.pipeline("tiny") is None
