"""The DiT stage's gRPC server: the ``mammoth.v1.DiT`` servicer, health, metrics and drain.

``Generate`` (gateway -> DiT, server stream): validate the image parameters (the request limits
of `mammoth_core.limits`, as the gateway does), reserve a slot (fail fast with RESOURCE_EXHAUSTED
when the pool is full), answer `Reserved`, stream RECEIVING progress while the AR pushes the
conditions, send `ConditionsComplete` the moment they are resident (no AR is needed after it),
run the pipeline in a worker thread (never on the event loop) with one DENOISING progress
message per step, then DECODING, then the final `Image`. The slot
lives exactly as long as this stream: it is released in ``finally`` (after the worker thread has
stopped reading it), so closing or cancelling the stream makes any further push fail.

``PushConditions`` (AR -> DiT, client stream) is the transport's `stage_dit.receiver.receive_push`:
every chunk goes through `Slot.accept` (the rules of `stage_dit.chunk_validator`); a violation aborts
the call with the rule's status; the stream is acknowledged only when the conditions are resident
on the device.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

import grpc

from mammoth_core import drain, grpc_common, limits, tracing
from mammoth_core.logging import request_id_var
from mammoth_core.profiling import PROFILE_PATH, StageProfiler, guarded
from mammoth_core.request_trace import write_request_trace
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc
from mammoth_core.runtime import start_metrics_server, write_ready_file
from mammoth_core.settings import DiTSettings
from mammoth_core.wire import WireError
from stage_dit.conditions import compute_answer_start_index
from stage_dit.metrics import DIT_DENOISE, DIT_ENCODE, DIT_REQUESTS, DIT_STEP, DIT_STEPS, DIT_VAE
from stage_dit.receiver import SlotPool, add_dit_servicer, receive_push

logger = logging.getLogger(__name__)

SERVICE_NAME = "mammoth.v1.DiT"
OUTPUT_FORMATS = ("png", "jpeg", "webp")



class _StopRequested(Exception):
    """Raised inside the pipeline callback when the Generate stream went away."""


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
        pipeline: the model (`stage_dit.pipeline.MammothDiTPipeline` or anything with its
            ``prepare_conditions``/``generate`` methods and a ``dtype``); None until loaded
            (then `set_model`), during which Generate answers UNAVAILABLE.
        pool: the `SlotPool` (its ``hidden_size`` must equal the pipeline's AR hidden size).
        condition_timeout_s: longest wait for the conditions, even within a longer deadline (a call
            without a deadline is refused with INVALID_ARGUMENT).
        progress_interval_s: at most one RECEIVING progress message per interval.
        producer_grace_s: a slot whose producer's push stream broke (without its `StreamEnd`) is
            retired this many seconds later (Generate ends with ABORTED) unless a newer epoch, an
            AR retry, began meanwhile.
        request_limits: the size and step limits enforced on every call (the DiT's settings).
    """

    def __init__(self, pipeline: Any = None, pool: SlotPool | None = None, *,
                 condition_timeout_s: float = 600.0, progress_interval_s: float = 0.1,
                 producer_grace_s: float = 1.0,
                 trace_dir: str | None = None, answer_boundary: str = "prompt_length",
                 profiler: StageProfiler | None = None,
                 request_limits: limits.RequestLimits = limits.DEFAULTS):
        self.pipeline = pipeline
        self.request_limits = request_limits
        self.profiler = profiler
        self.trace_dir = trace_dir
        self.answer_boundary = answer_boundary
        self.pool = pool
        self.condition_timeout_s = condition_timeout_s
        self.progress_interval_s = progress_interval_s
        self.producer_grace_s = producer_grace_s
        self.draining = False
        self._workers = len(pool.slots) if pool is not None else 4
        self._executor = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="dit-pipeline")
        self._image_encoder = None

    def set_model(self, pipeline: Any, pool: SlotPool) -> None:
        """Attach the loaded pipeline and its slot pool (Generate starts being served)."""
        self.pool = pool
        self.pipeline = pipeline
        if len(pool.slots) > self._workers:  # one pipeline thread per slot
            idle, self._workers = self._executor, len(pool.slots)
            self._executor = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="dit-pipeline")
            idle.shutdown(wait=False)

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
        if self.pipeline is None or self.pool is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is loading")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "DiT is draining")
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        why = validate_params(request.params, self.request_limits)
        if why:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if context.time_remaining() is None:
            # A slot lives as long as this stream: without the caller's deadline, two bare calls
            # could hold the whole pool until condition_timeout_s.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "DiT.Generate needs a deadline (the caller's request budget)")
        try:
            slot = await self.pool.reserve(request.request_id, request.params, timeout=0)
        except WireError as err:
            await context.abort(err.code, err.message)

        outcome = "consumer_lost"
        worker: asyncio.Future | None = None
        stop = threading.Event()
        span = tracing.start_span(  # None when tracing is off
            "mammoth.v1.DiT/Generate", tracing.extract(context.invocation_metadata()), kind="SERVER",
            attributes={"mammoth.request_id": request.request_id, "mammoth.slot_id": slot.slot_id})
        try:
            yield pb.DiTGenerateResponse(
                reserved=pb.Reserved(reservation_token=slot.token, slot_id=slot.slot_id)
            )
            # 1. Conditions arrive (RECEIVING progress), within the caller's deadline.
            budget = min(context.time_remaining() or 0.0, self.condition_timeout_s)
            wait_until = time.monotonic() + budget
            last_rows, last_sent = -1, 0.0
            while not slot.complete:
                rows = slot.rows_received(pb.CONDITION) + slot.rows_received(pb.NEGATIVE)
                now = time.monotonic()
                if rows != last_rows and now - last_sent >= self.progress_interval_s:
                    yield pb.DiTGenerateResponse(progress=pb.DiTProgress(
                        phase=pb.DiTProgress.RECEIVING, rows_received=rows))
                    last_rows, last_sent = rows, now
                if now >= wait_until:
                    outcome = self._waiting_outcome(slot, timed_out=True)
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"conditions incomplete after {budget:.1f} s ({outcome})",
                    )
                if self._producer_gone(slot, now):
                    outcome = "producer_lost"
                    await context.abort(
                        grpc.StatusCode.ABORTED,
                        f"the producer's stream broke and no retry began within "
                        f"{self.producer_grace_s:.1f} s",
                    )
                await slot.wait_changed(min(wait_until - now, self.progress_interval_s))
            conds = slot.conditions()
            # The gateway learns here, not from later progress, that no AR is needed any more.
            yield pb.DiTGenerateResponse(conditions_complete=pb.ConditionsComplete(
                epoch=slot.epoch or 0, condition_rows=conds.hidden.shape[0],
                negative_rows=0 if conds.negative is None else conds.negative.shape[0]))
            if span is not None and slot.timings.first_chunk_at and slot.timings.resident_at:
                tracing.record_span("dit.receive", span,
                                    tracing.monotonic_to_unix_ns(slot.timings.first_chunk_at),
                                    tracing.monotonic_to_unix_ns(slot.timings.resident_at))
            yield pb.DiTGenerateResponse(progress=pb.DiTProgress(
                phase=pb.DiTProgress.RECEIVING,
                rows_received=conds.hidden.shape[0] + (0 if conds.negative is None else conds.negative.shape[0]),
            ))

            # 2. The pipeline runs in a worker thread; steps come back through a queue.
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            params = request.params
            worker = loop.run_in_executor(
                self._executor, self._run_profiled, request.request_id, conds, params, stop,
                lambda *item: loop.call_soon_threadsafe(events.put_nowait, item),
            )
            total = params.num_inference_steps
            while True:
                kind, *rest = await events.get()
                if kind == "step":
                    step, total = rest
                    yield pb.DiTGenerateResponse(progress=pb.DiTProgress(
                        phase=pb.DiTProgress.DENOISING, step=step, total_steps=total))
                    if step == total:
                        yield pb.DiTGenerateResponse(progress=pb.DiTProgress(
                            phase=pb.DiTProgress.DECODING, step=step, total_steps=total))
                elif kind == "partial":
                    index, data = rest
                    yield pb.DiTGenerateResponse(image=pb.Image(
                        data=data, format=_output_format(params), width=params.width, height=params.height,
                        partial=True, partial_index=index))
                elif kind == "done":
                    break
            data, fmt, timings = await worker
            if span is not None:
                _record_model_spans(span, timings, time.time_ns())
            logger.info("image done: %dx%d, %d steps, denoise %.1f ms, vae %.1f ms, encode %.1f ms",
                        params.width, params.height, params.num_inference_steps, timings.denoise_ms,
                        timings.vae_ms, timings.encode_ms)
            t = slot.timings
            timings.queue_ms = 1000.0 * ((t.first_chunk_at or t.reserved_at) - t.reserved_at)
            timings.receive_ms = 1000.0 * ((t.last_chunk_at or 0.0) - (t.first_chunk_at or 0.0))
            if t.last_sent_unix_ms and t.resident_unix_ms:
                timings.transfer_tail_ms = max(0.0, t.resident_unix_ms - t.last_sent_unix_ms)
            outcome = "completed"
            self._write_trace(request.request_id, slot, conds)
            yield pb.DiTGenerateResponse(image=pb.Image(
                data=data, format=fmt, width=params.width, height=params.height, timings=timings,
                condition_rows=conds.hidden.shape[0],
                negative_rows=0 if conds.negative is None else conds.negative.shape[0],
            ))
        except asyncio.CancelledError:
            outcome = self._waiting_outcome(slot, timed_out=_expired(context))
            raise
        except ValueError as err:  # the pipeline refused these conditions (e.g. no image rows)
            outcome = "rejected"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except (grpc.aio.AbortError, GeneratorExit):
            raise
        except Exception:
            logger.exception("request %s: DiT generation failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, "DiT generation failed")
        finally:
            if worker is not None and not worker.done():
                # The worker still reads the slot: stop it and release once it has returned.
                stop.set()
                final = outcome

                def _release_after_worker(f: asyncio.Future) -> None:
                    if not f.cancelled():
                        f.exception()  # retrieved: _StopRequested or a late failure, not logged
                    slot.release(final)

                worker.add_done_callback(_release_after_worker)
            else:
                slot.release(outcome)
            DIT_REQUESTS.labels(outcome).inc()
            tracing.end_span(span, error=None if outcome == "completed" else outcome)

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

    def _producer_gone(self, slot, now: float) -> bool:
        """The slot's producer stream broke ``producer_grace_s`` ago and no newer epoch began."""
        lost_at = slot.producer_lost_at
        return slot.producer_lost and lost_at is not None and now - lost_at >= self.producer_grace_s

    @staticmethod
    def _waiting_outcome(slot, timed_out: bool) -> str:
        if slot.complete:
            return "deadline" if timed_out else "cancelled"
        if slot.last_rejection is not None:
            return "rejected"
        if slot.producer_lost:
            return "producer_lost"
        return "deadline" if timed_out else "cancelled"

    def _run_profiled(self, request_id: str, *args) -> tuple:
        """`_run_pipeline`, inside a profiler when one is armed (`mammoth_core.profiling`)."""
        if self.profiler is None:
            return self._run_pipeline(*args)
        with self.profiler.capture(request_id):
            return self._run_pipeline(*args)

    def _run_pipeline(self, conds, params: pb.ImageParams, stop: threading.Event, post) -> tuple:
        """Worker thread: conditions -> image bytes. Posts ("step", i, n) per step, then ("done",)."""
        try:
            t0 = time.perf_counter()  # dit_denoise: condition preparation + the steps
            pipe = self.pipeline
            dtype = getattr(pipe, "dtype", conds.hidden.dtype)
            # The AR sends the prompt length as answer_start_index and names the boundary rule.
            rule = conds.metadata.answer_boundary or self.answer_boundary
            answer_start = compute_answer_start_index(
                int(conds.metadata.answer_start_index), int(conds.hidden.shape[0]), rule
            )
            condition = pipe.prepare_conditions(conds.hidden.to(dtype), conds.token_ids, answer_start)
            negative = None if conds.negative is None else conds.negative.to(dtype)
            marks = {"last_step": time.perf_counter()}
            previews = preview_steps(params.partial_images, params.num_inference_steps)

            def on_step(step_index: int, total_steps: int, latents) -> None:
                if stop.is_set():
                    raise _StopRequested()
                now = time.perf_counter()
                DIT_STEP.observe(now - marks["last_step"])
                DIT_STEPS.inc()
                post("step", step_index + 1, total_steps)
                if step_index + 1 in previews:
                    # A real preview: the current latents decoded by the VAE, like the final image.
                    preview = pipe.decode_latents(latents)
                    post("partial", previews[step_index + 1],
                         self._encode(preview, _output_format(params), params.output_compression))
                marks["last_step"] = time.perf_counter()

            image = pipe.generate(
                condition, negative, width=params.width, height=params.height,
                num_inference_steps=params.num_inference_steps,
                text_guidance_scale=params.text_guidance_scale,
                cfg_range=(params.cfg_range_start, params.cfg_range_end),
                seed=params.seed, callback=on_step,
            )
            t1 = time.perf_counter()
            fmt = (params.output_format or "png").lower()
            fmt = "jpeg" if fmt == "jpg" else fmt
            data = self._encode(image, fmt, params.output_compression)
            t2 = time.perf_counter()
            timings = pb.DiTTimings(
                denoise_ms=1000.0 * (marks["last_step"] - t0), vae_ms=1000.0 * (t1 - marks["last_step"]),
                encode_ms=1000.0 * (t2 - t1),
            )
            DIT_DENOISE.observe(marks["last_step"] - t0)
            DIT_VAE.observe(t1 - marks["last_step"])
            DIT_ENCODE.observe(t2 - t1)
            return data, fmt, timings
        finally:
            post("done")

    def _encode(self, image, fmt: str, compression: int) -> bytes:
        if self._image_encoder is None:
            from stage_dit.images import encode_image

            self._image_encoder = encode_image
        return self._image_encoder(image, fmt, compression)

    # -- PushConditions --------------------------------------------------------------------

    async def PushConditions(
        self, request_iterator: AsyncIterator[pb.HiddenStateChunk], context: grpc.aio.ServicerContext
    ) -> pb.PushConditionsResponse:
        if self.pool is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is loading")
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


def preview_steps(partial_images: int, num_steps: int) -> dict[int, int]:
    """``{step (1-based): preview index}`` for ``partial_images`` previews spread evenly over the
    steps, never on the last one (the final image follows it): e.g. 2 of 8 -> steps 3 and 5."""
    count = max(0, min(int(partial_images), num_steps - 1))
    return {round((i + 1) * num_steps / (count + 1)): i for i in range(count)}


def _output_format(params: pb.ImageParams) -> str:
    fmt = (params.output_format or "png").lower()
    return "jpeg" if fmt == "jpg" else fmt


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
    port = grpc_common.add_port(server, f"{settings.host}:{settings.port}", settings.grpc_server_credentials())
    await server.start()
    drained = drain.install_drain_handler(
        server, health, settings.drain_grace_seconds, on_drain=servicer.start_drain,
        wait_idle=servicer.wait_idle, in_flight=rpcs,
    )
    if pipeline is None:
        from stage_dit.loader import load_pipeline

        pipeline = await asyncio.to_thread(load_pipeline, settings)
    hidden_size = int(getattr(pipeline, "llm_hidden_size", 0) or getattr(pipeline, "hidden_size"))
    pool = SlotPool(
        settings.slots, settings.max_rows_per_slot, hidden_size,
        getattr(pipeline, "dtype", None) or settings.resolved_dtype(), settings.resolved_device(),
    )
    servicer.set_model(pipeline, pool)
    await health.set_serving()
    address = f"{settings.host}:{port}"
    logger.info("DiT serving on %s (slots=%d, hidden=%d, metrics port %s)",
                address, settings.slots, hidden_size, metrics_port)
    write_ready_file(ready_file, address, port=port, metrics_port=metrics_port)
    await drained.wait()
    await server.wait_for_termination()
    tracing.shutdown()
