"""Typed view of a ``MammothPipeline`` spec: defaults, parsing and the operator-side validation.

Validation runs in two layers (docs/OPERATOR.md): the CRD's OpenAPI schema and CEL rules reject bad
specs at admission on a real cluster; :func:`parse_spec` re-checks the same rules here, so an object
that slipped past admission (an older CRD, an emulator) is reported as ``Degraded/InvalidSpec``
instead of producing broken children. The defaults below equal the CRD's ``default:`` values (a
test compares them with ``charts/mammoth-operator/crds/mammothpipelines.mammoth.dev.yaml``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from mammoth_core import limits
from mammoth_core.settings import AR_WEIGHTS_DTYPES

#: The model source URI grammar; the same regular expression as the CRD's CEL rule on ``spec.model``.
MODEL_SOURCE_RE = re.compile(
    r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^/].*|file:///.+"
    r"|hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[-A-Za-z0-9_./]+)?|builtin://tiny)$"
)
#: An ``hf://`` revision the operator accepts: a full 40-hex commit sha, or a release tag
#: (``v1.2``, ``1.0.0-rc1``). A branch name (``main``) moves under a running pipeline; refused.
#: The same regular expression as the CRD's CEL rule.
HF_REVISION_RE = re.compile(r"^([0-9a-f]{40}|v?[0-9]+(\.[0-9]+)*([-+.][A-Za-z0-9.]+)*)$")
#: A Kubernetes resource quantity (the API server's grammar).
QUANTITY_RE = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
#: Longest pipeline name: children append up to ``-gateway`` (8 characters) and must stay DNS labels.
MAX_NAME_LENGTH = 47
#: Bytes one hidden-state row may take at most (4096 float32 values); a chunk must fit one message.
MAX_ROW_BYTES = 16384


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


# Defaults: equal to the CRD's (tests/operator/test_crd.py compares them).
DEFAULTS: dict[str, Any] = {
    "stage.replicas": 1,
    "stage.gpus": 1,
    "stage.startupTimeoutSeconds": 1800,
    "stage.rollout.maxSurge": 0,
    "stage.rollout.maxUnavailable": 1,
    "gateway.rollout.maxSurge": 1,
    "gateway.rollout.maxUnavailable": 0,
    "pdb.enabled": True,
    "pdb.maxUnavailable": 1,
    "autoscaling.enabled": False,
    "autoscaling.minReplicas": 1,
    "autoscaling.maxReplicas": 4,
    "autoscaling.metric.type": "Pods",
    "ar.autoscaling.metric.name": "mammoth_ar_running_sequences",
    "dit.autoscaling.metric.name": "mammoth_dit_slots_in_use",
    "ar.maxRunningSequences": 8,
    "ar.weightsDtype": "auto",
    "dit.slots": 4,
    "imagePullPolicy": "IfNotPresent",
    "gateway.replicas": 1,
    "gateway.service.type": "ClusterIP",
    "gateway.service.port": 80,
    "gateway.queueSize": 64,
    "model.cache.sizeLimit": "64Gi",
    "secret.token.key": "token",
    "secret.apiKeys.key": "api-keys",
    "transport.chunkRows": 64,
    "transport.maxMessageBytes": 67108864,
    # requestDefaults.*: from the one table of request limits (mammoth_core.limits), below
    "runtime.device": "auto",
    "runtime.dtype": "auto",
    "logging.format": "json",
    "logging.level": "info",
    "networkPolicy.enabled": True,
}
DEFAULTS.update({f"requestDefaults.{crd}": limits.field_default(name) for name, crd in limits.crd_keys().items()})


def _bounds(name: str) -> tuple[Any, Any]:
    """``(minimum, maximum)`` of the request-limits table's field ``name``."""
    meta = limits.RequestLimits.__dataclass_fields__[name].metadata
    return meta["minimum"], meta["maximum"]

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
    """Parse a model URI (``pvc://claim/path``, ``file:///path``, ``hf://org/repo@rev``, ``builtin://tiny``).

    Raises:
        InvalidSpec: the URI matches none of the schemes, or an ``hf://`` URI has no revision.
    """
    if not isinstance(uri, str) or not MODEL_SOURCE_RE.match(uri):
        raise InvalidSpec(
            "spec.model.source",
            f"{uri!r} is not pvc://<claim>/<path>, file:///<path>, hf://<org>/<repo>@<revision> or builtin://tiny",
        )
    scheme, rest = uri.split("://", 1)
    if scheme == "pvc":
        claim, path = rest.split("/", 1)
        return ModelSource(uri, scheme, claim=claim, path=path.strip("/"))
    if scheme == "file":
        return ModelSource(uri, scheme, path="/" + rest.lstrip("/"))
    if scheme == "hf":
        if "@" not in rest:
            raise InvalidSpec("spec.model.source", "hf:// sources must pin a revision: hf://<org>/<repo>@<revision>")
        repo, revision = rest.split("@", 1)
        if not HF_REVISION_RE.match(revision):
            raise InvalidSpec("spec.model.source", f"hf:// revision {revision!r} must be a 40-hex commit sha or a "
                                                   "release tag such as v1.0 (a branch moves under a running pipeline)")
        return ModelSource(uri, scheme, repo=repo, revision=revision)
    return ModelSource(uri, scheme, path=rest)


