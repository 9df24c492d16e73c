"""Pure functions: a parsed :class:`~mammoth_operator.spec.PipelineSpec` -> the manifests of its children.

Nothing here talks to a cluster; the handlers pass the result through ``kopf.adopt`` (namespace,
owner reference) and :mod:`mammoth_operator.kube` (create or patch).

Children of a pipeline ``N`` (deterministic names, :func:`child_names`):

==================  =========================================  ==========================
name                kind                                       when
==================  =========================================  ==========================
``N-stage-tokens``  Secret (per-role stage tokens)             unless ``roleTokensSecretRef``
``N-config``        ConfigMap (``pipeline.yaml``)              always
``N-ar``            Deployment, headless Service, PDB, HPA     PDB/HPA when enabled
``N-dit``           Deployment, headless Service, PDB, HPA     PDB/HPA when enabled
``N-gateway``       Deployment, Service, PDB                   PDB when enabled
``N-stages``        NetworkPolicy (AR, DiT and gateway pods)   ``spec.networkPolicy.enabled`` (default)
==================  =========================================  ==========================

The ports, flags and settings keys are the components' own (docs/INTERNALS.md, "Ports and
commands"; docs/CONFIGURATION.md): AR gRPC 50051 / metrics 9091, DiT gRPC 50052 / metrics 9092,
gateway HTTP 8000; every container runs ``mammoth <component> --config /etc/mammoth/pipeline.yaml``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

import yaml

from mammoth_core.settings import ARSettings, DiTSettings, GatewaySettings
from mammoth_operator.spec import (DEFAULT_REQUESTS, ROLE_TOKEN_KEYS, Disruption, Gateway, PipelineSpec, Placement,
                                   Rollout, Stage)

GROUP = "mammoth.dev"
APP_NAME = "mammoth-pipeline"
MANAGED_BY = "mammoth-operator"

CONFIG_DIR = "/etc/mammoth"
CONFIG_KEY = "pipeline.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
CACHE_DIR = "/var/cache/mammoth"
MODELS_DIR = "/models"
AUTH_DIR = "/etc/mammoth/auth"
ROLE_TOKENS_DIR = "/etc/mammoth/role-tokens"
#: Per-role token files each component mounts: it presents its own role's token; a stage also
#: holds the tokens of the roles it accepts (the AR accepts the gateway; the DiT the gateway and AR).
ROLE_TOKENS_MOUNTED = {"gateway": ("gateway",), "ar": ("gateway", "ar"), "dit": ("gateway", "ar")}
API_KEYS_DIR = "/etc/mammoth/api-keys"

#: gRPC and metrics ports of each stage, and the gRPC health service name its readiness probe asks for.
STAGE_PORTS = {"ar": (50051, 9091), "dit": (50052, 9092)}
HEALTH_SERVICES = {"ar": "mammoth.v1.AR", "dit": "mammoth.v1.DiT"}
GATEWAY_PORT = 8000

#: preStop sleep: endpoints controllers and gRPC resolvers drop the pod before it stops accepting work.
PRESTOP_SLEEP_SECONDS = 5
#: Extra grace on top of the drain (process exit, flushing logs).
TERMINATION_SLACK_SECONDS = 15
#: Longest ``terminationGracePeriodSeconds``: the cluster autoscaler's default
#: ``--max-graceful-termination-sec`` (600 s); a longer grace is cut short by a scale-down anyway.
MAX_TERMINATION_GRACE_SECONDS = 600
#: Startup probe period; failureThreshold = ceil(startupTimeoutSeconds / period).
STARTUP_PROBE_PERIOD_SECONDS = 10
#: Non-root user of the images.
RUN_AS_USER = 65532

#: Annotation on pod templates: the hash of the settings *that component reads*, so an edit rolls
#: exactly the components it concerns (``requestDefaults.steps`` rolls the gateway, not the GPUs).
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
#: Annotation on pod templates: the hash of the generated stage tokens, so a rotation rolls the pods.
TOKENS_HASH_ANNOTATION = f"{GROUP}/stage-tokens-hash"
#: Settings class of each component: the keys it reads from ``pipeline.yaml``.
SETTINGS_CLASSES = {"ar": ARSettings, "dit": DiTSettings, "gateway": GatewaySettings}


@dataclasses.dataclass(frozen=True)
class Child:
    """One desired child object.

    ``create_only`` lists field paths written when the object is created but never patched
    afterwards (``spec.replicas`` of a Deployment whose HorizontalPodAutoscaler owns it).
    """

    manifest: dict[str, Any]
    create_only: tuple[tuple[str, ...], ...] = ()

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclasses.dataclass(frozen=True)
class ChildRef:
    """A child identified by apiVersion, kind and name (for deletions of optional children)."""

    api_version: str
    kind: str
    name: str


@dataclasses.dataclass(frozen=True)
class ChildNames:
    config: str
    ar: str
    dit: str
    gateway: str
    network_policy: str
    stage_tokens: str


def child_names(name: str) -> ChildNames:
    """Deterministic child names of the pipeline ``name`` (at most 47 characters, so all stay DNS labels)."""
    return ChildNames(f"{name}-config", f"{name}-ar", f"{name}-dit", f"{name}-gateway", f"{name}-stages",
                      f"{name}-stage-tokens")


def selector_labels(name: str, component: str) -> dict[str, str]:
    """Labels that select one component's pods (Service, PDB, Deployment selectors); immutable over time."""
    return {
        "app.kubernetes.io/name": APP_NAME,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
    }


