"""Typed settings for every component, read once at the entry point.

Precedence, highest first: an explicit command-line flag > the environment variable
``MAMMOTH_<NAME>`` > the YAML file given by ``--config`` (or ``MAMMOTH_CONFIG``) > the defaults
below. A flag given explicitly wins even when its value equals the default.

The YAML file holds flat ``snake_case`` keys that apply to every component, plus optional sections
``ar:``, ``dit:``, ``gateway:`` whose keys override the flat ones for that component. A flat key of
another component is ignored silently (a shared ConfigMap carries keys for every component); a key
that no component reads (a misspelling, or anything under an ``operator:`` section, which no
component reads) is ignored with a warning naming it (`mammoth_core.config_keys.unknown_config_keys`).

Values are validated by pydantic against each field's type and the constraints in its metadata
(``choices``, ``ge``/``gt``/``le``/``lt``): strings from flags and the environment become typed
values (``"a:1, b:2"`` a list, ``"yes"`` True, ``"none"`` None), and every bad value is named with
its key, value and source in one `SettingsError`. Rules between fields are in ``validate``.

This module is the only place that reads ``os.environ`` for settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from mammoth_core import config_keys, limits
# SettingsError is defined with the validation and imported from here by every caller.
from mammoth_core.settings_values import (  # noqa: F401 - SettingsError re-exported
    CONFIG_FILE_MAX_BYTES, TOKEN_FILE_MAX_BYTES, SettingsError, check_fields, read_settings_file, validate_values,
)

logger = logging.getLogger(__name__)

ENV_PREFIX = "MAMMOTH_"
MiB = 1024 * 1024


def default_cache_dir() -> str:
    """Cache directory: ``$XDG_CACHE_HOME/mammoth`` or ``~/.cache/mammoth``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mammoth")


def _doc(help_text: str, **kw: Any) -> dict[str, Any]:
    """Field metadata: ``help``, and optionally ``choices`` and the bounds ``ge``/``gt``/``le``/``lt``
    (pydantic validates them; argparse and docs/CONFIGURATION.md show help and choices)."""
    return {"help": help_text, **kw}


#: The largest TCP port (settings' port fields and the ``mammoth`` command's ``--port`` flags).
MAX_PORT = 65535


def _port(default: int, help_text: str, lowest: int = 0) -> Any:
    """A TCP port field: ``lowest`` (0: any free port; -1 where the field may also be off) to `MAX_PORT`."""
    return field(default=default, metadata=_doc(help_text, ge=lowest, le=MAX_PORT))


def _limit(name: str) -> Any:
    """A settings field whose default and help come from the request-limits table
    (`mammoth_core.limits.RequestLimits`): the one home of request defaults and limits."""
    if isinstance(limits.field_default(name), list):
        return field(default_factory=lambda: limits.field_default(name),
                     metadata=_doc(limits.field_help(name)))
    return field(default=limits.field_default(name), metadata=_doc(limits.field_help(name)))


