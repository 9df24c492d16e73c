"""The AR stage's gRPC server: ``mammoth.v1.AR/Generate``.

One ``Generate`` call = one request attempt ``(request_id, epoch)``: the servicer validates the
request, checks its DiT address against the allow-list, tokenises the prompt into the
text-to-image envelope (an `ARPlan`), and hands the call to an `stage_ar.session.ARSession`, which
admits a `DecodeJob` into the `DecodeEngine` (``RESOURCE_EXHAUSTED`` when
``max_running_sequences`` are running) and drives the request's `HiddenStateSender` — the
``DiT.PushConditions`` client stream to the DiT that holds the slot — on the event loop while the
engine thread decodes. The call streams ``ARProgress`` events back and ends with ``ARDone``.

Cancellation runs downward: when the gateway cancels this call (client gone, deadline), or the push
to the DiT fails (slot released, DiT gone), the job is cancelled before its next decode step, its
KV cache is freed, and the push stream is closed (`ARSession.close`). Nothing about a request
outlives its call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc

from mammoth_core import decoding, drain, errors, grpc_common, limits, tracing, transport_metrics
from mammoth_core.addresses import format_address
from mammoth_core.errors import Reason
from mammoth_core.logging import request_id_var
from mammoth_core.runtime import start_metrics_server, starting, write_ready_file
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc
from mammoth_core.settings import ARSettings
from mammoth_core.text import is_blank
from stage_ar import metrics
from stage_ar.dit_targets import DiTAllowList, DiTChannels
from stage_ar.engine import DecodeEngine
from stage_ar.loader import ARBundle, load_ar
from stage_ar.sender import HiddenStateSender, prepare_staging
from stage_ar.session import ARPlan, ARSession, CallFailed

logger = logging.getLogger(__name__)

SERVICE_NAME = "mammoth.v1.AR"
GRID_PIXELS = limits.GRID_PIXELS  # the default (auto) grid: width // 16 x height // 16
MAX_PROMPT_CHARS = 16_384


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
        # The sender writes pre-framed messages on the channel itself, so it is given the channel.
        self._channels = DiTChannels(self._open_channel, settings.max_dit_channels)

    def _open_channel(self, address: str) -> grpc.aio.Channel:
        return grpc_common.create_channel(
            address, self.settings.max_message_bytes, self.settings.grpc_channel_credentials(),
            self.settings.tls_server_name,
        )

    async def close(self) -> None:
        """Close the cached channels to DiTs."""
        await self._channels.close()

    # -- RPC ------------------------------------------------------------------------------------

    async def Generate(
        self, request: pb.ARGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ARGenerateResponse]:
        request_id_var.set(f"{request.request_id}/{request.epoch}")
        session: ARSession | None = None
        try:
            plan = await self._plan(request)
            session = self._open_session(plan, context)
            session.start()
            async for progress in session.progress():
                yield pb.ARGenerateResponse(progress=progress)
            yield pb.ARGenerateResponse(done=session.done_message())
        except CallFailed as failure:
            if session is None and failure.outcome:
                metrics.REQUESTS.labels(failure.outcome).inc()
            await errors.abort(context, failure.code, failure.details, stage=failure.origin.stage,
                               reason=failure.origin.reason, field=failure.field)
        finally:
            if session is not None:
                session.close()

    def _open_session(self, plan: ARPlan, context: grpc.aio.ServicerContext) -> ARSession:
        """The call's session, holding a lease on the channel to its DiT until it closes."""
        r = plan.request
        # tracing (no-ops when off): this call's span; the session opens the push's as its child
        server_span = tracing.start_span(
            "mammoth.v1.AR/Generate", tracing.extract(context.invocation_metadata()), kind="SERVER",
            attributes={"mammoth.request_id": r.request_id, "mammoth.epoch": r.epoch})
        remaining = context.time_remaining()
        channel = self._channels.acquire(r.dit_address)

        def sender_for(plan: ARPlan, push_span) -> HiddenStateSender:
            return HiddenStateSender(
                channel, request_id=r.request_id, epoch=r.epoch, reservation_token=r.reservation_token,
                hidden_size=self.bundle.hidden_size, dtype=self.bundle.dtype,
                answer_start_index=len(plan.prompt_ids), answer_boundary=self.settings.answer_boundary,
                expected_rows=plan.condition_rows, expected_negative_rows=plan.negative_rows,
                chunk_rows=self.settings.chunk_rows, max_message_bytes=self.settings.max_message_bytes,
                metadata=tracing.inject(self._metadata, tracing.context_of(push_span)), timeout=remaining,
            )

        try:
            return ARSession(plan, self.engine, sender_for, lambda: self._channels.release(r.dit_address),
                             deadline_s=remaining, server_span=server_span, trace_dir=self.settings.trace_dir)
        except BaseException:
            self._channels.release(r.dit_address)
            tracing.end_span(server_span, error="failed")
            raise

    # -- validation -----------------------------------------------------------------------------

    async def _plan(self, request: pb.ARGenerateRequest) -> ARPlan:
        """The tokenised request, once it passed every check.

        Raises:
            CallFailed: UNAVAILABLE while the model loads; INVALID_ARGUMENT naming the problem;
                PERMISSION_DENIED for a DiT this AR may not dial.
        """
        if self.bundle is None or self.engine is None:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, "the AR model is still loading", None, Reason.LOADING)
        problem = validate_request(request)
        if problem:
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, problem, "invalid", Reason.INVALID_REQUEST)
        await self._check_dit_address(request.dit_address)
        tok = self.bundle.tokenizer
        ar_w, ar_h = _grid(request)
        prompt_ids = tok.encode_t2i_prompt(request.prompt, ar_w, ar_h)
        negative_ids = tok.encode_negative_prompt(request.negative_prompt) if request.negative_prompt else None
        limit = self.bundle.negative_row_limit
        if negative_ids and limit is not None and len(negative_ids) > limit:  # refused before any work
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT,
                             f"the negative prompt is {len(negative_ids)} tokens; this model's DiT takes at most "
                             f"{limit} (gen_dit_config.axes_lens[0] - 1): shorten negative_prompt", "invalid",
                             Reason.INVALID_REQUEST, field="negative_prompt")
        total_rows = len(prompt_ids) + ar_h * (ar_w + 1)
        max_pos = min(self.bundle.model.config.max_position_embeddings, self.engine.max_sequence_length)
        if total_rows > max_pos:
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{request.width}x{request.height} with a {ar_w}x{ar_h} grid needs {total_rows} "
                             f"positions; the model has {max_pos}", "invalid", Reason.INVALID_REQUEST)
        return ARPlan(request, prompt_ids, negative_ids, (ar_w, ar_h), total_rows)

    async def _check_dit_address(self, address: str) -> None:
        """Raise `CallFailed` unless ``address`` is a DiT this AR may dial (`DiTAllowList`)."""
        try:
            why = await self.allowed_dits.check(address)
        except ValueError as exc:
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "invalid",
                             Reason.INVALID_REQUEST) from None
        if why is not None:
            logger.warning("refused dit_address %r: %s", address, why)
            raise CallFailed(grpc.StatusCode.PERMISSION_DENIED, why, "refused_dit", Reason.DIT_NOT_ALLOWED)


