"""Typed view of a ``MammothPipeline`` spec: the CRD's defaults applied and its rules checked.

Validation runs in two layers (docs/OPERATOR.md): the CRD's OpenAPI schema and CEL rules reject bad
specs at admission on a real cluster; :func:`parse_spec` runs the same CRD again
(:mod:`mammoth_operator.validation`: pruning, defaulting, schema, CEL), so an object that slipped
past admission (an older CRD, a server without CEL) is reported as ``Degraded/InvalidSpec`` instead
of producing broken children. The defaults are the CRD's ``default:`` values, nowhere else; the
request defaults and bounds in the CRD equal ``mammoth_core.limits`` (tests/unit/test_limits.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mammoth_core import limits
from mammoth_operator import validation


class InvalidSpec(ValueError):
    """The spec breaks a rule of the CRD. ``field`` is the JSON path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True)
class SecretRef:
    """A key inside a Secret of the pipeline's namespace."""

    name: str
    key: str


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A parsed ``spec.model.source``.

    ``scheme`` is one of ``pvc``, ``file``, ``hf``, ``builtin``. For ``pvc`` the claim and the path
    inside it; for ``file`` the host path; for ``hf`` the repository ``org/repo`` and revision; for
    ``builtin`` the preset name (``tiny``).
    """

    uri: str
    scheme: str
    claim: str = ""
    path: str = ""
    repo: str = ""
    revision: str = ""


@dataclasses.dataclass(frozen=True)
class Model:
    source: ModelSource
    cache_claim: str
    cache_size_limit: str
    hf_token: SecretRef | None


@dataclasses.dataclass(frozen=True)
class Rollout:
    """Deployment ``RollingUpdate`` numbers (int or percentage string)."""

    max_surge: int | str
    max_unavailable: int | str


@dataclasses.dataclass(frozen=True)
class Disruption:
    enabled: bool
    max_unavailable: int | str


@dataclasses.dataclass(frozen=True)
class Autoscaling:
    """HPA settings of one stage. ``target_average_value`` None means 75 % of the stage's capacity."""

    enabled: bool
    min_replicas: int
    max_replicas: int
    metric_type: str  # "Pods" | "External"
    metric_name: str
    target_average_value: int | str | None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Pod-level settings shared by every component (passed through to the pod template)."""

    image: str
    image_pull_policy: str
    resources: Mapping[str, Any]
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any]
    env: tuple[Mapping[str, Any], ...]
    args: tuple[str, ...]
    pod_annotations: Mapping[str, str]
    priority_class_name: str


@dataclasses.dataclass(frozen=True)
class Stage:
    """The AR or DiT stage. ``capacity`` is ``maxRunningSequences`` (AR) or ``slots`` (DiT)."""

    component: str  # "ar" | "dit"
    replicas: int
    gpus: int
    startup_timeout_seconds: int
    capacity: int
    rollout: Rollout
    disruption: Disruption
    autoscaling: Autoscaling
    placement: Placement
    #: AR only: ``weightsDtype`` (the AR setting ``weights_dtype``); "auto" for the DiT.
    weights_dtype: str = "auto"
    #: Processes (GPUs) of one replica, all in its pod: AR ``tensorParallelSize``; DiT ``parallelSize``
    #: with ``parallel`` cfg/ulysses, else 1. ``gpus`` is at least this (when not 0).
    ranks: int = 1
    #: DiT only: ``parallel`` (the DiT setting ``dit_parallel``); "none" for the AR.
    parallel: str = "none"


@dataclasses.dataclass(frozen=True)
class Gateway:
    replicas: int
    service_type: str
    service_port: int
    service_annotations: Mapping[str, str]
    queue_size: int
    api_keys: SecretRef | None
    rollout: Rollout
    disruption: Disruption
    placement: Placement


@dataclasses.dataclass(frozen=True)
class Transport:
    chunk_rows: int
    max_message_bytes: int
    auth_token: SecretRef | None
    #: Secret with per-role stage tokens (keys `ROLE_TOKEN_KEYS`): the gateway's token calls AR.Generate
    #: and DiT.Generate, the AR's token calls DiT.PushConditions, nothing else. Always set: the
    #: user's ``roleTokensSecretRef``, else the Secret the operator generates (``<name>-stage-tokens``).
    role_tokens: str | None = None
    #: True when ``role_tokens`` is the operator's generated Secret (created, owned, rotated by deletion).
    generated_role_tokens: bool = False


@dataclasses.dataclass(frozen=True)
class RequestDefaults:
    steps: int
    guidance_scale: float
    cfg_range: tuple[float, float]
    max_pixels: int
    min_pixels: int
    max_prompt_chars: int
    request_timeout_seconds: int
    #: AR grid recipe for requests without ``ar_grid`` (`mammoth_core.limits.resolve_grid`).
    ar_grid: str
    #: AR decoding of requests without ``ar_decoding`` (`mammoth_core.decoding`), and its window.
    ar_decoding: str
    jacobi_window: int


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """The whole spec, defaults applied and every rule checked."""

    name: str
    namespace: str
    model: Model
    ar: Stage
    dit: Stage
    gateway: Gateway
    transport: Transport
    request_defaults: RequestDefaults
    device: str
    dtype: str
    log_format: str
    log_level: str
    network_policy: bool
    service_account_name: str
    image_pull_secrets: tuple[str, ...]
    #: NetworkPolicy peer (``namespaceSelector`` and/or ``podSelector``) allowed to reach the metrics
    #: ports; None: nobody.
    monitoring_peer: Mapping[str, Any] | None = None


#: Default resource requests (CPU cores, memory) of each container, so no pod is BestEffort: the
#: stages hold the model in host memory while loading it (safetensors mmap, then copy to the GPU).
#: A pipeline's ``resources.requests`` override them key by key (docs/OPERATOR.md).
DEFAULT_REQUESTS: dict[str, dict[str, str]] = {
    "ar": {"cpu": "4", "memory": "32Gi"},
    "dit": {"cpu": "4", "memory": "32Gi"},
    "gateway": {"cpu": "500m", "memory": "512Mi"},
    "download-model": {"cpu": "1", "memory": "2Gi"},
}
#: Suffix of the generated per-role token Secret's name.
ROLE_TOKENS_SUFFIX = "-stage-tokens"


def parse_model_source(uri: str) -> ModelSource:
    """Split a model URI the CRD's rule admitted (``pvc://claim/path``, ``file:///path``,
    ``hf://org/repo@rev``, ``builtin://tiny``) into its parts."""
    scheme, rest = uri.split("://", 1)
    if scheme == "pvc":
        claim, path = rest.split("/", 1)
        return ModelSource(uri, scheme, claim=claim, path=path.strip("/"))
    if scheme == "file":
        return ModelSource(uri, scheme, path="/" + rest.lstrip("/"))
    if scheme == "hf":
        repo, revision = rest.split("@", 1)
        return ModelSource(uri, scheme, repo=repo, revision=revision)
    return ModelSource(uri, scheme, path=rest)