@dataclass
class BaseSettings:
    """Settings every component has."""

    host: str = field(default="127.0.0.1", metadata=_doc("address to listen on (\"\": every interface, IPv4 and IPv6)"))
    log_format: str = field(default="text", metadata=_doc("log format", choices=("text", "json")))
    log_level: str = field(default="info", metadata=_doc("log level (debug, info, warning, error)"))
    max_message_bytes: int = field(
        default=64 * MiB,
        metadata=_doc("gRPC max send AND receive message size in bytes (same on every component)", ge=MiB),
    )
    auth_token_file: str | None = field(
        default=None,
        metadata=_doc("file holding the stage-to-stage shared token (from a Secret); it grants every role"),
    )
    gateway_token_file: str | None = field(
        default=None,
        metadata=_doc(
            "file holding the gateway role's stage token: the gateway presents it; stages accept it "
            "on AR.Generate and DiT.Generate only"
        ),
    )
    ar_token_file: str | None = field(
        default=None,
        metadata=_doc(
            "file holding the AR role's stage token: the AR presents it; the DiT accepts it on "
            "DiT.PushConditions only"
        ),
    )
    insecure_no_auth: bool = field(
        default=False,
        metadata=_doc(
            "development only: a stage with no token file serves its RPCs (and the DiT profiler) "
            "unauthenticated; without it such a stage refuses them with UNAUTHENTICATED"
        ),
    )
    tls_cert_file: str | None = field(
        default=None, metadata=_doc("PEM certificate chain: stages serve gRPC over TLS with it")
    )
    tls_key_file: str | None = field(default=None, metadata=_doc("PEM private key of tls_cert_file"))
    tls_ca_file: str | None = field(
        default=None,
        metadata=_doc(
            "PEM CA bundle: clients verify stages against it (TLS on); stages with a certificate "
            "also require client certificates signed by it (mutual TLS)"
        ),
    )
    tls_server_name: str | None = field(
        default=None,
        metadata=_doc("name checked in the stages' certificates (pods are dialled by IP address)"),
    )
    drain_grace_seconds: float = field(
        default=30.0, metadata=_doc("on SIGTERM, seconds in-flight work may take before exit", ge=0)
    )
    cache_dir: str = field(default_factory=default_cache_dir, metadata=_doc("cache directory"))
    trace_dir: str | None = field(
        default=None,
        metadata=_doc("write a JSON trace of every request's hidden-state stream to this folder"),
    )
    trace_export: str | None = field(
        default=None,
        metadata=_doc(
            "OpenTelemetry spans (needs the 'tracing' extra; off when unset): 'otlp' or "
            "'otlp:<endpoint>' (OTLP/gRPC, e.g. otlp:http://otel-collector:4317) or 'jsonl:<path>' "
            "(one JSON span a line); the W3C traceparent travels gateway -> AR -> DiT"
        ),
    )
    trace_sample_ratio: float = field(
        default=1.0,
        metadata=_doc("fraction of requests the gateway traces (stages follow the caller's choice)", ge=0, le=1),
    )

    section: typing.ClassVar[str] = ""

    def validate(self) -> None:
        """Raise `SettingsError` for a value its field does not allow (`check_fields`) or a
        combination the rules between fields refuse."""
        check_fields(self)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise SettingsError("tls_cert_file and tls_key_file go together")
        from mammoth_core.tracing import parse_export

        try:
            parse_export(self.trace_export)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None

    def read_auth_token(self) -> str | None:
        """The shared stage token, stripped, or None when no file is configured.

        Raises:
            SettingsError: the file cannot be read as at most `TOKEN_FILE_MAX_BYTES` UTF-8 bytes
                (`read_settings_file`).
            OSError: the file cannot be read.
        """
        if not self.auth_token_file:
            return None
        return read_settings_file(self.auth_token_file, TOKEN_FILE_MAX_BYTES, "a token file").strip() or None

    def read_role_tokens(self) -> dict[str, str]:
        """Per-role stage tokens, ``{"gateway": ..., "ar": ...}``, for the files configured.

        Raises:
            SettingsError: a configured token file is empty, or cannot be read as at most
                `TOKEN_FILE_MAX_BYTES` UTF-8 bytes (`read_settings_file`).
            OSError: a configured token file cannot be read.
        """
        tokens: dict[str, str] = {}
        for role, path in (("gateway", self.gateway_token_file), ("ar", self.ar_token_file)):
            if path:
                token = read_settings_file(path, TOKEN_FILE_MAX_BYTES, "a token file").strip()
                if not token:
                    raise SettingsError(f"{role}_token_file {path} is empty")
                tokens[role] = token
        return tokens

    def client_token(self, role: str) -> str | None:
        """The token this component presents when it calls a stage as ``role`` (``gateway``/``ar``):
        the role's own token when configured, else the shared token, else None."""
        return self.read_role_tokens().get(role) or self.read_auth_token()

    def grpc_server_credentials(self) -> "typing.Any":
        """`grpc.ServerCredentials` for ``tls_*`` (None: plaintext)."""
        from mammoth_core.grpc_common import server_credentials

        return server_credentials(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)

    def grpc_channel_credentials(self) -> "typing.Any":
        """`grpc.ChannelCredentials` to call stages (None: plaintext); presents the certificate
        ``tls_cert_file`` as client certificate when one is configured."""
        from mammoth_core.grpc_common import channel_credentials

        return channel_credentials(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)


