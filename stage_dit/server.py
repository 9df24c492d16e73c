"""The DiT stage's gRPC server: the ``mammoth.v1.DiT`` servicer, health, metrics and drain.

``Generate`` (gateway -> DiT, server stream): validate the image parameters (the request limits
of `mammoth_core.limits`, as the gateway does), reserve a slot (fail fast with RESOURCE_EXHAUSTED
when the pool is full), then run a `stage_dit.session.GenerateSession`: `Reserved`, RECEIVING
progress while the AR pushes the conditions, `ConditionsComplete` the moment they are resident (no
AR is needed after it), then the request joins the worker loop (`stage_dit.engine`, batched with
the other requests by step, never on the event loop): one DENOISING progress message per step, then
DECODING, then the final `Image`. The slot lives exactly as long as this stream: it is released
after the engine has let go of it, so closing or cancelling the stream makes any further push fail.

``PushConditions`` (AR -> DiT, client stream) is the transport's `stage_dit.receiver.receive_push`:
every chunk goes through `Slot.accept` (the rules of `stage_dit.chunk_validator`); a violation aborts
the call with the rule's status; the stream is acknowledged only when the conditions are resident
on the device.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import time
from typing import Any, AsyncIterator

import grpc

from mammoth_core import drain, errors, grpc_common, limits, tracing, transport_metrics
from mammoth_core.addresses import format_address
from mammoth_core.errors import Reason
from mammoth_core.logging import request_id_var
from mammoth_core.profiling import PROFILE_PATH, StageProfiler, guarded
from mammoth_core.request_trace import write_request_trace
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc
from mammoth_core.runtime import start_metrics_server, starting, write_ready_file
from mammoth_core.settings import DiTSettings
from mammoth_core.wire import WireError
from stage_dit.capacity import measure_capacity
from stage_dit.denoise import ConditionTooLongError
from stage_dit.engine import DiTEngine
from stage_dit.metrics import REQUESTS as DIT_REQUESTS
from stage_dit.receiver import SlotPool, add_dit_servicer, receive_push
from stage_dit.session import OUTPUT_FORMATS, GenerateSession, preview_steps  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

SERVICE_NAME = "mammoth.v1.DiT"


def validate_params(params: pb.ImageParams, table: limits.RequestLimits = limits.DEFAULTS) -> str | None:
    """Why ``params`` cannot be served, or None: the same size and step limits the gateway applies
    (`mammoth_core.limits.check_image` over this DiT's ``min_pixels``/``max_pixels``/``max_steps``),
    so a direct call gets no more than a request through the gateway."""
    try:
        limits.check_image(params.width, params.height, params.num_inference_steps, table)
    except limits.LimitError as exc:
        return exc.message
    lo, hi = limits.GUIDANCE_SCALE_RANGE
    if not lo <= params.text_guidance_scale <= hi:
        return f"text_guidance_scale must be in [{lo}, {hi}], got {params.text_guidance_scale}"
    if params.HasField("dit_cache"):
        lo, hi = limits.DIT_CACHE_THRESHOLD_RANGE
        if not lo <= params.dit_cache.threshold <= hi:
            return f"dit_cache.threshold must be in [{lo}, {hi}], got {params.dit_cache.threshold}"
        if params.dit_cache.warmup_steps > params.num_inference_steps:
            return "dit_cache.warmup_steps must be at most num_inference_steps"
    if not 0.0 <= params.cfg_range_start <= params.cfg_range_end <= 1.0:
        return "cfg_range must satisfy 0 <= start <= end <= 1"
    fmt = (params.output_format or "png").lower()
    if fmt not in OUTPUT_FORMATS and fmt != "jpg":
        return f"output_format must be one of {', '.join(OUTPUT_FORMATS)}"
    if params.output_compression > 100:
        return "output_compression must be in [0, 100]"
    return None


class DiTServicer(pb_grpc.DiTServicer):
    """``mammoth.v1.DiT``.

    Args:
        pipeline: the model (`stage_dit.pipeline.MammothDiTPipeline`); None until loaded (then
            `set_model`), during which Generate answers UNAVAILABLE.
        pool: the `SlotPool` (its ``hidden_size`` must equal the pipeline's AR hidden size).
        condition_timeout_s: longest wait for the conditions, even within a longer deadline (a call
            without a deadline is refused with INVALID_ARGUMENT).
        progress_interval_s: at most one RECEIVING progress message per interval.
        producer_grace_s: a slot whose producer's push stream broke (without its `StreamEnd`) is
            retired this many seconds later (Generate ends with ABORTED) unless a newer epoch, an
            AR retry, began meanwhile.
        request_limits: the size and step limits enforced on every call (the DiT's settings).
        max_batch_requests: requests denoised together by the worker loop (`stage_dit.engine`);
            None = one per slot.

    Attributes:
        on_engine_failure: passed to the engine as its ``on_failure`` (`serve` sets it to turn
            health NOT_SERVING for good: a DiT whose loop died must be replaced, not probed as live).
    """

    def __init__(self, pipeline: Any = None, pool: SlotPool | None = None, *,
                 condition_timeout_s: float = 600.0, progress_interval_s: float = 0.1,
                 producer_grace_s: float = 1.0,
                 trace_dir: str | None = None, answer_boundary: str = "prompt_length",
                 profiler: StageProfiler | None = None,
                 request_limits: limits.RequestLimits = limits.DEFAULTS,
                 max_batch_requests: int | None = None):
        self.request_limits = request_limits
        self.profiler = profiler
        self.trace_dir = trace_dir
        self.answer_boundary = answer_boundary
        self.condition_timeout_s = condition_timeout_s
        self.progress_interval_s = progress_interval_s
        self.producer_grace_s = producer_grace_s
        self.max_batch_requests = max_batch_requests
        self.on_engine_failure: Any = None
        self.draining = False
        self.pipeline = self.pool = self.engine = None
        if pipeline is not None and pool is not None:
            self.set_model(pipeline, pool)

    def set_model(self, pipeline: Any, pool: SlotPool) -> None:
        """Attach the loaded pipeline and its slot pool and start the worker loop (Generate starts
        being served)."""
        batch = self.max_batch_requests or len(pool.slots)
        self.engine = DiTEngine(pipeline, max_batch_requests=batch, profiler=self.profiler,
                                on_failure=self.on_engine_failure)
        self.pool = pool
        self.pipeline = pipeline

    def close(self) -> None:
        """Stop the worker loop (after the server stopped)."""
        if self.engine is not None:
            self.engine.close()

    def start_drain(self) -> None:
        """Refuse new reservations; reserved slots finish their work."""
        self.draining = True
        if self.pool is not None:
            self.pool.close()

    async def wait_idle(self) -> None:
        """Return once no slot is reserved (every in-flight request finished)."""
        if self.pool is not None:
            await self.pool.wait_idle()

    # -- Generate --------------------------------------------------------------------------

    async def Generate(
        self, request: pb.DiTGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DiTGenerateResponse]:
        request_id_var.set(request.request_id or None)
        await self._check_generate(request, context)
        try:
            slot = await self.pool.reserve(request.request_id, request.params, timeout=0)
        except WireError as err:
            await _abort(context, err.code, err.message,
                         Reason.FULL if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED else Reason.DRAINING)
        session = GenerateSession(self, request, context, slot)
        session.span = tracing.start_span(  # None when tracing is off
            "mammoth.v1.DiT/Generate", tracing.extract(context.invocation_metadata()), kind="SERVER",
            attributes={"mammoth.request_id": request.request_id, "mammoth.slot_id": slot.slot_id})
        try:
            async for message in session.run():
                if message.HasField("image") and not message.image.partial:
                    self._image_done(session)  # trace written before the client can see the image
                yield message
        except asyncio.CancelledError:
            if session.outcome != "completed":
                session.outcome = self.waiting_outcome(slot, timed_out=_expired(context))
            raise
        except ConditionTooLongError as err:  # the request's own prompt is too long: no retry fixes it
            session.outcome = "rejected"
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err), Reason.INVALID_REQUEST, err.field)
        except ValueError as err:  # the pipeline refused these conditions (e.g. no image rows)
            session.outcome = "rejected"
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err), Reason.CONDITIONS_REJECTED)
        except (grpc.aio.AbortError, GeneratorExit):
            raise
        except Exception:
            logger.exception("request %s: DiT generation failed", request.request_id)
            session.outcome = "failed"
            await _abort(context, grpc.StatusCode.INTERNAL, "DiT generation failed", Reason.GENERATION_FAILED)
        finally:
            session.close(session.outcome)
            DIT_REQUESTS.labels(session.outcome).inc()
            tracing.end_span(session.span, error=None if session.outcome == "completed" else session.outcome)

    async def _check_generate(self, request: pb.DiTGenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Abort a call that cannot be served: no model yet, draining, a failed engine loop (before a
        slot is reserved: nothing is pushed to a replica that cannot denoise), no request id,
        parameters outside the limits, no deadline."""
        if self.pipeline is None or self.pool is None:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "model is loading", Reason.LOADING)
        if self.draining:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "DiT is draining", Reason.DRAINING)
        if self.engine is not None and self.engine.failure is not None:
            await _abort(context, grpc.StatusCode.UNAVAILABLE,
                         "the DiT engine failed; this replica takes no new work", Reason.ENGINE_FAILED)
        if problem := limits.request_id_problem(request.request_id):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem, Reason.INVALID_REQUEST)
        why = validate_params(request.params, self.request_limits)
        if why:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, why, Reason.INVALID_REQUEST)
        if context.time_remaining() is None:
            # A slot lives as long as this stream: without the caller's deadline, two bare calls
            # could hold the whole pool until condition_timeout_s.
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                         "DiT.Generate needs a deadline (the caller's request budget)", Reason.INVALID_REQUEST)

    def _image_done(self, session: GenerateSession) -> None:
        """Log, trace spans and the request trace file of a completed call."""
        params, timings = session.params, session.timings
        if session.span is not None:
            _record_model_spans(session.span, timings, time.time_ns())
        logger.info("image done: %dx%d, %d steps (%d skipped), denoise %.1f ms, vae %.1f ms, encode %.1f ms",
                    params.width, params.height, params.num_inference_steps, timings.steps_skipped,
                    timings.denoise_ms, timings.vae_ms, timings.encode_ms)
        self._write_trace(session.request.request_id, session.slot, session.conds)

    def _write_trace(self, request_id: str, slot, conds) -> None:
        """The ``dit`` request trace (`mammoth_core.request_trace`): when each chunk arrived, and the totals."""
        if not self.trace_dir:
            return
        epoch = slot.chunk_log[-1][0] if slot.chunk_log else 0
        chunks = [
            {"epoch": e, "sequence": q, "role": pb.Role.Name(r), "row_offset": o, "rows": n, "arrived_unix_ms": t}
            for e, q, r, o, n, t in slot.chunk_log
            if e == epoch
        ]
        write_request_trace(self.trace_dir, "dit", request_id, epoch, {
            "condition_rows": int(conds.hidden.shape[0]),
            "negative_rows": 0 if conds.negative is None else int(conds.negative.shape[0]),
            # the transfer tail's phases: AR framed the last chunk -> DiT handler got it -> resident
            "last_sent_unix_ms": slot.timings.last_sent_unix_ms,
            "last_received_unix_ms": slot.timings.last_received_unix_ms,
            "resident_unix_ms": slot.timings.resident_unix_ms,
            "chunks": chunks,
        })

    def producer_gone(self, slot, now: float) -> bool:
        """The slot's producer stream broke ``producer_grace_s`` ago and no newer epoch began."""
        lost_at = slot.producer_lost_at
        return slot.producer_lost and lost_at is not None and now - lost_at >= self.producer_grace_s

    @staticmethod
    def waiting_outcome(slot, timed_out: bool) -> str:
        """The slot outcome of a call that ended before its image (`transport_metrics.SLOT_OUTCOMES`)."""
        if slot.complete:
            return "deadline" if timed_out else "cancelled"
        if slot.last_rejection is not None:
            return "rejected"
        if slot.producer_lost:
            return "producer_lost"
        return "deadline" if timed_out else "cancelled"

    # -- PushConditions --------------------------------------------------------------------

    async def PushConditions(
        self, request_iterator: AsyncIterator[pb.HiddenStateChunk], context: grpc.aio.ServicerContext
    ) -> pb.PushConditionsResponse:
        if self.pool is None:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "model is loading", Reason.LOADING)
        return await receive_push(self.pool, request_iterator, context)


