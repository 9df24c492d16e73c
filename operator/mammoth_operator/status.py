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


def _deployment_condition(deployment: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


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


def compute_status(generation: int, observed_generation: int | None, observed: Observed,
                   problem: Problem | None) -> dict[str, Any]:
    """The desired ``status`` (without ``lastTransitionTime``; see :func:`merge_conditions`).

    Args:
        generation: ``metadata.generation`` of the pipeline.
        observed_generation: the generation whose children were last applied (``status.observedGeneration``).
        observed: the children as read from the API.
        problem: why the latest spec could not be applied, if it could not.
    """
    conditions: list[dict[str, Any]] = []
    ready: dict[str, bool] = {}
    rolling: list[str] = []
    stalled: list[tuple[str, str]] = []
    for component in COMPONENTS:
        title = COMPONENT_TITLES[component]
        deployment = observed.deployments.get(component)
        if deployment is None:
            ready[component] = False
            conditions.append(_cond(f"{title}Ready", False, "NotCreated", f"the {title} Deployment does not exist"))
            continue
        counts = replica_counts(deployment, component in observed.autoscaled)
        available = counts["availableReplicas"]
        ready[component] = available >= 1
        if available >= 1:
            conditions.append(_cond(f"{title}Ready", True, "MinimumReplicasAvailable",
                                    f"{available} of {counts['desiredReplicas']} pods available"))
        elif counts["desiredReplicas"] == 0:
            conditions.append(_cond(f"{title}Ready", False, "ScaledToZero", "the Deployment has 0 replicas"))
        else:
            conditions.append(_cond(f"{title}Ready", False, "NoReplicasAvailable",
                                    f"0 of {counts['desiredReplicas']} pods available (loading the model or unschedulable)"))
        is_rolling, message = rollout_state(deployment)
        if is_rolling:
            rolling.append(f"{component}: {message}")
        progressing = _deployment_condition(deployment, "Progressing")
        if progressing and progressing.get("status") == "False" and progressing.get("reason") == "ProgressDeadlineExceeded":
            stalled.append((f"{title}RolloutStalled", progressing.get("message") or "progress deadline exceeded"))
        failure = _deployment_condition(deployment, "ReplicaFailure")
        if failure and failure.get("status") == "True":
            stalled.append((f"{title}ReplicaFailure", failure.get("message") or "replica failure"))

    if problem is not None and problem.reason == "InvalidSpec" and not any(observed.deployments.values()):
        ready_cond = _cond("Ready", False, "InvalidSpec", problem.message)
    elif all(ready.values()):
        ready_cond = _cond("Ready", True, "AllComponentsReady", "AR, DiT and gateway have available pods")
    else:
        missing = ", ".join(COMPONENT_TITLES[c] for c in COMPONENTS if not ready[c])
        ready_cond = _cond("Ready", False, "ComponentsNotReady", f"not ready: {missing}")

    if problem is not None:
        progressing_cond = _cond("Progressing", False, problem.reason, problem.message)
    elif observed_generation is None or observed_generation < generation:
        progressing_cond = _cond("Progressing", True, "Reconciling", f"applying generation {generation}")
    elif rolling:
        progressing_cond = _cond("Progressing", True, "RollingUpdate", "; ".join(rolling))
    else:
        progressing_cond = _cond("Progressing", False, "RolloutComplete", "every component runs the current spec")

    if problem is not None:
        degraded_cond = _cond("Degraded", True, problem.reason, problem.message)
    elif stalled:
        degraded_cond = _cond("Degraded", True, stalled[0][0], "; ".join(m for _, m in stalled))
    else:
        degraded_cond = _cond("Degraded", False, "AsExpected", "no problem observed")

    status: dict[str, Any] = {
        "conditions": [ready_cond, *conditions, progressing_cond, degraded_cond],
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


def status_changes(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level status keys whose value differs (what to put in the status patch)."""
    current = current or {}
    return {key: value for key, value in desired.items() if current.get(key) != value}


def condition(status: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    """The condition of ``type_`` in a status, or None."""
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None