@dataclass
class StageSettings(BaseSettings):
    """Settings shared by the AR and DiT stages."""

    checkpoint: str = field(
        default="builtin://tiny", metadata=_doc("checkpoint directory or builtin://tiny")
    )
    port: int = _port(0, "gRPC port (0: any free port)")
    metrics_port: int = _port(-1, "Prometheus port (-1: off, 0: any free)", lowest=-1)
    device: str = field(default="auto", metadata=_doc("device", choices=("auto", "cpu", "cuda")))
    dtype: str = field(
        default="auto",
        metadata=_doc("model dtype", choices=("auto", "bfloat16", "float16", "float32")),
    )
    chunk_rows: int = field(default=64, metadata=_doc("hidden-state rows per chunk message", ge=1))
    answer_boundary: str = field(
        default="prompt_length",
        metadata=_doc(
            "answer boundary rule for the condition split",
            choices=("prompt_length", "last_10", "prompt_minus_10"),
        ),
    )
    torch_threads: int = field(default=0, metadata=_doc("torch intra-op threads (0: torch default)", ge=0))
    distributed_timeout_seconds: float = field(default=60.0, metadata=_doc(
        "with several ranks (tensor_parallel_size, dit_parallel): seconds one collective between the "
        "stage's ranks may wait before the stage fails (exit status 3) instead of hanging", gt=0, le=3600))
    distributed_startup_timeout_seconds: float = field(default=900.0, metadata=_doc(
        "with several ranks: seconds the ranks may take to start, meet and load their shards", gt=0, le=7200))

    def resolved_device(self) -> str:
        """``cuda`` when asked for or (auto) available, else ``cpu``."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self) -> "typing.Any":
        """torch dtype: auto = bfloat16 on CUDA, float32 on CPU."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device() == "cuda" else torch.float32
        return getattr(torch, self.dtype)


#: ``ar.weights_dtype`` values (the one list: the AR's linear layers and the CRD's ``ar.weightsDtype`` use it):
#: the model dtype; FP8 weights with activations in the model dtype (W8A16); FP8 weights with each
#: activation row quantized to E4M3 before the FP8 projections read it (W8A8).
AR_WEIGHTS_DTYPES = ("auto", "fp8", "fp8-w8a8")
#: ``ar.linear_backend`` values (the AR chooses its linear backend from them).
AR_LINEAR_BACKENDS = ("auto", "torch", "gemv")
#: ``dit.dit_parallel`` values (the DiT stage and the CRD's ``dit.parallel`` use it).
DIT_PARALLEL_MODES = ("none", "cfg", "ulysses")