def labels(name: str, component: str) -> dict[str, str]:
    """The standard ``app.kubernetes.io/*`` set every child and pod carries."""
    return {
        **selector_labels(name, component),
        "app.kubernetes.io/part-of": APP_NAME,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def drain_grace_seconds(spec: PipelineSpec) -> int:
    """Drain grace of every pod: the longest request (``requestDefaults.requestTimeoutSeconds``), cut so
    the whole termination grace fits :data:`MAX_TERMINATION_GRACE_SECONDS` (580 s at most)."""
    longest = MAX_TERMINATION_GRACE_SECONDS - PRESTOP_SLEEP_SECONDS - TERMINATION_SLACK_SECONDS
    return min(spec.request_defaults.request_timeout_seconds, longest)


def termination_grace_seconds(spec: PipelineSpec) -> int:
    """``terminationGracePeriodSeconds``: preStop sleep + drain + slack, at most
    :data:`MAX_TERMINATION_GRACE_SECONDS`."""
    return PRESTOP_SLEEP_SECONDS + drain_grace_seconds(spec) + TERMINATION_SLACK_SECONDS


def backend_address(spec: PipelineSpec, component: str) -> str:
    """The gateway's gRPC target for a stage: DNS of its headless Service (client-side balancing)."""
    names = child_names(spec.name)
    service = names.ar if component == "ar" else names.dit
    return f"dns:///{service}.{spec.namespace}.svc:{STAGE_PORTS[component][0]}"


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


def pipeline_config(spec: PipelineSpec) -> dict[str, Any]:
    """The settings file (flat keys + ``ar``/``dit``/``gateway`` sections) every container reads.

    Both stages read the same flat ``chunk_rows`` and ``max_message_bytes``, so their transport
    limits cannot disagree.
    """
    rd = spec.request_defaults
    config: dict[str, Any] = {
        "host": "0.0.0.0",
        "device": spec.device,
        "dtype": spec.dtype,
        "chunk_rows": spec.transport.chunk_rows,
        "max_message_bytes": spec.transport.max_message_bytes,
        "drain_grace_seconds": drain_grace_seconds(spec),
        "cache_dir": CACHE_DIR,
        "log_format": spec.log_format,
        "log_level": spec.log_level,
        # request limits the DiT enforces as well as the gateway (flat: every component reads them)
        "max_pixels": rd.max_pixels,
        "min_pixels": rd.min_pixels,
    }
    if spec.transport.auth_token is not None:
        config["auth_token_file"] = f"{AUTH_DIR}/token"
    config["ar"] = {
        "port": STAGE_PORTS["ar"][0],
        "metrics_port": STAGE_PORTS["ar"][1],
        "max_running_sequences": spec.ar.capacity,
        "weights_dtype": spec.ar.weights_dtype,
        # The AR pushes only to pods behind the DiT's headless Service (stage_ar/dit_targets.py).
        "dit_allow_list": [backend_address(spec, "dit")],
    }
    config["dit"] = {
        "port": STAGE_PORTS["dit"][0],
        "metrics_port": STAGE_PORTS["dit"][1],
        "slots": spec.dit.capacity,
    }
    gateway: dict[str, Any] = {
        "port": GATEWAY_PORT,
        "default_steps": rd.steps,
        "default_guidance_scale": rd.guidance_scale,
        "default_cfg_range": list(rd.cfg_range),
        "default_ar_grid": rd.ar_grid,
        "default_ar_decoding": rd.ar_decoding,
        "default_jacobi_window": rd.jacobi_window,
        "max_prompt_chars": rd.max_prompt_chars,
        "request_timeout_seconds": rd.request_timeout_seconds,
        "queue_size": spec.gateway.queue_size,
    }
    if spec.gateway.api_keys is not None:
        gateway["api_keys_file"] = f"{API_KEYS_DIR}/keys"
    config["gateway"] = gateway
    if spec.transport.role_tokens is not None:
        for component, roles in ROLE_TOKENS_MOUNTED.items():
            for role in roles:
                config[component][f"{role}_token_file"] = f"{ROLE_TOKENS_DIR}/{role}"
    return config


def render_config(spec: PipelineSpec) -> str:
    """``pipeline.yaml`` as text (stable key order, so its hash only changes with its content)."""
    return yaml.safe_dump(pipeline_config(spec), sort_keys=True)


def component_settings(spec: PipelineSpec, component: str) -> dict[str, Any]:
    """The settings ``component`` reads from ``pipeline.yaml``: flat keys with its section merged on top
    (as ``mammoth_core.settings.read_config_file`` does), only the keys its settings class declares."""
    config = pipeline_config(spec)
    merged = {k: v for k, v in config.items() if k not in SETTINGS_CLASSES} | dict(config.get(component) or {})
    known = {f.name for f in dataclasses.fields(SETTINGS_CLASSES[component])}
    return {k: v for k, v in merged.items() if k in known}


def config_hash(spec: PipelineSpec, component: str) -> str:
    """First 16 hex digits of the SHA-256 of the settings ``component`` reads (:func:`component_settings`)."""
    return hashlib.sha256(canonical_json(component_settings(spec, component)).encode()).hexdigest()[:16]


def tokens_hash(tokens: Mapping[str, str]) -> str:
    """First 16 hex digits of the SHA-256 of the stage tokens (role -> token); rolls pods on rotation."""
    return hashlib.sha256(canonical_json(dict(tokens)).encode()).hexdigest()[:16]


def build_stage_tokens_secret(spec: PipelineSpec, tokens: Mapping[str, str]) -> Child:
    """The generated per-role token Secret (keys ``gateway`` and ``ar``). ``data`` is create-only and the
    Secret immutable: rotation is deleting it (the operator creates fresh tokens and the pods roll)."""
    data = {ROLE_TOKEN_KEYS[role]: base64.b64encode(tokens[role].encode()).decode() for role in ROLE_TOKEN_KEYS}
    return Child({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": child_names(spec.name).stage_tokens, "labels": labels(spec.name, "stage-tokens")},
        "type": "Opaque",
        "immutable": True,
        "data": data,
    }, create_only=(("data",),))


def build_config_map(spec: PipelineSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": child_names(spec.name).config, "labels": labels(spec.name, "config")},
        "data": {CONFIG_KEY: render_config(spec)},
    }


# ----------------------------------------------------------------------------------------------
# Pods


def _resources(placement: Placement, gpus: int, container: str) -> dict[str, Any]:
    """Requests/limits of one container: :data:`~mammoth_operator.spec.DEFAULT_REQUESTS` under the spec's."""
    result: dict[str, Any] = {}
    for section in ("requests", "limits"):
        # Quantities as strings, the way the API serves them back (and the typed client insists).
        values = {name: str(q) for name, q in placement.resources.get(section, {}).items()}
        if section == "requests":
            values = dict(DEFAULT_REQUESTS[container]) | values
        if gpus:
            values["nvidia.com/gpu"] = str(gpus)
        if values:
            result[section] = values
    return result


def _env(placement: Placement) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    overridden = {e["name"] for e in placement.env}
    return [e for e in env if e["name"] not in overridden] + [dict(e) for e in placement.env]


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _volumes(spec: PipelineSpec, component: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
    if component in ("ar", "dit"):
        source = spec.model.source
        model_volume: dict[str, Any] | None = None
        if source.scheme == "pvc":
            model_volume = {"name": "model", "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
        elif source.scheme == "file":
            model_volume = {"name": "model", "hostPath": {"path": source.path, "type": "Directory"}}
        elif source.scheme == "hf":
            if spec.model.cache_claim:
                model_volume = {"name": "model", "persistentVolumeClaim": {"claimName": spec.model.cache_claim}}
            else:
                model_volume = {"name": "model", "emptyDir": {"sizeLimit": spec.model.cache_size_limit}}
        if model_volume is not None:
            volumes.append(model_volume)
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


def _download_init_container(spec: PipelineSpec, stage: Stage) -> dict[str, Any]:
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
        "securityContext": _container_security(),
    }


def _pod_spec(spec: PipelineSpec, component: str, placement: Placement, container: dict[str, Any],
              init_containers: list[dict[str, Any]], volumes: list[dict[str, Any]]) -> dict[str, Any]:
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


def _deployment(spec: PipelineSpec, component: str, name: str, replicas: int, rollout: Rollout,
                placement: Placement, pod: dict[str, Any], progress_deadline: int,
                stage_tokens: str | None) -> dict[str, Any]:
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


def build_stage_deployment(spec: PipelineSpec, stage: Stage, stage_tokens: str | None = None) -> Child:
    """The AR or DiT Deployment.

    Probes: a gRPC startup probe on the stage's health service tolerates ``startupTimeoutSeconds``
    of model loading; the gRPC readiness probe passes only while the stage is SERVING; liveness is a
    TCP check, so a draining stage (NOT_SERVING, port still open) is not killed mid-drain.
    With autoscaling on, ``spec.replicas`` is create-only: the HPA owns it afterwards.
    ``stage_tokens`` is :func:`tokens_hash` of the generated token Secret (None: a user's Secret).
    """
    component = stage.component
    grpc_port, metrics_port = STAGE_PORTS[component]
    volumes, mounts = _volumes(spec, component)
    placement = stage.placement
    container: dict[str, Any] = {
        "name": component,
        "image": placement.image,
        "imagePullPolicy": placement.image_pull_policy,
        "command": ["mammoth"],
        "args": [component, "--config", CONFIG_PATH, "--checkpoint", checkpoint_path(spec), *placement.args],
        "ports": [
            {"name": "grpc", "containerPort": grpc_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"},
        ],
        "env": _env(placement),
        "startupProbe": {
            "grpc": {"port": grpc_port, "service": HEALTH_SERVICES[component]},
            "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(stage.startup_timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS),
        },
        "readinessProbe": {
            "grpc": {"port": grpc_port, "service": HEALTH_SERVICES[component]},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "tcpSocket": {"port": "grpc"},
            "periodSeconds": 20,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    container["resources"] = _resources(placement, stage.gpus, component)
    init = [_download_init_container(spec, stage)] if spec.model.source.scheme == "hf" else []
    pod = _pod_spec(spec, component, placement, container, init, volumes)
    name = child_names(spec.name).ar if component == "ar" else child_names(spec.name).dit
    autoscaled = stage.autoscaling.enabled
    replicas = stage.autoscaling.min_replicas if autoscaled else stage.replicas
    manifest = _deployment(spec, component, name, replicas, stage.rollout, placement, pod,
                           progress_deadline=stage.startup_timeout_seconds + 600, stage_tokens=stage_tokens)
    return Child(manifest, create_only=(("spec", "replicas"),) if autoscaled else ())


def build_gateway_deployment(spec: PipelineSpec, stage_tokens: str | None = None) -> Child:
    """The gateway Deployment (``/readyz`` is ready only once it reaches >= 1 AR and >= 1 DiT)."""
    gw: Gateway = spec.gateway
    placement = gw.placement
    volumes, mounts = _volumes(spec, "gateway")
    container: dict[str, Any] = {
        "name": "gateway",
        "image": placement.image,
        "imagePullPolicy": placement.image_pull_policy,
        "command": ["mammoth"],
        "args": ["gateway", "--config", CONFIG_PATH,
                 "--ar", backend_address(spec, "ar"), "--dit", backend_address(spec, "dit"), *placement.args],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "env": _env(placement),
        "startupProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 2, "failureThreshold": 60},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 6},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    container["resources"] = _resources(placement, 0, "gateway")
    pod = _pod_spec(spec, "gateway", placement, container, [], volumes)
    manifest = _deployment(spec, "gateway", child_names(spec.name).gateway, gw.replicas, gw.rollout,
                           placement, pod, progress_deadline=600, stage_tokens=stage_tokens)
    return Child(manifest)


def build_stage_service(spec: PipelineSpec, stage: Stage) -> Child:
    """Headless Service of a stage: DNS returns every ready pod, the gateway balances client-side."""
    component = stage.component
    grpc_port, metrics_port = STAGE_PORTS[component]
    name = child_names(spec.name).ar if component == "ar" else child_names(spec.name).dit
    return Child({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(spec.name, component)},
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(spec.name, component),
            "ports": [
                {"name": "grpc", "port": grpc_port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
                {"name": "metrics", "port": metrics_port, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    })


def build_gateway_service(spec: PipelineSpec) -> Child:
    """The pipeline's endpoint: port ``spec.gateway.service.port`` -> the gateway's HTTP port, with
    client-IP session affinity (``url`` responses are served by the replica that holds the image)."""
    gw = spec.gateway
    metadata: dict[str, Any] = {"name": child_names(spec.name).gateway, "labels": labels(spec.name, "gateway")}
    if gw.service_annotations:
        metadata["annotations"] = dict(gw.service_annotations)
    return Child({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": gw.service_type,
            # `url` images live in the memory of the gateway replica that made them: client-IP
            # affinity sends the follow-up GET to that replica (docs/API.md).
            "sessionAffinity": "ClientIP",
            "selector": selector_labels(spec.name, "gateway"),
            "ports": [{"name": "http", "port": gw.service_port, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}],
        },
    })


def build_pdb(spec: PipelineSpec, component: str, name: str, disruption: Disruption) -> Child:
    return Child({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": labels(spec.name, component)},
        "spec": {
            "maxUnavailable": disruption.max_unavailable,
            "selector": {"matchLabels": selector_labels(spec.name, component)},
        },
    })


def hpa_target(stage: Stage) -> int | str:
    """Target average of the load metric per pod: the spec's, else 75 % of the stage's capacity (>= 1)."""
    if stage.autoscaling.target_average_value is not None:
        return stage.autoscaling.target_average_value
    return max(1, math.floor(0.75 * stage.capacity))


def build_hpa(spec: PipelineSpec, stage: Stage) -> Child:
    """HorizontalPodAutoscaler (autoscaling/v2) on the stage's own load metric.

    ``Pods`` metrics come from ``custom.metrics.k8s.io`` (e.g. prometheus-adapter exposing the stage's
    ``/metrics`` gauge per pod); ``External`` metrics from ``external.metrics.k8s.io``, selected by the
    pipeline's labels. Scale-down is slow (5 minutes stabilisation, one pod per 2 minutes): a GPU pod
    takes minutes to load the model again.
    """
    component = stage.component
    name = child_names(spec.name).ar if component == "ar" else child_names(spec.name).dit
    target = {"type": "AverageValue", "averageValue": str(hpa_target(stage))}
    a = stage.autoscaling
    if a.metric_type == "Pods":
        metric = {"type": "Pods", "pods": {"metric": {"name": a.metric_name}, "target": target}}
    else:
        metric = {"type": "External", "external": {
            "metric": {"name": a.metric_name, "selector": {"matchLabels": selector_labels(spec.name, component)}},
            "target": target,
        }}
    return Child({
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": labels(spec.name, component)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [metric],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
                "scaleDown": {"stabilizationWindowSeconds": 300, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]},
            },
        },
    })


def build_network_policy(spec: PipelineSpec) -> Child:
    """Ingress of the pipeline's pods: the gateway reaches the AR and DiT gRPC ports, AR pods reach the DiT
    gRPC port, the ``networkPolicy.monitoring`` peer (if any) reaches the metrics ports, anyone reaches
    the gateway's HTTP port (the endpoint; its ``/metrics`` too); nothing else.

    One policy serves both stages because their ports differ (AR 50051/9091, DiT 50052/9092): the
    rule "AR pods -> 50052" can only ever admit traffic to DiT pods. Which RPC a caller may use is
    not a network property; the per-role stage tokens enforce it (`mammoth_core.grpc_common`).
    """
    base = {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": spec.name}
    (ar_grpc, ar_metrics), (dit_grpc, dit_metrics) = STAGE_PORTS["ar"], STAGE_PORTS["dit"]
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": selector_labels(spec.name, "gateway")}}],
         "ports": [{"protocol": "TCP", "port": ar_grpc}, {"protocol": "TCP", "port": dit_grpc}]},
        {"from": [{"podSelector": {"matchLabels": selector_labels(spec.name, "ar")}}],
         "ports": [{"protocol": "TCP", "port": dit_grpc}]},
        {"ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]},
    ]
    if spec.monitoring_peer is not None:
        ingress.append({"from": [dict(spec.monitoring_peer)],
                        "ports": [{"protocol": "TCP", "port": ar_metrics}, {"protocol": "TCP", "port": dit_metrics}]})
    return Child({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": child_names(spec.name).network_policy, "labels": labels(spec.name, "network-policy")},
        "spec": {
            "podSelector": {
                "matchLabels": base,
                "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                      "values": ["ar", "dit", "gateway"]}],
            },
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    })


def build_children(spec: PipelineSpec, tokens: Mapping[str, str] | None = None) -> list[Child]:
    """The full desired set of children, in apply order (Secret, config and Services before the pods).

    ``tokens`` (role -> token) are the generated stage tokens: those of the existing Secret, or fresh
    ones for its creation (the handlers always pass them when ``spec.transport.generated_role_tokens``;
    None leaves the Secret and the pods' token hash out, for callers that only inspect manifests).
    """
    names = child_names(spec.name)
    children: list[Child] = []
    stage_tokens = None
    if spec.transport.generated_role_tokens and tokens is not None:
        children.append(build_stage_tokens_secret(spec, tokens))
        stage_tokens = tokens_hash(tokens)
    children += [
        Child(build_config_map(spec)),
        build_stage_service(spec, spec.ar),
        build_stage_service(spec, spec.dit),
        build_gateway_service(spec),
        build_stage_deployment(spec, spec.ar, stage_tokens),
        build_stage_deployment(spec, spec.dit, stage_tokens),
        build_gateway_deployment(spec, stage_tokens),
    ]
    for component, name, disruption in (("ar", names.ar, spec.ar.disruption), ("dit", names.dit, spec.dit.disruption),
                                        ("gateway", names.gateway, spec.gateway.disruption)):
        if disruption.enabled:
            children.append(build_pdb(spec, component, name, disruption))
    for stage in (spec.ar, spec.dit):
        if stage.autoscaling.enabled:
            children.append(build_hpa(spec, stage))
    if spec.network_policy:
        children.append(build_network_policy(spec))
    return children


def unwanted_children(spec: PipelineSpec) -> list[ChildRef]:
    """Optional children this spec does not want (disabled PDB/HPA/NetworkPolicy): to delete if present."""
    names = child_names(spec.name)
    wanted = {(c.kind, c.name) for c in build_children(spec, {role: "" for role in ROLE_TOKEN_KEYS})}
    optional = [
        ChildRef("policy/v1", "PodDisruptionBudget", names.ar),
        ChildRef("policy/v1", "PodDisruptionBudget", names.dit),
        ChildRef("policy/v1", "PodDisruptionBudget", names.gateway),
        ChildRef("autoscaling/v2", "HorizontalPodAutoscaler", names.ar),
        ChildRef("autoscaling/v2", "HorizontalPodAutoscaler", names.dit),
        ChildRef("networking.k8s.io/v1", "NetworkPolicy", names.network_policy),
    ]
    return [ref for ref in optional if (ref.kind, ref.name) not in wanted]


def canonical_json(obj: Any) -> str:
    """Stable JSON (sorted keys, no spaces): used for hashes and the last-applied annotation."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
