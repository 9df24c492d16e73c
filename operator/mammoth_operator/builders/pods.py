"""What the three Deployments share: the pod spec (security context, volumes, spreading), container
resources, environment and security, the model's ``--checkpoint`` and its download init container,
and the Deployment around a pod."""

from __future__ import annotations

from typing import Any

from mammoth_operator.builders.common import (API_KEYS_DIR, AUTH_DIR, CACHE_DIR, CONFIG_DIR, MODELS_DIR,
                                              ROLE_TOKENS_DIR, ROLE_TOKENS_MOUNTED, child_names, labels,
                                              selector_labels, termination_grace_seconds)
from mammoth_operator.builders.config_map import CONFIG_HASH_ANNOTATION, config_hash
from mammoth_operator.builders.secrets import TOKENS_HASH_ANNOTATION
from mammoth_operator.spec import DEFAULT_REQUESTS, ROLE_TOKEN_KEYS, PipelineSpec, Placement, Rollout, Stage

#: Startup probe period; failureThreshold = ceil(startupTimeoutSeconds / period).
STARTUP_PROBE_PERIOD_SECONDS = 10
#: Non-root user of the images.
RUN_AS_USER = 65532


def checkpoint_path(spec: PipelineSpec) -> str:
    """The ``--checkpoint`` value the stages get for the model source."""
    source = spec.model.source
    if source.scheme == "builtin":
        return source.uri
    if source.scheme == "pvc":
        return f"{MODELS_DIR}/{source.path}"
    if source.scheme == "file":
        return MODELS_DIR
    org_repo = source.repo.replace("/", "--")
    return f"{MODELS_DIR}/hf/{org_repo}/{source.revision}"


def _per_rank(quantity: str, ranks: int) -> str:
    """A default request (``"4"``, ``"32Gi"``) for ``ranks`` processes: each rank runs its own host
    loop and holds its own copy of the weights in host memory while it loads."""
    if ranks == 1:
        return quantity
    number = quantity.rstrip("KMGTPEim")
    return f"{int(number) * ranks}{quantity[len(number):]}"


def container_resources(placement: Placement, gpus: int, container: str, ranks: int = 1) -> dict[str, Any]:
    """Requests/limits of one container: :data:`~mammoth_operator.spec.DEFAULT_REQUESTS` (times
    ``ranks``, the stage's processes) under the spec's."""
    result: dict[str, Any] = {}
    for section in ("requests", "limits"):
        # Quantities as strings, the way the API serves them back (and the typed client insists).
        values = {name: str(q) for name, q in placement.resources.get(section, {}).items()}
        if section == "requests":
            defaults = {k: _per_rank(v, ranks) for k, v in DEFAULT_REQUESTS[container].items()}
            values = defaults | values
        if gpus:
            values["nvidia.com/gpu"] = str(gpus)
        if values:
            result[section] = values
    return result


def container_env(placement: Placement) -> list[dict[str, Any]]:
    """``POD_NAME``, ``POD_NAMESPACE``, ``POD_IP`` from the downward API, then the spec's ``env`` (which
    replaces any of the three by name)."""
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    overridden = {e["name"] for e in placement.env}
    return [e for e in env if e["name"] not in overridden] + [dict(e) for e in placement.env]