class _Reader:
    """Reads one mapping of the spec with defaults and type checks, naming fields by JSON path."""

    def __init__(self, data: Any, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise InvalidSpec(path, f"must be an object, got {type(data).__name__}")
        self.data = data
        self.path = path

    def sub(self, key: str) -> _Reader:
        return _Reader(self.data.get(key), f"{self.path}.{key}")

    def int(self, key: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidSpec(f"{self.path}.{key}", f"must be an integer, got {value!r}")
        if lo is not None and value < lo:
            raise InvalidSpec(f"{self.path}.{key}", f"must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise InvalidSpec(f"{self.path}.{key}", f"must be <= {hi}, got {value}")
        return value

    def num(self, key: str, default: float, lo: float, hi: float) -> float:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidSpec(f"{self.path}.{key}", f"must be a number, got {value!r}")
        if not lo <= value <= hi:
            raise InvalidSpec(f"{self.path}.{key}", f"must be within [{lo}, {hi}], got {value}")
        return float(value)

    def str(self, key: str, default: str = "", choices: tuple[str, ...] | None = None, max_length: int = 512) -> str:
        value = self.data.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, str):
            raise InvalidSpec(f"{self.path}.{key}", f"must be a string, got {value!r}")
        if choices is not None and value not in choices:
            raise InvalidSpec(f"{self.path}.{key}", f"must be one of {', '.join(choices)}, got {value!r}")
        if len(value) > max_length:
            raise InvalidSpec(f"{self.path}.{key}", f"must be at most {max_length} characters")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise InvalidSpec(f"{self.path}.{key}", f"must be a boolean, got {value!r}")
        return value

    def int_or_percent(self, key: str, default: int | str | None) -> int | str | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise InvalidSpec(f"{self.path}.{key}", f"must be an integer or a percentage, got {value!r}")
        if isinstance(value, int) and value < 0 or isinstance(value, str) and not re.fullmatch(r"\d+%?", value):
            raise InvalidSpec(f"{self.path}.{key}", f"must be a non-negative integer or a percentage, got {value!r}")
        return value

    def quantity(self, key: str, default: str) -> str:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not QUANTITY_RE.match(str(value)):
            raise InvalidSpec(f"{self.path}.{key}", f"must be a resource quantity such as 64Gi, got {value!r}")
        return str(value)

    def str_map(self, key: str) -> dict[str, str]:
        value = self.data.get(key) or {}
        if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
            raise InvalidSpec(f"{self.path}.{key}", "must be a map of strings")
        return dict(value)

    def obj_list(self, key: str, required: str | None = None) -> tuple[dict[str, Any], ...]:
        value = self.data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            raise InvalidSpec(f"{self.path}.{key}", "must be a list of objects")
        if required and not all(required in v for v in value):
            raise InvalidSpec(f"{self.path}.{key}", f"every item needs {required!r}")
        return tuple(dict(v) for v in value)

    def secret_ref(self, key: str, key_default: str) -> SecretRef | None:
        if self.data.get(key) is None:
            return None
        ref = self.sub(key)
        name = ref.str("name", max_length=253)
        if not name:
            raise InvalidSpec(f"{ref.path}.name", "is required")
        return SecretRef(name, ref.str("key", key_default, max_length=253) or key_default)


#: Keys of the per-role token Secret (``spec.transport.roleTokensSecretRef``), role -> key.
ROLE_TOKEN_KEYS = {"gateway": "gateway", "ar": "ar"}


def _role_tokens(tr: _Reader) -> str | None:
    """Name of the user's per-role token Secret, or None (the operator then generates one)."""
    if tr.data.get("roleTokensSecretRef") is None:
        return None
    ref = tr.sub("roleTokensSecretRef")
    name = ref.str("name", max_length=253)
    if not name:
        raise InvalidSpec(f"{ref.path}.name", "is required")
    return name


def _label_selector(r: _Reader, key: str) -> dict[str, Any] | None:
    value = r.data.get(key)
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) - {"matchLabels", "matchExpressions"}:
        raise InvalidSpec(f"{r.path}.{key}", "must be a label selector (matchLabels, matchExpressions)")
    sub = r.sub(key)
    selector: dict[str, Any] = {}
    if "matchLabels" in value:
        selector["matchLabels"] = sub.str_map("matchLabels")
    if "matchExpressions" in value:
        selector["matchExpressions"] = [dict(e) for e in sub.obj_list("matchExpressions", required="key")]
    return selector


def _monitoring_peer(np: _Reader) -> dict[str, Any] | None:
    """``networkPolicy.monitoring`` as a NetworkPolicy peer, or None (metrics ports closed)."""
    if np.data.get("monitoring") is None:
        return None
    mon = np.sub("monitoring")
    peer = {k: sel for k in ("namespaceSelector", "podSelector") if (sel := _label_selector(mon, k)) is not None}
    if not peer:
        raise InvalidSpec(f"{mon.path}", "needs a namespaceSelector or a podSelector")
    return peer


def _is_zero(value: int | str | None) -> bool:
    return value in (0, "0", "0%")


def _rollout(r: _Reader, surge: int, unavailable: int) -> Rollout:
    rollout = Rollout(r.int_or_percent("maxSurge", surge), r.int_or_percent("maxUnavailable", unavailable))
    if _is_zero(rollout.max_surge) and _is_zero(rollout.max_unavailable):
        raise InvalidSpec(r.path, "maxSurge and maxUnavailable must not both be zero")
    return rollout


def _disruption(r: _Reader) -> Disruption:
    """A PodDisruptionBudget; ``maxUnavailable: 0`` is refused (it blocks every node drain forever)."""
    disruption = Disruption(r.bool("enabled", DEFAULTS["pdb.enabled"]),
                            r.int_or_percent("maxUnavailable", DEFAULTS["pdb.maxUnavailable"]))
    if _is_zero(disruption.max_unavailable):
        raise InvalidSpec(f"{r.path}.maxUnavailable", "podDisruptionBudget.maxUnavailable must not be 0 (it blocks node drains)")
    return disruption


def _placement(r: _Reader, default_image: str) -> Placement:
    resources = r.data.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise InvalidSpec(f"{r.path}.resources", "must be an object")
    affinity = r.data.get("affinity") or {}
    if not isinstance(affinity, Mapping):
        raise InvalidSpec(f"{r.path}.affinity", "must be an object")
    args = r.data.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidSpec(f"{r.path}.args", "must be a list of strings")
    return Placement(
        image=r.str("image") or default_image,
        image_pull_policy=r.str("imagePullPolicy", DEFAULTS["imagePullPolicy"], ("Always", "IfNotPresent", "Never")),
        resources={k: dict(v) for k, v in resources.items() if isinstance(v, Mapping)},
        node_selector=r.str_map("nodeSelector"),
        tolerations=r.obj_list("tolerations"),
        affinity=dict(affinity),
        env=r.obj_list("env", required="name"),
        args=tuple(args),
        pod_annotations=r.str_map("podAnnotations"),
        priority_class_name=r.str("priorityClassName", max_length=253),
    )


def _stage(r: _Reader, component: str, default_image: str) -> Stage:
    a = r.sub("autoscaling")
    m = a.sub("metric")
    autoscaling = Autoscaling(
        enabled=a.bool("enabled", DEFAULTS["autoscaling.enabled"]),
        min_replicas=a.int("minReplicas", DEFAULTS["autoscaling.minReplicas"], 1, 64),
        max_replicas=a.int("maxReplicas", DEFAULTS["autoscaling.maxReplicas"], 1, 64),
        metric_type=m.str("type", DEFAULTS["autoscaling.metric.type"], ("Pods", "External")),
        metric_name=m.str("name", DEFAULTS[f"{component}.autoscaling.metric.name"], max_length=253),
        target_average_value=m.int_or_percent("targetAverageValue", None),
    )
    if autoscaling.min_replicas > autoscaling.max_replicas:
        raise InvalidSpec(f"{a.path}.minReplicas", "autoscaling.minReplicas must not exceed autoscaling.maxReplicas")
    weights_dtype = "auto"
    if component == "ar":
        capacity = r.int("maxRunningSequences", DEFAULTS["ar.maxRunningSequences"], 1, 1024)
        weights_dtype = r.str("weightsDtype", DEFAULTS["ar.weightsDtype"], AR_WEIGHTS_DTYPES)
    else:
        capacity = r.int("slots", DEFAULTS["dit.slots"], 1, 64)
    return Stage(
        component=component,
        replicas=r.int("replicas", DEFAULTS["stage.replicas"], 0, 64),
        gpus=r.int("gpus", DEFAULTS["stage.gpus"], 0, 16),
        startup_timeout_seconds=r.int("startupTimeoutSeconds", DEFAULTS["stage.startupTimeoutSeconds"], 60, 14400),
        capacity=capacity,
        rollout=_rollout(r.sub("rollout"), DEFAULTS["stage.rollout.maxSurge"], DEFAULTS["stage.rollout.maxUnavailable"]),
        disruption=_disruption(r.sub("podDisruptionBudget")),
        autoscaling=autoscaling,
        placement=_placement(r, default_image),
        weights_dtype=weights_dtype,
    )


def parse_spec(name: str, namespace: str, spec: Mapping[str, Any] | None, images: Mapping[str, str]) -> PipelineSpec:
    """Apply the defaults to a ``MammothPipeline`` spec and check every rule of the CRD.

    Args:
        name: ``metadata.name`` of the pipeline (at most :data:`MAX_NAME_LENGTH` characters).
        namespace: its namespace.
        spec: the raw ``spec`` mapping (as stored; server-side defaults may or may not be applied).
        images: default images per component (``ar``, ``dit``, ``gateway``) for empty ``image`` fields.

    Raises:
        InvalidSpec: the first rule broken, with the field's JSON path (the CEL rules' messages).
    """
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidSpec("metadata.name", f"must be at most {MAX_NAME_LENGTH} characters")
    r = _Reader(spec, "spec")
    if r.data.get("model") is None:
        raise InvalidSpec("spec.model", "is required")
    mr = r.sub("model")
    if "source" not in mr.data:
        raise InvalidSpec("spec.model.source", "is required")
    cache = mr.sub("cache")
    model = Model(
        source=parse_model_source(mr.data["source"]),
        cache_claim=cache.str("claimName", max_length=253),
        cache_size_limit=cache.quantity("sizeLimit", DEFAULTS["model.cache.sizeLimit"]),
        hf_token=mr.secret_ref("hfTokenSecretRef", DEFAULTS["secret.token.key"]),
    )

    tr = r.sub("transport")
    transport = Transport(
        chunk_rows=tr.int("chunkRows", DEFAULTS["transport.chunkRows"], 1, 4096),
        max_message_bytes=tr.int("maxMessageBytes", DEFAULTS["transport.maxMessageBytes"], 1048576, 2147483647),
        auth_token=tr.secret_ref("authTokenSecretRef", DEFAULTS["secret.token.key"]),
        role_tokens=_role_tokens(tr) or f"{name}{ROLE_TOKENS_SUFFIX}",
        generated_role_tokens=tr.data.get("roleTokensSecretRef") is None,
    )
    if transport.chunk_rows * MAX_ROW_BYTES > transport.max_message_bytes:
        raise InvalidSpec(
            "spec.transport.chunkRows",
            "a chunk (chunkRows rows of up to 4096 float32 values) must fit in maxMessageBytes",
        )

    qr = r.sub("requestDefaults")
    cfg = qr.data.get("cfgRange", DEFAULTS["requestDefaults.cfgRange"])
    if (not isinstance(cfg, list) or len(cfg) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 for v in cfg)):
        raise InvalidSpec("spec.requestDefaults.cfgRange", "must be two numbers within [0, 1]")
    if cfg[0] > cfg[1]:
        raise InvalidSpec("spec.requestDefaults.cfgRange", "requestDefaults.cfgRange must be [start, end] with start <= end")
    request_defaults = RequestDefaults(
        steps=qr.int("steps", DEFAULTS["requestDefaults.steps"], *_bounds("default_steps")),
        guidance_scale=qr.num("guidanceScale", DEFAULTS["requestDefaults.guidanceScale"],
                              *_bounds("default_guidance_scale")),
        cfg_range=(float(cfg[0]), float(cfg[1])),
        max_pixels=qr.int("maxPixels", DEFAULTS["requestDefaults.maxPixels"], *_bounds("max_pixels")),
        min_pixels=qr.int("minPixels", DEFAULTS["requestDefaults.minPixels"], *_bounds("min_pixels")),
        max_prompt_chars=qr.int("maxPromptChars", DEFAULTS["requestDefaults.maxPromptChars"],
                                *_bounds("max_prompt_chars")),
        request_timeout_seconds=qr.int("requestTimeoutSeconds", DEFAULTS["requestDefaults.requestTimeoutSeconds"],
                                       *_bounds("request_timeout_seconds")),
        ar_grid=qr.str("arGrid", DEFAULTS["requestDefaults.arGrid"], max_length=16),
        ar_decoding=qr.str("arDecoding", DEFAULTS["requestDefaults.arDecoding"], ("sequential", "jacobi")),
        jacobi_window=qr.int("jacobiWindow", DEFAULTS["requestDefaults.jacobiWindow"],
                             *_bounds("default_jacobi_window")),
    )
    if request_defaults.min_pixels > request_defaults.max_pixels:
        raise InvalidSpec("spec.requestDefaults.minPixels", "requestDefaults.minPixels must not exceed maxPixels")
    try:
        limits.parse_ar_grid(request_defaults.ar_grid)
    except limits.LimitError as exc:
        raise InvalidSpec("spec.requestDefaults.arGrid", exc.message) from None

    gr = r.sub("gateway")
    sr = gr.sub("service")
    gateway = Gateway(
        replicas=gr.int("replicas", DEFAULTS["gateway.replicas"], 0, 64),
        service_type=sr.str("type", DEFAULTS["gateway.service.type"], ("ClusterIP", "NodePort", "LoadBalancer")),
        service_port=sr.int("port", DEFAULTS["gateway.service.port"], 1, 65535),
        service_annotations=sr.str_map("annotations"),
        queue_size=gr.int("queueSize", DEFAULTS["gateway.queueSize"], 1, 100000),
        api_keys=gr.secret_ref("apiKeysSecretRef", DEFAULTS["secret.apiKeys.key"]),
        rollout=_rollout(gr.sub("rollout"), DEFAULTS["gateway.rollout.maxSurge"], DEFAULTS["gateway.rollout.maxUnavailable"]),
        disruption=_disruption(gr.sub("podDisruptionBudget")),
        placement=_placement(gr, images["gateway"]),
    )

    rt, lg = r.sub("runtime"), r.sub("logging")
    pull_secrets = r.obj_list("imagePullSecrets", required="name")
    return PipelineSpec(
        name=name,
        namespace=namespace,
        model=model,
        ar=_stage(r.sub("ar"), "ar", images["ar"]),
        dit=_stage(r.sub("dit"), "dit", images["dit"]),
        gateway=gateway,
        transport=transport,
        request_defaults=request_defaults,
        device=rt.str("device", DEFAULTS["runtime.device"], ("auto", "cpu", "cuda")),
        dtype=rt.str("dtype", DEFAULTS["runtime.dtype"], ("auto", "bfloat16", "float16", "float32")),
        log_format=lg.str("format", DEFAULTS["logging.format"], ("text", "json")),
        log_level=lg.str("level", DEFAULTS["logging.level"], ("debug", "info", "warning", "error")),
        network_policy=r.sub("networkPolicy").bool("enabled", DEFAULTS["networkPolicy.enabled"]),
        monitoring_peer=_monitoring_peer(r.sub("networkPolicy")),
        service_account_name=r.str("serviceAccountName", max_length=253),
        image_pull_secrets=tuple(str(s["name"]) for s in pull_secrets),
    )