def validate_request(request: pb.ARGenerateRequest) -> str | None:
    """A message naming what is wrong with ``request``, or None."""
    if problem := limits.request_id_problem(request.request_id):
        return problem
    low, high = limits.GUIDANCE_SCALE_RANGE
    if not low <= request.ar_guidance_scale <= high:  # NaN fails both comparisons
        return f"ar_guidance_scale must be in [{low:g}, {high:g}], got {request.ar_guidance_scale!r}"
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
    try:
        decoding.from_proto(request.decoding)
    except ValueError as exc:
        return f"decoding: {exc}"
    return None


def _grid(request: pb.ARGenerateRequest) -> tuple[int, int]:
    """The AR grid in cells: ``grid_width x grid_height``, or ``width // 16 x height // 16`` when
    they are 0 (an older gateway)."""
    if request.grid_width:
        return request.grid_width, request.grid_height
    return request.width // GRID_PIXELS, request.height // GRID_PIXELS


def new_engine(bundle: ARBundle, settings: ARSettings, **options) -> DecodeEngine:
    """The stage's `DecodeEngine` over ``bundle`` (every tensor-parallel rank builds the same one;
    ``options``: `DecodeEngine` keywords, e.g. ``scheduler_factory``, ``warm_up``)."""
    return DecodeEngine(
        bundle.new_sequence,
        settings.max_running_sequences,
        model=bundle.model,
        grid_ids=bundle.grid_ids,
        max_sequence_length=min(settings.max_sequence_length, bundle.model.config.max_position_embeddings),
        **options,
    )


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
    transport_metrics.export("send")  # this stage's side of the transport series only
    metrics_port = start_metrics_server(settings.metrics_port, settings.host)  # (a port in use: before gRPC starts)
    port = grpc_common.add_port(server, settings.host, settings.port, settings.grpc_server_credentials())
    await server.start()
    logger.info("AR gRPC on %s:%d (metrics %s), loading the model...", settings.host, port, metrics_port)
    t0 = time.perf_counter()
    tp = None
    async with starting(server, "AR"):
        if settings.tensor_parallel_size > 1:  # ranks 1..N-1 start here, from the main thread
            from stage_ar.tensor_parallel_stage import TensorParallelAR

            tp = TensorParallelAR.start(settings)
            await asyncio.to_thread(tp.join)
            bundle = await asyncio.to_thread(tp.load, settings)
        else:
            bundle = await asyncio.to_thread(
                load_ar, settings.checkpoint, settings.cache_dir, settings.resolved_device(),
                settings.resolved_dtype(), weights_dtype=settings.weights_dtype, linear_backend=settings.linear_backend,
            )
        engine = new_engine(bundle, settings, on_failure=health.on_fatal_error(asyncio.get_running_loop()),
                            **({"scheduler_factory": tp.scheduler_factory} if tp else {}))
        if tp is not None:
            await asyncio.to_thread(tp.ready, engine)
        engine.start()
        await asyncio.to_thread(engine.ready.wait)  # KV pool allocated, CUDA graphs captured
        if engine.failure is not None:  # capture or warm-up broke the device: exit non-zero, be restarted
            raise RuntimeError(f"the AR engine failed before serving: {engine.failure!r}")
        await asyncio.to_thread(prepare_staging, bundle.hidden_size, bundle.dtype, settings.chunk_rows,
                                settings.max_message_bytes, engine.runner.on_cuda)
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
    write_ready_file(ready_file, format_address(settings.host, port), metrics_port=metrics_port)
    await drained.wait()
    await server.wait_for_termination()
    engine.stop()
    if tp is not None:
        await asyncio.to_thread(tp.stop, engine)
    await servicer.close()
    tracing.shutdown()
    logger.info("AR stopped")