#: Keys of the per-role token Secret (``spec.transport.roleTokensSecretRef``), role -> key.
ROLE_TOKEN_KEYS = {"gateway": "gateway", "ar": "ar"}


def _secret_ref(data: Mapping[str, Any], key: str) -> SecretRef | None:
    ref = data.get(key)
    return None if ref is None else SecretRef(ref["name"], ref["key"])


def _rollout(data: Mapping[str, Any]) -> Rollout:
    return Rollout(data["maxSurge"], data["maxUnavailable"])


def _disruption(data: Mapping[str, Any]) -> Disruption:
    return Disruption(data["enabled"], data["maxUnavailable"])


def _placement(data: Mapping[str, Any], default_image: str) -> Placement:
    return Placement(
        image=data.get("image") or default_image,
        image_pull_policy=data["imagePullPolicy"],
        resources={k: dict(v) for k, v in (data.get("resources") or {}).items() if isinstance(v, Mapping)},
        node_selector=dict(data.get("nodeSelector") or {}),
        tolerations=tuple(dict(t) for t in data.get("tolerations") or ()),
        affinity=dict(data.get("affinity") or {}),
        env=tuple(dict(e) for e in data.get("env") or ()),
        args=tuple(data.get("args") or ()),
        pod_annotations=dict(data.get("podAnnotations") or {}),
        priority_class_name=data.get("priorityClassName") or "",
    )


def _ranks(data: Mapping[str, Any], component: str) -> int:
    """Processes of one replica: the AR's ``tensorParallelSize``, the DiT's ``parallelSize`` (1 without
    ``parallel``)."""
    if component == "ar":
        return data["tensorParallelSize"]
    return 1 if data["parallel"] == "none" else data["parallelSize"]


def _stage(data: Mapping[str, Any], component: str, default_image: str) -> Stage:
    scaling, metric = data["autoscaling"], data["autoscaling"]["metric"]
    ranks = _ranks(data, component)
    return Stage(
        component=component,
        replicas=data["replicas"],
        gpus=max(data["gpus"], ranks) if data["gpus"] else 0,  # one GPU per rank (0: the CPU)
        ranks=ranks,
        parallel=data["parallel"] if component == "dit" else "none",
        startup_timeout_seconds=data["startupTimeoutSeconds"],
        capacity=data["maxRunningSequences"] if component == "ar" else data["slots"],
        rollout=_rollout(data["rollout"]),
        disruption=_disruption(data["podDisruptionBudget"]),
        autoscaling=Autoscaling(scaling["enabled"], scaling["minReplicas"], scaling["maxReplicas"], metric["type"],
                                metric["name"], metric.get("targetAverageValue")),
        placement=_placement(data, default_image),
        weights_dtype=data["weightsDtype"] if component == "ar" else "auto",
    )


