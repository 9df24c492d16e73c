"""Optional OpenTelemetry tracing, with the W3C trace context carried gateway -> AR -> DiT.

Off unless the setting ``trace_export`` is set, and a no-op when the OpenTelemetry packages (the
``tracing`` extra: ``opentelemetry-api``, ``-sdk``, ``-exporter-otlp-proto-grpc``) are missing:
then `span` returns one shared `contextlib.nullcontext`, `inject` returns the metadata it was
given and `extract` returns None, so a pipeline without tracing runs the exact code and produces
the exact bytes it did before.

``trace_export``:

- ``otlp`` or ``otlp:<endpoint>`` (e.g. ``otlp:http://otel-collector:4317``): OTLP over gRPC,
  batched, to the endpoint (default: the exporter's own, ``localhost:4317``);
- ``jsonl:<path>``: one JSON object per finished span appended to ``<path>`` (written when the
  span ends; for tests and quick looks, see `JsonLinesSpanExporter`).

The trace context crosses processes as the gRPC metadata ``traceparent`` (W3C Trace Context,
``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>``): the gateway injects it into
``AR.Generate`` and ``DiT.Generate``, the AR into ``DiT.PushConditions``; the servicers extract it.
Sampling is ``parent-based``: a stage follows the sampled flag of the caller; the gateway samples
``trace_sample_ratio`` of its requests.

Spans (name: where, parent):

- ``POST /v1/images/generations`` (gateway, SERVER): one per HTTP request;
- ``gateway.image`` (gateway): one per image pipeline (``mammoth.image_index``, ``mammoth.seed``);
  parent of the DiT's ``mammoth.v1.DiT/Generate`` span;
- ``mammoth.v1.AR/Generate`` (gateway, CLIENT): one per AR attempt (``mammoth.epoch``);
- ``mammoth.v1.AR/Generate`` (AR, SERVER) with ``ar.prefill`` and ``ar.decode`` (engine clock),
  and ``mammoth.v1.DiT/PushConditions`` (AR, CLIENT: the hidden-state stream);
- ``mammoth.v1.DiT/Generate`` (DiT, SERVER) with ``dit.receive`` (first chunk -> conditions
  resident), ``dit.denoise``, ``dit.vae``, ``dit.encode``;
- ``mammoth.v1.DiT/PushConditions`` (DiT, SERVER).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import Any, Mapping, Sequence

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

try:  # the `tracing` extra
    from opentelemetry import trace as _trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (BatchSpanProcessor, SimpleSpanProcessor, SpanExporter,
                                                SpanExportResult)
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    AVAILABLE = False

_NULL = contextlib.nullcontext()
_tracer: Any = None
_provider: Any = None
_propagator: Any = None


def parse_export(value: str | None) -> tuple[str, str] | None:
    """``trace_export`` -> ``(kind, target)``: ``("otlp", endpoint or "")``, ``("jsonl", path)``,
    or None when tracing is off (None, ``""``, ``off``).

    Raises:
        ValueError: any other value.
    """
    if value is None or value.strip().lower() in ("", "off", "none"):
        return None
    kind, _, target = value.strip().partition(":")
    if kind == "otlp":
        return "otlp", target
    if kind == "jsonl" and target:
        return "jsonl", target
    raise ValueError(f"trace_export must be 'otlp', 'otlp:<endpoint>' or 'jsonl:<path>', got {value!r}")


if AVAILABLE:

    class JsonLinesSpanExporter(SpanExporter):
        """Appends each finished span to a file as one JSON object a line.

        Fields: ``name``, ``service`` (the component), ``trace_id`` (32 hex), ``span_id`` and
        ``parent_span_id`` (16 hex; null for a root span), ``kind`` (``SERVER``/``CLIENT``/
        ``INTERNAL``), ``start_ns``/``end_ns`` (Unix epoch, nanoseconds), ``status``,
        ``attributes``. Safe from several threads; the file is opened per batch (append mode).
        """

        def __init__(self, path: str) -> None:
            self.path = path
            self._lock = threading.Lock()

        def export(self, spans: Sequence["ReadableSpan"]) -> "SpanExportResult":
            lines = []
            for s in spans:
                ctx = s.get_span_context()
                lines.append(json.dumps({
                    "name": s.name,
                    "service": s.resource.attributes.get("service.name"),
                    "trace_id": f"{ctx.trace_id:032x}",
                    "span_id": f"{ctx.span_id:016x}",
                    "parent_span_id": f"{s.parent.span_id:016x}" if s.parent else None,
                    "kind": s.kind.name,
                    "start_ns": s.start_time,
                    "end_ns": s.end_time,
                    "status": s.status.status_code.name,
                    "attributes": {k: v if isinstance(v, (str, int, float, bool)) else list(v)
                                   for k, v in (s.attributes or {}).items()},
                }))
            with self._lock, open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass


def setup(component: str, trace_export: str | None, sample_ratio: float = 1.0) -> bool:
    """Start tracing for this process (``component``: ``gateway``, ``ar``, ``dit``; the spans'
    ``service.name`` is ``mammoth-<component>``). Call once at the entry point.

    Returns whether tracing is on. With ``trace_export`` unset it does nothing; when the
    OpenTelemetry packages are missing it logs a warning and leaves tracing off.

    Raises:
        ValueError: ``trace_export`` is malformed (`parse_export`).
    """
    global _tracer, _provider, _propagator
    parsed = parse_export(trace_export)
    if parsed is None:
        return False
    if not AVAILABLE:
        logger.warning("trace_export=%s but the OpenTelemetry packages are not installed "
                       "(pip install 'mammoth-pipeline[tracing]'); tracing is off", trace_export)
        return False
    kind, target = parsed
    provider = TracerProvider(resource=Resource.create({"service.name": f"mammoth-{component}"}),
                              sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    if kind == "jsonl":
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(target)))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=target) if target else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    _tracer = provider.get_tracer("mammoth")
    _propagator = TraceContextTextMapPropagator()
    logger.info("tracing on: %s", trace_export)
    return True


def shutdown() -> None:
    """Flush and stop the exporter (call before exit); a no-op when tracing is off."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    """Whether `setup` turned tracing on in this process."""
    return _tracer is not None


def span(name: str, parent: Any = None, *, kind: str = "INTERNAL",
         attributes: Mapping[str, Any] | None = None):
    """A context manager starting span ``name`` and making it current for the block.

    ``parent``: an OpenTelemetry context (from `extract`/`context_of`), default the current one.
    ``kind``: ``INTERNAL``, ``SERVER`` or ``CLIENT``. Yields the span, or None when tracing is off
    (then this is a shared `contextlib.nullcontext`: no allocation, no clock read).
    """
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(name, context=parent, kind=_trace.SpanKind[kind],
                                         attributes=attributes)


def start_span(name: str, parent: Any = None, *, kind: str = "INTERNAL",
               attributes: Mapping[str, Any] | None = None, start_ns: int | None = None) -> Any:
    """Start span ``name`` without making it current (end it with `end_span`); None when off.

    For spans whose start and end happen in different callbacks or async-generator steps, and for
    spans recorded after the fact (``start_ns``: Unix epoch nanoseconds).
    """
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=parent, kind=_trace.SpanKind[kind],
                              attributes=attributes, start_time=start_ns)


def end_span(span_: Any, end_ns: int | None = None, error: str | None = None) -> None:
    """End ``span_`` (None: nothing), at ``end_ns`` (Unix epoch ns) or now; ``error`` marks it
    failed with that description."""
    if span_ is None:
        return
    if error is not None:
        span_.set_status(_trace.Status(_trace.StatusCode.ERROR, error))
    span_.end(end_time=end_ns)


def record_span(name: str, parent_span: Any, start_ns: int, end_ns: int,
                attributes: Mapping[str, Any] | None = None) -> None:
    """Record a finished child span of ``parent_span`` from timestamps measured elsewhere (engine
    thread, worker thread); Unix epoch nanoseconds. A no-op when ``parent_span`` is None."""
    if parent_span is None or _tracer is None:
        return
    child = _tracer.start_span(name, context=_trace.set_span_in_context(parent_span),
                               attributes=attributes, start_time=int(start_ns))
    child.end(end_time=int(max(start_ns, end_ns)))


def context_of(span_: Any) -> Any:
    """The context whose current span is ``span_`` (a parent for `span`/`start_span`/`inject`)."""
    if span_ is None or _tracer is None:
        return None
    return _trace.set_span_in_context(span_)


def inject(metadata: Sequence[tuple[str, str]] = (), context: Any = None) -> tuple[tuple[str, str], ...]:
    """``metadata`` plus ``traceparent`` (and ``tracestate``) of ``context`` (default: the current
    one), for an outgoing gRPC call. Returns ``metadata`` unchanged (as a tuple) when off."""
    if _propagator is None:
        return metadata if isinstance(metadata, tuple) else tuple(metadata)
    metadata = tuple(metadata)
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    return metadata + tuple((k, v) for k, v in carrier.items() if k in (TRACEPARENT, TRACESTATE))


def extract(invocation_metadata: Sequence[Any] | None) -> Any:
    """The caller's context from incoming gRPC metadata (``context.invocation_metadata()``), or
    None when tracing is off or the call carries no valid ``traceparent``."""
    if _propagator is None or not invocation_metadata:
        return None
    carrier = {str(k).lower(): v for k, v in invocation_metadata
               if str(k).lower() in (TRACEPARENT, TRACESTATE) and isinstance(v, str)}
    if TRACEPARENT not in carrier:
        return None
    return _propagator.extract(carrier)


def monotonic_to_unix_ns(monotonic_s: float) -> int:
    """A `time.monotonic` reading (seconds) as Unix epoch nanoseconds (for `record_span`)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)