def _record_model_spans(span, timings: pb.DiTTimings, end_ns: int) -> None:
    """``dit.denoise``, ``dit.vae``, ``dit.encode`` children of ``span``, laid back to back from the
    worker's durations and ending at ``end_ns`` (Unix epoch ns, read when the worker returned)."""
    encode_start = end_ns - int(timings.encode_ms * 1e6)
    vae_start = encode_start - int(timings.vae_ms * 1e6)
    denoise_start = vae_start - int(timings.denoise_ms * 1e6)
    tracing.record_span("dit.denoise", span, denoise_start, vae_start)
    tracing.record_span("dit.vae", span, vae_start, encode_start)
    tracing.record_span("dit.encode", span, encode_start, end_ns)


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str,
                 reason: Reason, field: str | None = None) -> None:
    """Abort with this stage (DiT) as the error's origin (`mammoth_core.errors`), naming ``field``."""
    await errors.abort(context, code, message, stage=errors.Stage.DIT, reason=reason, field=field)


def _expired(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0.05


async def serve(settings: DiTSettings, *, ready_file: str | None = None, pipeline: Any = None) -> None:
    """Run the DiT stage until SIGTERM/SIGINT has drained it.

    Order: metrics server and gRPC server (health NOT_SERVING) start first, so probes answer while
    the model loads; then the pipeline loads (``stage_dit.loader.load_pipeline`` unless given),
    the slot pool is allocated and health turns SERVING; the ready file (JSON ``address``, ``port``,
    ``metrics_port``) is written last. On SIGTERM: NOT_SERVING, no new reservations, in-flight
    requests get ``drain_grace_seconds``, then the function returns.
    """
    tracing.setup("dit", settings.trace_export, settings.trace_sample_ratio)
    token, role_tokens = settings.read_auth_token(), settings.read_role_tokens()
    profiler = StageProfiler(settings.profile_dir or str(pathlib.Path(settings.cache_dir) / "profiles"),
                             "dit", settings.profile_requests)
    admin_auth = grpc_common.StageAuth(token, role_tokens=role_tokens, insecure=settings.insecure_no_auth)
    transport_metrics.export("receive")  # this stage's side of the transport series only
    metrics_port = start_metrics_server(settings.metrics_port, settings.host,
                                        routes={PROFILE_PATH: guarded(profiler.wsgi, admin_auth)})
    rpcs = drain.InFlightRpcs()
    server = grpc_common.create_server(
        settings.max_message_bytes, token, interceptors=[rpcs], role_tokens=role_tokens,
        insecure=settings.insecure_no_auth,
    )
    servicer = DiTServicer(trace_dir=settings.trace_dir, answer_boundary=settings.answer_boundary,
                           profiler=profiler, producer_grace_s=settings.producer_grace_seconds,
                           request_limits=limits.from_settings(settings))
    add_dit_servicer(servicer, server)
    health = grpc_common.HealthReporter(server, [SERVICE_NAME])
    port = grpc_common.add_port(server, settings.host, settings.port, settings.grpc_server_credentials())
    await server.start()
    drained = drain.install_drain_handler(
        server, health, settings.drain_grace_seconds, on_drain=servicer.start_drain,
        wait_idle=servicer.wait_idle, in_flight=rpcs,
    )
    parallel = None
    async with starting(server, "DiT"):
        if pipeline is None and settings.parallel_ranks() > 1:  # ranks 1..N-1 start here, from the main thread
            from stage_dit.parallel_stage import ParallelDiT

            parallel = ParallelDiT.start(settings)
            await asyncio.to_thread(parallel.join)
            pipeline = await asyncio.to_thread(parallel.load)
            await asyncio.to_thread(parallel.ready)
        elif pipeline is None:
            from stage_dit.loader import load_pipeline

            pipeline = await asyncio.to_thread(load_pipeline, settings)
        hidden_size = int(getattr(pipeline, "llm_hidden_size", 0) or getattr(pipeline, "hidden_size"))
        dtype = getattr(pipeline, "dtype", None) or settings.resolved_dtype()
        capacity = await asyncio.to_thread(
            measure_capacity, pipeline, slots=settings.slots, max_batch=settings.max_batch_requests,
            slot_bytes=settings.max_rows_per_slot * hidden_size * dtype.itemsize, max_pixels=settings.max_pixels,
            utilization=settings.gpu_memory_utilization)
        capacity.export()
        pool = SlotPool(capacity.slots, settings.max_rows_per_slot, hidden_size, dtype, settings.resolved_device())
    servicer.max_batch_requests = capacity.max_batch_requests
    servicer.on_engine_failure = health.on_fatal_error(asyncio.get_running_loop())
    servicer.set_model(pipeline, pool)
    await health.set_serving()
    address = format_address(settings.host, port)
    logger.info("DiT serving on %s (slots=%d, batch=%d, hidden=%d, metrics port %s)",
                address, capacity.slots, capacity.max_batch_requests, hidden_size, metrics_port)
    write_ready_file(ready_file, address, port=port, metrics_port=metrics_port)
    await drained.wait()
    await server.wait_for_termination()
    servicer.close()
    if parallel is not None:
        await asyncio.to_thread(parallel.stop)
    tracing.shutdown()