@dataclass
class ARSettings(StageSettings):
    """AR stage settings (``mammoth ar``)."""

    port: int = _port(50051, "gRPC port (0: any free port)")
    metrics_port: int = _port(9091, "Prometheus port (-1: off, 0: any free)", lowest=-1)
    max_running_sequences: int = field(
        default=8, metadata=_doc("sequences decoded concurrently (KV-cache admission)", ge=1)
    )
    max_sequence_length: int = _limit("max_sequence_length")
    dit_allow_list: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "DiT addresses this AR may push to: host:port,... or dns:///name:port (every address the "
            "name resolves to, e.g. the DiT headless Service); any other dit_address is refused with "
            "PERMISSION_DENIED before any work. Empty: every address is refused; '*': any (insecure)"
        ),
    )
    max_dit_channels: int = field(
        default=64, metadata=_doc("open channels to DiT pods kept, at most (least recently used closed)", ge=1)
    )
    weights_dtype: str = field(
        default="auto",
        metadata=_doc(
            "AR weight format: auto (the model dtype; fp8 for a checkpoint that stores them in FP8, "
            "written by mammoth quantize-checkpoint), fp8 (the projections and MLPs a visual token "
            "reads converted at load to E4M3 with one scale per output channel; activations and KV "
            "stay in dtype) or fp8-w8a8 (fp8, and each activation row those projections read quantized "
            "to E4M3 with its own scale: FP8 tensor-core products, the fastest AR and the furthest from "
            "bf16; needs the gemv linear backend, i.e. CUDA; docs/PERFORMANCE.md, FP8 weights, for the "
            "measured deviation)",
            choices=AR_WEIGHTS_DTYPES,
        ),
    )
    linear_backend: str = field(
        default="auto",
        metadata=_doc(
            "AR linear layers: auto (Triton GEMV for <= 16 rows on CUDA, cuBLAS above; torch on CPU), "
            "torch (torch matmul / cuBLAS only) or gemv",
            choices=AR_LINEAR_BACKENDS,
        ),
    )
    tensor_parallel_size: int = field(default=1, metadata=_doc(
        "GPUs (ranks) the AR model is sharded over (Megatron tensor parallel, one process per GPU, "
        "started by the stage itself; NCCL on CUDA, gloo on CPU); must divide the attention heads, "
        "key/value heads and MLP width", ge=1, le=8))
    section: typing.ClassVar[str] = "ar"

    def validate(self) -> None:
        """`BaseSettings.validate`, and: ``fp8-w8a8`` only on one GPU (each rank would quantize its own
        shard of ``down_proj``'s input with its own scale: not yet built into the tensor-parallel tests)."""
        super().validate()
        if self.weights_dtype == "fp8-w8a8" and self.tensor_parallel_size > 1:
            raise SettingsError("weights_dtype fp8-w8a8 is not supported with tensor_parallel_size above 1 yet "
                                "(use fp8)")


@dataclass
class DiTSettings(StageSettings):
    """DiT stage settings (``mammoth dit``)."""

    port: int = _port(50052, "gRPC port (0: any free port)")
    metrics_port: int = _port(9092, "Prometheus port (-1: off, 0: any free)", lowest=-1)
    slots: int = field(default=4, metadata=_doc(
        "condition slots (concurrent requests); on CUDA at most what GPU memory holds, measured at start", ge=1))
    max_batch_requests: int = field(default=8, metadata=_doc(
        "most requests denoised together in one transformer forward (on CUDA at most what GPU "
        "memory holds, and at most slots)", ge=1))
    gpu_memory_utilization: float = field(default=0.9, metadata=_doc(
        "share of the GPU memory free after loading that slots and batches may use", gt=0, le=1))
    max_rows_per_slot: int = _limit("max_rows_per_slot")
    min_pixels: int = _limit("min_pixels")
    max_pixels: int = _limit("max_pixels")
    max_steps: int = _limit("max_steps")
    profile_dir: str | None = field(
        default=None,
        metadata=_doc(
            "folder for PyTorch profiler traces (default: <cache_dir>/profiles); "
            "POST /debug/profile?requests=N on the metrics port arms the profiler (with the "
            "gateway's or the shared stage token as Authorization: Bearer)"
        ),
    )
    profile_requests: int = field(
        default=0, metadata=_doc("profile the model work of the first N requests (0: off)", ge=0, le=100)
    )
    producer_grace_seconds: float = field(
        default=1.0,
        metadata=_doc(
            "a slot whose producer's push stream broke is retired after this many seconds unless "
            "a newer epoch (an AR retry) began meanwhile",
            ge=0,
        ),
    )
    dit_parallel: str = field(default="none", metadata=_doc(
        "DiT over several GPUs (ranks started by the stage itself): none, cfg (the CFG branches of a "
        "step split over the ranks, one all-gather per step) or ulysses (the joint sequence split over "
        "the ranks, all-to-all around each attention)", choices=DIT_PARALLEL_MODES))
    dit_parallel_size: int = field(default=2, metadata=_doc(
        "ranks (GPUs) of dit_parallel cfg or ulysses (ignored with none)", ge=2, le=8))
    section: typing.ClassVar[str] = "dit"

    def parallel_ranks(self) -> int:
        """Processes (GPUs) this DiT runs on: ``dit_parallel_size``, or 1 without ``dit_parallel``."""
        return 1 if self.dit_parallel == "none" else self.dit_parallel_size

    def validate(self) -> None:
        super().validate()
        _validate_limits(self)


