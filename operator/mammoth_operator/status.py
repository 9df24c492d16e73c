"""Status of a pipeline, computed from its observed children (pure functions).

Conditions (metav1.Condition shape; ``lastTransitionTime`` only moves when ``status`` flips):

* ``ARReady`` / ``DiTReady`` / ``GatewayReady``: the component's Deployment has >= 1 available pod.
  The stages' readiness probe passes only once the model is loaded and SERVING, the gateway's only
  once it reaches >= 1 AR and >= 1 DiT, so ``available`` means "would serve a request now".
* ``Ready``: all three are ready (and the spec is valid).
* ``Progressing``: True while the operator has not applied the latest generation, or a Deployment's
  new pods are not all updated and available (a rollout in flight), like ``kubectl rollout status``.
* ``Degraded``: True for an invalid spec (``InvalidSpec``), a failed apply (``ApplyFailed``) or a
  stuck rollout (``<Component>RolloutStalled`` after ``progressDeadlineSeconds``, ``<Component>ReplicaFailure``).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

COMPONENTS = ("ar", "dit", "gateway")
COMPONENT_TITLES = {"ar": "AR", "dit": "DiT", "gateway": "Gateway"}
CONDITION_TYPES = ("Ready", "ARReady", "DiTReady", "GatewayReady", "Progressing", "Degraded")


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the operator saw of one pipeline's children.

    ``deployments`` maps component -> the Deployment (dict as served) or None when absent;
    ``gateway_service`` is the gateway Service or None; ``autoscaled`` names the components whose
    replica count an HPA owns.
    """

    deployments: Mapping[str, Mapping[str, Any] | None]
    gateway_service: Mapping[str, Any] | None
    autoscaled: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Problem:
    """A reason the operator could not act on the spec: ``InvalidSpec`` or ``ApplyFailed``."""

    reason: str
    message: str


def now_iso() -> str:
    """Current UTC time as RFC 3339 with seconds precision (``2025-01-01T00:00:00Z``)."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def replica_counts(deployment: Mapping[str, Any] | None, autoscaled: bool) -> dict[str, Any]:
    """Per-component counts for ``status.<component>`` from its Deployment (zeros when absent)."""
    spec = (deployment or {}).get("spec") or {}
    st = (deployment or {}).get("status") or {}
    desired = int(spec.get("replicas", 1 if deployment else 0))
    ready = int(st.get("readyReplicas", 0) or 0)
    return {
        "desiredReplicas": desired,
        "replicas": int(st.get("replicas", 0) or 0),
        "readyReplicas": ready,
        "availableReplicas": int(st.get("availableReplicas", 0) or 0),
        "updatedReplicas": int(st.get("updatedReplicas", 0) or 0),
        "ready": f"{ready}/{desired}",
        "autoscaled": autoscaled,
    }


def rollout_state(deployment: Mapping[str, Any]) -> tuple[bool, str]:
    """(rolling, message) for a Deployment, by the rules of ``kubectl rollout status``."""
    meta = deployment.get("metadata") or {}
    spec = deployment.get("spec") or {}
    st = deployment.get("status") or {}
    desired = int(spec.get("replicas", 1))
    if int(meta.get("generation", 0) or 0) > int(st.get("observedGeneration", 0) or 0):
        return True, "waiting for the Deployment controller to observe the new spec"
    updated = int(st.get("updatedReplicas", 0) or 0)
    total = int(st.get("replicas", 0) or 0)
    available = int(st.get("availableReplicas", 0) or 0)
    if updated < desired:
        return True, f"{updated} of {desired} new pods updated"
    if total > updated:
        return True, f"{total - updated} old pods pending termination"
    if available < updated:
        return True, f"{available} of {updated} updated pods available"
    return False, f"{available} of {desired} pods available"


def endpoint_url(service: Mapping[str, Any] | None) -> str:
    """The gateway URL: the load balancer's address when it has one, else the in-cluster DNS name."""
    if not service:
        return ""
    meta = service.get("metadata") or {}
    spec = service.get("spec") or {}
    ports = spec.get("ports") or [{}]
    port = int(ports[0].get("port", 80))
    ingress = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    if spec.get("type") == "LoadBalancer" and ingress:
        host = ingress[0].get("hostname") or ingress[0].get("ip")
        if host:
            return f"http://{host}" if port == 80 else f"http://{host}:{port}"
    host = f"{meta.get('name')}.{meta.get('namespace')}.svc.cluster.local"
    return f"http://{host}" if port == 80 else f"http://{host}:{port}"


