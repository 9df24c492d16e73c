"""The AR stage's gRPC server: ``mammoth.v1.AR/Generate``.

One ``Generate`` call = one request attempt ``(request_id, epoch)``: the servicer tokenises the
prompt into the text-to-image envelope, admits a `DecodeJob` into the `DecodeEngine` (answering
``RESOURCE_EXHAUSTED`` when ``max_running_sequences`` are running), and drives the request's
`HiddenStateSender` — the ``DiT.PushConditions`` client stream to the DiT that holds the slot — on
the event loop while the engine thread decodes. It streams ``ARProgress`` events back and ends with
``ARDone``.

Cancellation runs downward: when the gateway cancels this call (client gone, deadline), or the push
to the DiT fails (slot released, DiT gone), the job is cancelled before its next decode step, its
KV cache is freed, and the push stream is closed. Nothing about a request outlives its call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import time
from typing import Any, AsyncIterator

import grpc
from prometheus_client import Counter, Gauge, Histogram

from mammoth_core import drain, grpc_common, limits, tracing
from mammoth_core.logging import request_id_var
from mammoth_core.refusals import refusal_of, refusal_trailers
from mammoth_core.runtime import start_metrics_server, write_ready_file
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc
from mammoth_core.settings import ARSettings
from mammoth_core.text import is_blank
from stage_ar.dit_targets import DiTAllowList, DiTChannels
from stage_ar.engine import (
    DecodeEngine, DecodeJob, EngineDeadlineExceeded, EngineFull, EngineStopped, JobStats, Role,
)
from stage_ar.loader import ARBundle, load_ar
from stage_ar.sender import HiddenStateSender

logger = logging.getLogger(__name__)

SERVICE_NAME = "mammoth.v1.AR"
GRID_PIXELS = limits.GRID_PIXELS  # the default (auto) grid: width // 16 x height // 16
MAX_PROMPT_CHARS = 16_384

AR_REQUESTS = Counter("mammoth_ar_requests_total", "AR Generate calls by outcome", ["outcome"])
AR_RUNNING = Gauge("mammoth_ar_running_sequences", "sequences admitted to the decode engine")
AR_TOKENS = Counter("mammoth_ar_generated_tokens_total", "grid tokens decoded")
AR_PREFILL = Histogram(
    "mammoth_ar_prefill_seconds", "prefill time per request",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
)
AR_DECODE = Histogram(
    "mammoth_ar_decode_seconds", "decode time per request",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
AR_TOKENS_PER_SECOND = Histogram(
    "mammoth_ar_decode_tokens_per_second", "grid tokens decoded per second of decode, per request",
    buckets=(10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400),
)


PB_ROLES = {Role.CONDITION: pb.CONDITION, Role.NEGATIVE: pb.NEGATIVE}


class ProtoRoleSink:
    """The engine's `stage_ar.engine.RowSink` over a `HiddenStateSender`: engine roles become the
    ``mammoth.v1`` roles here, the one place they meet."""

    def __init__(self, sender: HiddenStateSender) -> None:
        self.sender = sender

    def put_rows(self, role: Role, hidden: Any, token_ids: list[int]) -> None:
        self.sender.put_rows(PB_ROLES[role], hidden, token_ids)

    def finish(self) -> None:
        self.sender.finish()

    def abort(self) -> None:
        self.sender.abort()


class ARServicer(pb_grpc.ARServicer):
    """``mammoth.v1.AR`` servicer.

    Args:
        bundle: the loaded model, tokenizer and generation config.
        engine: the running `DecodeEngine`.
        settings: the stage's `ARSettings` (chunk rows, message limit, auth token, boundary rule).
        auth_token: stage token presented to the DiT on ``PushConditions`` (None: no auth).
    """

    def __init__(
        self, bundle: ARBundle | None, engine: DecodeEngine | None, settings: ARSettings, auth_token: str | None
    ):
        self.bundle = bundle  # None while the model loads: calls are answered UNAVAILABLE
        self.engine = engine
        self.settings = settings
        self._metadata = grpc_common.auth_metadata(auth_token)
        self.allowed_dits = DiTAllowList(settings.dit_allow_list)
        # The sender's fast path writes pre-framed messages on the channel itself, so it is given
        # the channel rather than a stub.
        self._channels = DiTChannels(self._open_channel, settings.max_dit_channels)

    def _open_channel(self, address: str) -> grpc.aio.Channel:
        return grpc_common.create_channel(
            address, self.settings.max_message_bytes, self.settings.grpc_channel_credentials(),
            self.settings.tls_server_name,
        )

    async def close(self) -> None:
        """Close the cached channels to DiTs."""
        await self._channels.close()

    async def _check_dit_address(self, address: str, context: grpc.aio.ServicerContext) -> None:
        """Abort unless ``address`` is a DiT this AR may dial (`DiTAllowList`), before any work."""
        try:
            why = await self.allowed_dits.check(address)
        except ValueError as exc:
            AR_REQUESTS.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if why is not None:
            AR_REQUESTS.labels("refused_dit").inc()
            logger.warning("refused dit_address %r: %s", address, why)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    def _write_trace(self, request: pb.ARGenerateRequest, job: DecodeJob, stats: JobStats) -> None:
        """``<trace_dir>/<request_id>.e<epoch>.ar.json``: when each row left the decode loop."""
        if not self.settings.trace_dir or job.row_times is None:
            return
        path = pathlib.Path(self.settings.trace_dir) / f"{request.request_id}.e{request.epoch}.ar.json"
        path.write_text(
            json.dumps(
                {
                    "request_id": request.request_id,
                    "epoch": request.epoch,
                    "prompt_tokens": stats.prompt_tokens,
                    "generated_tokens": stats.generated_tokens,
                    "rows": job.row_times,
                }
            )
        )

    # -- validation ---------------------------------------------------------------------------

    @staticmethod
    def _validate(request: pb.ARGenerateRequest) -> str | None:
        """A message naming what is wrong with ``request``, or None."""
        if not request.request_id:
            return "request_id is required"
        if is_blank(request.prompt):
            return "prompt is blank (it has no visible character)"
        if len(request.prompt) > MAX_PROMPT_CHARS or len(request.negative_prompt) > MAX_PROMPT_CHARS:
            return f"prompt longer than {MAX_PROMPT_CHARS} characters"
        for name in ("width", "height"):
            value = getattr(request, name)
            if value < GRID_PIXELS or value % GRID_PIXELS:
                return f"{name} must be a positive multiple of {GRID_PIXELS}, got {value}"
        if bool(request.grid_width) != bool(request.grid_height):
            return "grid_width and grid_height go together (both 0: width // 16 x height // 16)"
        if not request.dit_address:
            return "dit_address is required"
        if not request.reservation_token:
            return "reservation_token is required"
        s = request.sampling
        if s.temperature < 0 or s.top_p < 0 or s.top_p > 1:
            return "sampling: temperature must be >= 0 and top_p in [0, 1]"
        return None

    # -- RPC ------------------------------------------------------------------------------------

    async def Generate(
        self, request: pb.ARGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ARGenerateResponse]:
        request_id_var.set(f"{request.request_id}/{request.epoch}")
        if self.bundle is None or self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the AR model is still loading")
        problem = self._validate(request)
        if problem:
            AR_REQUESTS.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        await self._check_dit_address(request.dit_address, context)
        tok = self.bundle.tokenizer
        ar_w, ar_h = _grid(request)
        prompt_ids = tok.encode_t2i_prompt(request.prompt, ar_w, ar_h)
        negative_ids = tok.encode_negative_prompt(request.negative_prompt) if request.negative_prompt else None
        total_rows = len(prompt_ids) + ar_h * (ar_w + 1)
        max_pos = min(self.bundle.model.config.max_position_embeddings, self.engine.max_sequence_length)
        if total_rows > max_pos:
            AR_REQUESTS.labels("invalid").inc()
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{request.width}x{request.height} with a {ar_w}x{ar_h} grid needs {total_rows} positions; "
                f"the model has {max_pos}",
            )
        remaining = context.time_remaining()
        # tracing (no-ops when off): this call's span, and the push stream's span as the DiT's parent
        server_span = tracing.start_span(
            "mammoth.v1.AR/Generate", tracing.extract(context.invocation_metadata()), kind="SERVER",
            attributes={"mammoth.request_id": request.request_id, "mammoth.epoch": request.epoch})
        push_span = tracing.start_span("mammoth.v1.DiT/PushConditions", tracing.context_of(server_span),
                                       kind="CLIENT", attributes={"server.address": request.dit_address})
        sender = HiddenStateSender(
            self._channels.acquire(request.dit_address),
            request_id=request.request_id,
            epoch=request.epoch,
            reservation_token=request.reservation_token,
            hidden_size=self.bundle.hidden_size,
            dtype=self.bundle.dtype,
            answer_start_index=len(prompt_ids),
            answer_boundary=self.settings.answer_boundary,
            expected_rows=total_rows,
            expected_negative_rows=len(negative_ids) if negative_ids else 0,
            chunk_rows=self.settings.chunk_rows,
            max_message_bytes=self.settings.max_message_bytes,
            metadata=tracing.inject(self._metadata, tracing.context_of(push_span)),
            timeout=remaining,
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def on_progress(sampled: int, total: int) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("progress", (sampled, total)))

        def on_done(exc: BaseException | None, stats: JobStats) -> None:
            # Engine thread, after the job left the engine: the gauge is exact here.
            AR_RUNNING.set(self.engine.running)
            loop.call_soon_threadsafe(events.put_nowait, ("done", (exc, stats)))

        s = request.sampling
        job = DecodeJob(
            request_id=request.request_id,
            epoch=request.epoch,
            prompt_ids=prompt_ids,
            negative_ids=negative_ids,
            ar_width=ar_w,
            ar_height=ar_h,
            seed=request.seed,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            ar_guidance_scale=request.ar_guidance_scale,
            sink=ProtoRoleSink(sender),
            on_progress=on_progress,
            on_done=on_done,
            deadline=None if remaining is None else time.monotonic() + remaining,
            row_times=[] if self.settings.trace_dir else None,
        )
        try:
            self.engine.submit(job)
        except EngineFull as exc:
            AR_REQUESTS.labels("rejected_full").inc()
            self._channels.release(request.dit_address)
            _end_spans((push_span, server_span), "rejected_full")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineStopped as exc:
            AR_REQUESTS.labels("rejected_draining").inc()
            self._channels.release(request.dit_address)
            _end_spans((push_span, server_span), "rejected_draining")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        AR_RUNNING.set(self.engine.running)
        send_task = asyncio.create_task(sender.run(), name=f"push-{request.request_id}")
        send_task.add_done_callback(lambda t: events.put_nowait(("sent", None)))
        if push_span is not None:
            send_task.add_done_callback(lambda t: _end_spans(
                (push_span,), None if not t.cancelled() and t.exception() is None else "push failed"))
        stats: JobStats | None = None
        outcome = "cancelled"
        rows_total = total_rows + (len(negative_ids) if negative_ids else 0)
        try:
            decode_error: BaseException | None = None
            decoded = False
            while not (decoded and send_task.done()):
                kind, value = await events.get()
                if kind == "progress":
                    sampled, total = value
                    yield pb.ARGenerateResponse(
                        progress=pb.ARProgress(
                            prompt_tokens=len(prompt_ids),
                            tokens_generated=sampled,
                            total_tokens=total,
                            rows_sent=sender.rows_sent[pb.CONDITION],
                        )
                    )
                elif kind == "done":
                    decoded = True
                    decode_error, stats = value
                    if decode_error is not None:
                        break
                elif kind == "sent" and send_task.done() and not decoded:
                    # The push ended before decoding finished: the DiT refused or went away.
                    break
            if isinstance(decode_error, EngineDeadlineExceeded):
                outcome = "deadline"
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(decode_error))
            if decode_error is not None:
                outcome = "failed"
                logger.error("decode failed: %s", decode_error)
                await context.abort(grpc.StatusCode.INTERNAL, f"AR decode failed: {decode_error}")
            if send_task.done() and send_task.exception() is not None:
                exc = send_task.exception()
                outcome = "push_failed"
                code, details = _push_status(exc)
                logger.warning("push to %s failed: %s %s", request.dit_address, code.name, details)
                await context.abort(code, f"pushing hidden states to the DiT failed: {details}",
                                    trailing_metadata=refusal_trailers(refusal_of(exc)))
            if not decoded:
                outcome = "push_failed"
                await context.abort(grpc.StatusCode.ABORTED, "the DiT closed the condition stream early")
            result = send_task.result()
            stats = stats or JobStats()
            AR_TOKENS.inc(stats.generated_tokens)
            AR_PREFILL.observe(stats.prefill_ms / 1e3)
            AR_DECODE.observe(stats.decode_ms / 1e3)
            if stats.decode_ms > 0:
                AR_TOKENS_PER_SECOND.observe(stats.generated_tokens / (stats.decode_ms / 1e3))
            outcome = "ok"
            logger.info("done: %d prompt + %d grid tokens, prefill %.1f ms, decode %.1f ms",
                        stats.prompt_tokens, stats.generated_tokens, stats.prefill_ms, stats.decode_ms)
            self._write_trace(request, job, stats)
            yield pb.ARGenerateResponse(
                done=pb.ARDone(
                    prompt_tokens=stats.prompt_tokens,
                    generated_tokens=stats.generated_tokens,
                    rows_sent=getattr(result, "rows_accepted", 0) + getattr(result, "negative_rows_accepted", 0)
                    or rows_total,
                    prefill_ms=stats.prefill_ms,
                    decode_ms=stats.decode_ms,
                    last_row_unix_ms=stats.last_row_unix_ms,
                )
            )
        finally:
            job.cancel()
            if not send_task.done():
                sender.abort()
                send_task.cancel()
            # The push's own error (if any) was reported above or is moot now: retrieve it so
            # asyncio does not log "Task exception was never retrieved".
            send_task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._channels.release(request.dit_address)
            AR_REQUESTS.labels(outcome).inc()
            AR_RUNNING.set(self.engine.running)
            if server_span is not None:
                _record_engine_spans(server_span, stats)
                _end_spans((server_span,), None if outcome == "ok" else outcome)


def _grid(request: pb.ARGenerateRequest) -> tuple[int, int]:
    """The AR grid in cells: ``grid_width x grid_height``, or ``width // 16 x height // 16`` when
    they are 0 (an older gateway)."""
    if request.grid_width:
        return request.grid_width, request.grid_height
    return request.width // GRID_PIXELS, request.height // GRID_PIXELS


def _end_spans(spans, error: str | None) -> None:
    """End tracing spans (None entries skipped), marked failed with ``error`` when given."""
    for span in spans:
        tracing.end_span(span, error=error)


def _record_engine_spans(server_span, stats: JobStats | None) -> None:
    """``ar.prefill`` and ``ar.decode`` spans from the engine's clock: decode ends at the last row
    sent (``last_row_unix_ms``) and lasts ``decode_ms``; prefill ends where decode starts."""
    if stats is None or not stats.last_row_unix_ms:
        return
    decode_end = int(stats.last_row_unix_ms * 1e6)
    decode_start = decode_end - int(stats.decode_ms * 1e6)
    prefill_start = decode_start - int(stats.prefill_ms * 1e6)
    tracing.record_span("ar.prefill", server_span, prefill_start, decode_start,
                        {"mammoth.prompt_tokens": stats.prompt_tokens})
    tracing.record_span("ar.decode", server_span, decode_start, decode_end,
                        {"mammoth.generated_tokens": stats.generated_tokens})


def _push_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status code and details for a failed push (the DiT's own status when it answered one)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            # ABORTED, not UNAVAILABLE: the gateway reads UNAVAILABLE as "this AR is down" and
            # takes a healthy AR out of rotation when only the DiT went away.
            return grpc.StatusCode.ABORTED, f"DiT unavailable: {exc.details()}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return grpc.StatusCode.DEADLINE_EXCEEDED, exc.details() or "deadline exceeded"
        return grpc.StatusCode.ABORTED, f"{code.name}: {exc.details()}"
    code = getattr(exc, "code", None)
    if isinstance(code, grpc.StatusCode):
        return grpc.StatusCode.ABORTED, f"{code.name}: {exc}"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def serve(settings: ARSettings, ready_file: str | None = None) -> None:
    """Run the AR stage until SIGTERM/SIGINT, then drain.

    The gRPC port opens first with health NOT_SERVING (so probes see the process while the model
    loads); the model loads in a worker thread; then health turns SERVING.
    """
    tracing.setup("ar", settings.trace_export, settings.trace_sample_ratio)
    rpcs = drain.InFlightRpcs()
    server = grpc_common.create_server(
        settings.max_message_bytes, settings.read_auth_token(), interceptors=[rpcs],
        role_tokens=settings.read_role_tokens(), insecure=settings.insecure_no_auth,
    )
    health = grpc_common.HealthReporter(server, [SERVICE_NAME])
    servicer = ARServicer(None, None, settings, settings.client_token(grpc_common.ROLE_AR))
    pb_grpc.add_ARServicer_to_server(servicer, server)
    port = grpc_common.add_port(server, f"{settings.host}:{settings.port}", settings.grpc_server_credentials())
    await server.start()
    metrics_port = start_metrics_server(settings.metrics_port, settings.host)
    logger.info("AR gRPC on %s:%d (metrics %s), loading the model...", settings.host, port, metrics_port)
    t0 = time.perf_counter()
    bundle = await asyncio.to_thread(
        load_ar, settings.checkpoint, settings.cache_dir, settings.resolved_device(), settings.resolved_dtype()
    )
    engine = DecodeEngine(
        bundle.new_sequence,
        settings.max_running_sequences,
        model=bundle.model,
        grid_ids=bundle.grid_ids,
        max_sequence_length=min(settings.max_sequence_length, bundle.model.config.max_position_embeddings),
    )
    engine.start()
    await asyncio.to_thread(engine.ready.wait)  # KV pool allocated, CUDA graphs captured
    servicer.bundle, servicer.engine = bundle, engine
    async def wait_idle() -> None:
        # In-flight requests keep their push streams to the DiT open: stop the server only once the
        # engine has no running sequence (or the grace period is over).
        while engine.running:
            await asyncio.sleep(0.05)

    drained = drain.install_drain_handler(
        server, health, settings.drain_grace_seconds, on_drain=engine.stop_accepting,
        wait_idle=wait_idle, in_flight=rpcs,
    )
    await health.set_serving()
    logger.info("AR serving (model loaded in %.1f s)", time.perf_counter() - t0)
    write_ready_file(ready_file, f"{settings.host}:{port}", metrics_port=metrics_port)
    await drained.wait()
    await server.wait_for_termination()
    engine.stop()
    await servicer.close()
    tracing.shutdown()
    logger.info("AR stopped")