@dataclass
class GatewaySettings(BaseSettings):
    """Gateway settings (``mammoth gateway``)."""

    port: int = _port(8000, "HTTP port (0: any free port)")
    ar: list[str] = field(
        default_factory=list,
        metadata=_doc("AR backends: host:port,... or dns:///name:port (headless Service)"),
    )
    dit: list[str] = field(
        default_factory=list,
        metadata=_doc("DiT backends: host:port,... or dns:///name:port (headless Service)"),
    )
    model_name: str = field(default="mammothmoda2", metadata=_doc("model id served"))
    default_steps: int = _limit("default_steps")
    default_guidance_scale: float = _limit("default_guidance_scale")
    default_cfg_range: list[float] = _limit("default_cfg_range")
    default_size: str = _limit("default_size")
    default_ar_grid: str = _limit("default_ar_grid")
    default_ar_decoding: str = _limit("default_ar_decoding")
    default_jacobi_window: int = _limit("default_jacobi_window")
    max_pixels: int = _limit("max_pixels")
    min_pixels: int = _limit("min_pixels")
    max_steps: int = _limit("max_steps")
    max_prompt_chars: int = _limit("max_prompt_chars")
    max_sequence_length: int = _limit("max_sequence_length")
    max_rows_per_slot: int = _limit("max_rows_per_slot")
    max_body_bytes: int = field(
        default=1024 * 1024,
        metadata=_doc("largest HTTP request body in bytes (413 above it; chunked bodies counted too)"),
    )
    request_timeout_seconds: float = _limit("request_timeout_seconds")
    queue_size: int = field(default=64, metadata=_doc("requests waiting for a slot, at most"))
    api_keys_file: str | None = field(default=None, metadata=_doc("file of API keys, one a line"))
    image_ttl_seconds: float = field(default=3600.0, metadata=_doc("lifetime of url images"))
    image_store_max_bytes: int = field(
        default=1 << 30, metadata=_doc("memory cap of stored url images in bytes (oldest evicted first)")
    )
    public_base_url: str | None = field(
        default=None, metadata=_doc("base URL for url responses when a proxy rewrites the Host header")
    )
    health_interval_seconds: float = field(default=2.0, metadata=_doc("backend health poll period", gt=0))
    health_timeout_seconds: float = field(
        default=1.0,
        metadata=_doc("deadline of one backend health probe: a stage that does not answer within it "
                      "is marked down; twice in a row, hung (its requests are retried elsewhere)", gt=0),
    )
    header_timeout_seconds: float = field(
        default=10.0,
        metadata=_doc("a connection must deliver each request's complete head (request line and "
                      "headers) within this many seconds, else it is closed", gt=0),
    )
    body_timeout_seconds: float = field(
        default=30.0,
        metadata=_doc("a request body must arrive completely within this many seconds after its "
                      "head, else the connection is closed", gt=0),
    )
    send_timeout_seconds: float = field(
        default=30.0,
        metadata=_doc("a client must keep reading its response: if it reads none of a waiting "
                      "response (over 64 KiB buffered) for this many seconds, the connection is "
                      "closed and the request's work cancelled", gt=0),
    )
    max_connections: int = field(
        default=1024,
        metadata=_doc("open HTTP connections, at most (also kept below the open-file limit); a "
                      "connection over it gets 503 and is closed before anything is read", ge=1),
    )
    section: typing.ClassVar[str] = "gateway"

    def validate(self) -> None:
        super().validate()
        _validate_limits(self)