def container_security() -> dict[str, Any]:
    """The restricted container security context (non-root, read-only root, no capabilities)."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _model_volume(spec: PipelineSpec) -> dict[str, Any] | None:
    """The stages' ``model`` volume for the model source (None for ``builtin://``)."""
    source, model = spec.model.source, spec.model
    if source.scheme == "pvc":
        return {"name": "model", "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
    if source.scheme == "file":
        return {"name": "model", "hostPath": {"path": source.path, "type": "Directory"}}
    if source.scheme == "hf" and model.cache_claim:
        return {"name": "model", "persistentVolumeClaim": {"claimName": model.cache_claim}}
    if source.scheme == "hf":
        return {"name": "model", "emptyDir": {"sizeLimit": model.cache_size_limit}}
    return None


#: ``/dev/shm`` of a stage pod with several ranks (memory-backed; counts against the pod's memory).
#: NCCL's shared-memory transport needs a few buffers of 4 MiB per channel and peer; the container
#: runtime's default 64 MiB is too small for 8 ranks, 1 GiB is ample for 8.
NCCL_SHM_SIZE = "1Gi"


def pod_volumes(spec: PipelineSpec, component: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts of the main container) for one component."""
    names = child_names(spec.name)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.config}},
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    stage = {"ar": spec.ar, "dit": spec.dit}.get(component)
    if stage is not None and stage.ranks > 1:  # NCCL's shared-memory transport between the pod's ranks
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": NCCL_SHM_SIZE}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    model = _model_volume(spec) if component in ("ar", "dit") else None
    if model is not None:
        volumes.append(model)
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
    token = spec.transport.auth_token
    if token is not None:
        volumes.append({"name": "auth-token", "secret": {"secretName": token.name, "items": [{"key": token.key, "path": "token"}]}})
        mounts.append({"name": "auth-token", "mountPath": AUTH_DIR, "readOnly": True})
    if spec.transport.role_tokens is not None:
        items = [{"key": ROLE_TOKEN_KEYS[role], "path": role} for role in ROLE_TOKENS_MOUNTED[component]]
        volumes.append({"name": "role-tokens", "secret": {"secretName": spec.transport.role_tokens, "items": items}})
        mounts.append({"name": "role-tokens", "mountPath": ROLE_TOKENS_DIR, "readOnly": True})
    if component == "gateway" and spec.gateway.api_keys is not None:
        keys = spec.gateway.api_keys
        volumes.append({"name": "api-keys", "secret": {"secretName": keys.name, "items": [{"key": keys.key, "path": "keys"}]}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    return volumes, mounts


def download_init_container(spec: PipelineSpec, stage: Stage) -> dict[str, Any]:
    """Init container that fetches ``hf://org/repo@revision`` into the cache volume (writes ``.complete``)."""
    source = spec.model.source
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"}]
    if spec.model.hf_token is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": spec.model.hf_token.name, "key": spec.model.hf_token.key}}})
    return {
        "name": "download-model",
        "image": stage.placement.image,
        "imagePullPolicy": stage.placement.image_pull_policy,
        "command": ["mammoth"],
        "args": ["download-model", source.uri, checkpoint_path(spec)],
        "env": env,
        "volumeMounts": [
            {"name": "model", "mountPath": MODELS_DIR},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "resources": {"requests": dict(DEFAULT_REQUESTS["download-model"])},
        "securityContext": container_security(),
    }


def pod_spec(spec: PipelineSpec, component: str, placement: Placement, container: dict[str, Any],
             init_containers: list[dict[str, Any]], volumes: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod of one component: restricted security, no service-account token, the drain grace, the
    spec's placement, and a preferred spread over nodes when the spec sets no affinity."""
    pod: dict[str, Any] = {
        "enableServiceLinks": False,
        # No pod of a pipeline calls the Kubernetes API: no token in the pod at all.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if init_containers:
        pod["initContainers"] = init_containers
    if spec.service_account_name:
        pod["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    if placement.priority_class_name:
        pod["priorityClassName"] = placement.priority_class_name
    if placement.node_selector:
        pod["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod["tolerations"] = [dict(t) for t in placement.tolerations]
    if placement.affinity:
        pod["affinity"] = dict(placement.affinity)
    else:
        # Spread replicas over nodes when the user says nothing: one node failure takes one replica.
        pod["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": selector_labels(spec.name, component)},
            },
        }]}}
    return pod


def deployment(spec: PipelineSpec, component: str, name: str, replicas: int, rollout: Rollout,
               placement: Placement, pod: dict[str, Any], progress_deadline: int,
               stage_tokens: str | None) -> dict[str, Any]:
    """The Deployment around ``pod``: rolling update, and the pod-template annotations that roll it (the
    component's config hash; the stage-tokens hash when ``stage_tokens`` is given)."""
    annotations = {**placement.pod_annotations, CONFIG_HASH_ANNOTATION: config_hash(spec, component)}
    if stage_tokens is not None:
        annotations[TOKENS_HASH_ANNOTATION] = stage_tokens
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels(spec.name, component)},
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": progress_deadline,
            "selector": {"matchLabels": selector_labels(spec.name, component)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": rollout.max_surge, "maxUnavailable": rollout.max_unavailable},
            },
            "template": {
                "metadata": {"labels": labels(spec.name, component), "annotations": annotations},
                "spec": pod,
            },
        },
    }