def _gateway(data: Mapping[str, Any], default_image: str) -> Gateway:
    service = data["service"]
    return Gateway(
        replicas=data["replicas"], service_type=service["type"], service_port=service["port"],
        service_annotations=dict(service.get("annotations") or {}), queue_size=data["queueSize"],
        api_keys=_secret_ref(data, "apiKeysSecretRef"), rollout=_rollout(data["rollout"]),
        disruption=_disruption(data["podDisruptionBudget"]), placement=_placement(data, default_image),
    )


def _transport(data: Mapping[str, Any], name: str) -> Transport:
    users = data.get("roleTokensSecretRef")
    return Transport(
        chunk_rows=data["chunkRows"],
        max_message_bytes=data["maxMessageBytes"],
        auth_token=_secret_ref(data, "authTokenSecretRef"),
        role_tokens=users["name"] if users is not None else f"{name}{ROLE_TOKENS_SUFFIX}",
        generated_role_tokens=users is None,
    )


def _request_defaults(data: Mapping[str, Any]) -> RequestDefaults:
    """``spec.requestDefaults``; ``arGrid`` must also parse (`mammoth_core.limits.parse_ar_grid`:
    the CRD's pattern allows sides the grid bound refuses)."""
    try:
        limits.parse_ar_grid(data["arGrid"])
    except limits.LimitError as exc:
        raise InvalidSpec("spec.requestDefaults.arGrid", exc.message) from None
    return RequestDefaults(
        steps=data["steps"], guidance_scale=float(data["guidanceScale"]),
        cfg_range=(float(data["cfgRange"][0]), float(data["cfgRange"][1])), max_pixels=data["maxPixels"],
        min_pixels=data["minPixels"], max_prompt_chars=data["maxPromptChars"],
        request_timeout_seconds=data["requestTimeoutSeconds"], ar_grid=data["arGrid"],
        ar_decoding=data["arDecoding"], jacobi_window=data["jacobiWindow"],
    )


def _monitoring_peer(network_policy: Mapping[str, Any]) -> dict[str, Any] | None:
    """``networkPolicy.monitoring`` as a NetworkPolicy peer, or None (metrics ports closed)."""
    monitoring = network_policy.get("monitoring")
    if monitoring is None:
        return None
    return {k: dict(monitoring[k]) for k in ("namespaceSelector", "podSelector") if monitoring.get(k) is not None}


def parse_spec(name: str, namespace: str, spec: Mapping[str, Any] | None, images: Mapping[str, str]) -> PipelineSpec:
    """Apply the CRD's defaults to a ``MammothPipeline`` spec and check every rule of the CRD.

    Args:
        name: ``metadata.name`` of the pipeline (the CRD allows at most 47 characters).
        namespace: its namespace.
        spec: the raw ``spec`` mapping (as stored; server-side defaults may or may not be applied;
            fields the CRD does not declare are ignored, as the API server prunes them).
        images: default images per component (``ar``, ``dit``, ``gateway``) for empty ``image`` fields.

    Raises:
        InvalidSpec: the spec breaks the CRD's schema or a CEL rule; ``field`` is the first violation's
            path, the message lists every violation (the messages the API server would answer).
    """
    data, violations = validation.validate_spec(name, spec)
    if violations:
        field, _, message = violations[0].partition(": ")
        raise InvalidSpec(field, "; ".join([message, *violations[1:]]))
    model, cache = data["model"], data["model"]["cache"]
    return PipelineSpec(
        name=name,
        namespace=namespace,
        model=Model(parse_model_source(model["source"]), cache.get("claimName") or "", str(cache["sizeLimit"]),
                    _secret_ref(model, "hfTokenSecretRef")),
        ar=_stage(data["ar"], "ar", images["ar"]),
        dit=_stage(data["dit"], "dit", images["dit"]),
        gateway=_gateway(data["gateway"], images["gateway"]),
        transport=_transport(data["transport"], name),
        request_defaults=_request_defaults(data["requestDefaults"]),
        device=data["runtime"]["device"],
        dtype=data["runtime"]["dtype"],
        log_format=data["logging"]["format"],
        log_level=data["logging"]["level"],
        network_policy=data["networkPolicy"]["enabled"],
        monitoring_peer=_monitoring_peer(data["networkPolicy"]),
        service_account_name=data.get("serviceAccountName") or "",
        image_pull_secrets=tuple(str(s["name"]) for s in data.get("imagePullSecrets") or ()),
    )