def _cond(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def _component_condition(component: str, deployment: Mapping[str, Any] | None, autoscaled: bool) -> dict[str, Any]:
    """``<Component>Ready`` from the component's Deployment (None: not created)."""
    title = COMPONENT_TITLES[component]
    if deployment is None:
        return _cond(f"{title}Ready", False, "NotCreated", f"the {title} Deployment does not exist")
    counts = replica_counts(deployment, autoscaled)
    available = counts["availableReplicas"]
    if available >= 1:
        return _cond(f"{title}Ready", True, "MinimumReplicasAvailable",
                     f"{available} of {counts['desiredReplicas']} pods available")
    if counts["desiredReplicas"] == 0:
        return _cond(f"{title}Ready", False, "ScaledToZero", "the Deployment has 0 replicas")
    return _cond(f"{title}Ready", False, "NoReplicasAvailable",
                 f"0 of {counts['desiredReplicas']} pods available (loading the model or unschedulable)")


def _stalled(component: str, deployment: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(reason, message) of a Deployment past its progress deadline or failing to create pods."""
    title = COMPONENT_TITLES[component]
    found = []
    progressing = condition(deployment.get("status"), "Progressing")
    if progressing and progressing.get("status") == "False" and progressing.get("reason") == "ProgressDeadlineExceeded":
        found.append((f"{title}RolloutStalled", progressing.get("message") or "progress deadline exceeded"))
    failure = condition(deployment.get("status"), "ReplicaFailure")
    if failure and failure.get("status") == "True":
        found.append((f"{title}ReplicaFailure", failure.get("message") or "replica failure"))
    return found


def _summary_conditions(generation: int, observed_generation: int | None, observed: Observed,
                        problem: Problem | None, ready: Mapping[str, bool]) -> tuple[dict[str, Any], ...]:
    """``Ready``, ``Progressing`` and ``Degraded`` from the components and the operator's problem."""
    present = {c: d for c, d in observed.deployments.items() if d is not None}
    rolling = [f"{c}: {message}" for c in COMPONENTS if c in present
               for is_rolling, message in [rollout_state(present[c])] if is_rolling]
    stalled = [s for c in COMPONENTS if c in present for s in _stalled(c, present[c])]
    if problem is not None and problem.reason == "InvalidSpec" and not present:
        ready_cond = _cond("Ready", False, "InvalidSpec", problem.message)
    elif all(ready.values()):
        ready_cond = _cond("Ready", True, "AllComponentsReady", "AR, DiT and gateway have available pods")
    else:
        missing = ", ".join(COMPONENT_TITLES[c] for c in COMPONENTS if not ready[c])
        ready_cond = _cond("Ready", False, "ComponentsNotReady", f"not ready: {missing}")
    if problem is not None:
        progressing = _cond("Progressing", False, problem.reason, problem.message)
        degraded = _cond("Degraded", True, problem.reason, problem.message)
        return ready_cond, progressing, degraded
    if observed_generation is None or observed_generation < generation:
        progressing = _cond("Progressing", True, "Reconciling", f"applying generation {generation}")
    elif rolling:
        progressing = _cond("Progressing", True, "RollingUpdate", "; ".join(rolling))
    else:
        progressing = _cond("Progressing", False, "RolloutComplete", "every component runs the current spec")
    if stalled:
        degraded = _cond("Degraded", True, stalled[0][0], "; ".join(m for _, m in stalled))
    else:
        degraded = _cond("Degraded", False, "AsExpected", "no problem observed")
    return ready_cond, progressing, degraded


def compute_status(generation: int, observed_generation: int | None, observed: Observed,
                   problem: Problem | None) -> dict[str, Any]:
    """The desired ``status`` (without ``lastTransitionTime``; see :func:`merge_conditions`).

    Args:
        generation: ``metadata.generation`` of the pipeline.
        observed_generation: the generation whose children were last applied (``status.observedGeneration``).
        observed: the children as read from the API.
        problem: why the latest spec could not be applied, if it could not.
    """
    components = [_component_condition(c, observed.deployments.get(c), c in observed.autoscaled) for c in COMPONENTS]
    ready = {c: cond["status"] == "True" for c, cond in zip(COMPONENTS, components)}
    ready_cond, progressing, degraded = _summary_conditions(generation, observed_generation, observed, problem, ready)
    status: dict[str, Any] = {
        "conditions": [ready_cond, *components, progressing, degraded],
        "endpoint": endpoint_url(observed.gateway_service),
    }
    for component in COMPONENTS:
        status[component] = replica_counts(observed.deployments.get(component), component in observed.autoscaled)
    for cond in status["conditions"]:
        cond["observedGeneration"] = generation
    return status


def merge_conditions(old: Sequence[Mapping[str, Any]] | None, new: Sequence[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    """``new`` with ``lastTransitionTime`` kept from ``old`` where the status did not flip, else ``now``."""
    previous = {c.get("type"): c for c in old or []}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        if before is not None and before.get("status") == cond["status"] and before.get("lastTransitionTime"):
            stamp = before["lastTransitionTime"]
        else:
            stamp = now
        merged.append({**cond, "lastTransitionTime": stamp})
    return merged


def status_patch(current: Mapping[str, Any], generation: int, observed: Observed, problem: Problem | None,
                 applied: bool, now: str) -> dict[str, Any]:
    """The status keys to patch (empty when nothing changed): :func:`compute_status` for the observed
    children, ``lastTransitionTime`` kept where a condition did not flip (else ``now``), and
    ``observedGeneration`` = ``generation`` only when the convergence ``applied`` this generation.
    ``current`` is the status as read (a snapshot, not modified)."""
    observed_generation = generation if applied else current.get("observedGeneration")
    desired = compute_status(generation, observed_generation, observed, problem)
    desired["conditions"] = merge_conditions(current.get("conditions"), desired["conditions"], now)
    if applied:
        desired["observedGeneration"] = generation
    return {key: value for key, value in desired.items() if current.get(key) != value}


def condition(status: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    """The condition of ``type_`` in a status (a pipeline's or a Deployment's), or None."""
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None