def _validate_limits(settings: BaseSettings) -> None:
    """`mammoth_core.limits.validate` over the request limits ``settings`` carries."""
    try:
        present = {f.name for f in dataclasses.fields(settings)}
        limits.validate(limits.from_settings(settings), present)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------


def read_config_file(path: str | os.PathLike, section: str) -> dict[str, Any]:
    """Flat keys of a YAML settings file with ``section`` (``ar``/``dit``/``gateway``) merged on top.

    Raises:
        SettingsError: the file is not a YAML mapping, or cannot be read as at most
            `CONFIG_FILE_MAX_BYTES` UTF-8 bytes (`read_settings_file`).
        OSError: the file cannot be read.
    """
    data = yaml.safe_load(read_settings_file(path, CONFIG_FILE_MAX_BYTES, "a settings file")) or {}
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: expected a mapping at top level")
    sections = {"ar", "dit", "gateway", "operator"}
    flat = {k: v for k, v in data.items() if k not in sections}
    if section and isinstance(data.get(section), dict):
        flat.update(data[section])
    return flat


def flag_name(name: str) -> str:
    """The command-line flag of settings field ``name``: ``max_connections`` -> ``--max-connections``."""
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one ``--flag`` per settings field (default SUPPRESS, so explicit flags are detectable)."""
    parser.add_argument("--config", default=argparse.SUPPRESS, help="YAML settings file")
    for f in dataclasses.fields(cls):
        flag = flag_name(f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        help_text = f.metadata.get("help", "") + ("" if default in (None, [], "") else f" (default: {shown})")
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, dest=f.name, **kwargs)


def resolve_settings(
    cls: type[BaseSettings],
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
    warn_unknown_keys: bool = True,
) -> BaseSettings:
    """Build ``cls`` from defaults < file < env < explicit CLI values and validate it.

    Args:
        cls: the settings class (`ARSettings`, `DiTSettings`, `GatewaySettings`).
        cli: explicitly given flags only (``argparse`` namespace with SUPPRESS defaults, as dict).
        env: environment (default ``os.environ``).
        config_file: YAML file; default from ``cli['config']`` or ``MAMMOTH_CONFIG``.
        warn_unknown_keys: log a warning for each key no component reads (`unknown_config_keys`);
            off in the components ``mammoth up`` starts, since it warned once already.

    Raises:
        SettingsError: a value has the wrong type or is out of range.
    """
    cli = dict(cli or {})
    env = os.environ if env is None else env
    config_file = cli.pop("config", None) or config_file or env.get(ENV_PREFIX + "CONFIG")
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, tuple[Any, str]] = {}  # name -> (raw value, where it came from)
    if config_file:
        for unknown in config_keys.unknown_config_keys(config_file) if warn_unknown_keys else ():
            logger.warning("config file %s: unknown key %s is ignored", config_file, unknown)
        for key, value in read_config_file(config_file, cls.section).items():
            if key in names:
                values[key] = (value, str(config_file))
            else:  # another component's key (a shared file); a key of none was warned about above
                logger.debug("config file %s: key %r is not a %s setting", config_file, key, cls.__name__)
    for name in names:
        env_key = ENV_PREFIX + name.upper()
        if env_key in env:
            values[name] = (env[env_key], f"env {env_key}")
    values.update({name: (value, flag_name(name)) for name, value in cli.items() if name in names})
    settings = cls(**validate_values(cls, values))
    try:
        settings.validate()
    except SettingsError as exc:
        raise SettingsError(_with_source(str(exc), values)) from None
    return settings


def _with_source(message: str, values: Mapping[str, tuple[Any, str]]) -> str:
    """A ``validate()`` message that starts ``<name>: `` worded as `validate_values` words a bad value,
    ``setting '<name>' from <where it came from>: ...`` (``--default-size``, ``env MAMMOTH_...``, a
    config file), so a rule between values names the flag or variable the user set; others as given."""
    name, sep, rest = message.partition(": ")
    if sep and name in values:
        return f"setting '{name}' from {values[name][1]}: {rest}"
    return message
