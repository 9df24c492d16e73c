"""Image generation: request resolution, admission, and the two-stage orchestration.

Per image (DESIGN.md, "Request path"):

1. reserve a DiT slot: open ``DiT.Generate`` (server stream) with the `ImageParams` on the
   least-in-flight SERVING DiT and read ``Reserved{reservation_token}``; ``RESOURCE_EXHAUSTED`` or
   ``UNAVAILABLE`` moves on to the next replica, and when every replica is full the pipeline waits
   (woken when this gateway frees a slot, at most 1 s between tries) until the request's deadline;
2. open ``AR.Generate`` on the least-in-flight SERVING AR with the prompt, size, seed, guidance,
   ``dit_address`` (the address the gateway dialled) and the token;
3. read both streams concurrently: AR progress (tokens), DiT progress (steps), DiT partial images,
   and the final DiT ``Image``.

Failure rules: an AR failure before the DiT said ``ConditionsComplete`` (its explicit event: every
condition row is resident) is retried on another AR with the same request id and ``epoch + 1`` (the
slot survives); after that event no AR retry starts, and an AR failure is harmless. A push the DiT
refused because the conditions are already complete (refusal reason CONDITIONS_COMPLETE, relayed by
the AR in its trailers) is not an AR failure: it is neither retried nor counted. A DiT failure
drops the slot and starts over (new slot, new AR run) while the deadline allows. Every RPC carries ``timeout = deadline - now``.
Cancelling the pipeline task (client disconnect) cancels both calls; the DiT frees the slot when its
``Generate`` stream closes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

import anyio
import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.backends import Backend, BackendPool
from gateway.errors import (
    BackendError,
    DeadlineExceededError,
    ErrorResponse,
    GatewayError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    UnavailableError,
    error_info,
    outcome_of,
)
from gateway.images_store import ImageStore
from gateway.metrics import GatewayMetrics
from gateway.progress_watch import ProgressWatch
from gateway.protocol import (
    INT64_MAX,
    UNSUPPORTED_OPENAI_FIELDS,
    ImageGenCompletedEvent,
    ImageGenerationRequest,
    ImageGenPartialImageEvent,
    ImageObject,
    ImagesResponse,
    ImageUsage,
    InputTokensDetails,
    OutputTokensDetails,
    ProgressEvent,
)
from gateway.request_budget import keepalive_interval, request_budget
from mammoth_core import decoding, grpc_common, limits, tracing
from mammoth_core.decoding import SEQUENTIAL, DecodingOptions
from mammoth_core.text import is_blank
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.refusals import refusal_of
from mammoth_core.settings import GatewaySettings

logger = logging.getLogger(__name__)

#: ``quality`` -> multiple of the default number of inference steps (capped by ``max_steps``).
QUALITY_STEP_FACTORS = {
    "low": 0.25, "medium": 0.5, "auto": 1.0, "standard": 1.0, "high": 1.0,
    "hd": 1.5, "xhigh": 1.5, "max": 2.0,
}
#: ``quality`` as responses and events echo it: the effort actually used, in the values the API's
#: response schema allows (``low``/``medium``/``high``/``xhigh``/``max``).
QUALITY_ECHO = {
    "low": "low", "medium": "medium", "auto": "high", "standard": "high", "high": "high",
    "hd": "xhigh", "xhigh": "xhigh", "max": "max",
}
#: After the image arrived, how long to wait for the AR's ARDone (usage and AR timings), seconds.
AR_DONE_GRACE_SECONDS = 10.0
#: ``style: natural`` multiplies the default text guidance scale by this (floor 1.0).
NATURAL_GUIDANCE_FACTOR = 0.5
#: JPEG/WebP ``output_compression`` when the request gives none (encoder quality 75).
DEFAULT_OUTPUT_COMPRESSION = 25
MAX_AR_ATTEMPTS = 4
#: After an AR failure, how long the DiT stream may take to say it failed too or that the
#: conditions are complete (then no AR retry starts), seconds.
AR_FAILURE_GRACE_SECONDS = 0.1
MAX_DIT_ATTEMPTS = 3
RETRY_AFTER_SECONDS = 1.0
#: Stage answers that no retry can fix (configuration errors): answered with 502 at once.
FATAL_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                         grpc.StatusCode.UNIMPLEMENTED})
SSE_KEEPALIVE_SECONDS = 15.0
#: Request outcome -> ``mammoth_gateway_cancellations_total{cause}`` (work cancelled in the stages).
CANCELLATION_CAUSES = {"cancelled": "client_disconnect", "deadline": "deadline"}

_SIZE_RE = re.compile(r"^([0-9]{1,6})x([0-9]{1,6})$")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


# ------------------------------------------------------------------------------------------------
# Request resolution
# ------------------------------------------------------------------------------------------------


@dataclass
class ImageJob:
    """A validated request with every default applied (the parameters actually used)."""

    request_id: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    #: AR grid ``(width, height)`` in cells (`mammoth_core.limits.resolve_grid`).
    ar_grid: tuple[int, int]
    n: int
    seed: int
    num_inference_steps: int
    text_guidance_scale: float
    cfg_range: tuple[float, float]
    ar_guidance_scale: float
    output_format: str
    output_compression: int
    partial_images: int
    response_format: str
    stream: bool
    quality: str
    safety_identifier: str | None
    stream_progress: bool = False
    decoding: DecodingOptions = SEQUENTIAL
    #: opt-in DiT step cache ``(threshold, warmup_steps)``, or None (off)
    dit_cache: tuple[float, int] | None = None

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


def parse_size(size: str | None, settings: GatewaySettings) -> tuple[int, int]:
    """``"WxH"`` or ``"auto"`` -> ``(width, height)`` in pixels.

    Rules: both sides positive multiples of 16; ``min_pixels <= width*height <= max_pixels``
    (`mammoth_core.limits.check_image`, the rule the DiT applies too).

    Raises:
        InvalidRequestError: with ``param="size"`` for any violation.
    """
    text = settings.default_size if size in (None, "auto") else size
    m = _SIZE_RE.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise InvalidRequestError(
            f"invalid size {size!r}: expected 'auto' or 'WIDTHxHEIGHT' with positive integers, "
            "e.g. '1024x1024'", param="size", code="invalid_size")
    width, height = int(m.group(1)), int(m.group(2))
    with _limit_errors():
        limits.check_image(width, height, 1, limits.from_settings(settings))
    return width, height


@contextlib.contextmanager
def _limit_errors() -> Iterator[None]:
    """Turn a `mammoth_core.limits.LimitError` into the 400 naming its ``param``."""
    try:
        yield
    except limits.LimitError as exc:
        raise InvalidRequestError(exc.message, param=exc.param, code=exc.code) from None


def resolve_ar_grid(req: ImageGenerationRequest, width: int, height: int, prompt: str,
                    negative: str, settings: GatewaySettings) -> tuple[int, int]:
    """The AR grid (cells) of the request: ``ar_grid`` or the deployment's ``default_ar_grid``,
    checked against what the AR and the DiT hold (`mammoth_core.limits.check_positions`).

    Raises:
        InvalidRequestError: ``param`` is ``ar_grid`` (malformed, or a given grid too large),
            ``size`` (the auto grid of this size too large), ``prompt`` or ``negative_prompt``.
    """
    given = req.ar_grid is not None
    text = req.ar_grid if given else settings.default_ar_grid
    with _limit_errors():
        grid = limits.resolve_grid(width, height, text)
        grid_param = "size" if text == "auto" else "ar_grid"
        limits.check_positions(prompt, negative, width, height, grid, grid_param,
                               limits.from_settings(settings))
    return grid


def _check_extra_body_conflicts(req: ImageGenerationRequest) -> None:
    for key, value in (req.extra_body or {}).items():
        top = getattr(req, key)
        same = top == value
        if key == "cfg_range" and isinstance(value, (list, tuple)) and top is not None:
            same = len(value) == 2 and tuple(float(v) for v in value) == tuple(top)
        if not same:
            raise InvalidRequestError(
                f"extra_body.{key}={value!r} conflicts with {key}={top!r} given at the top level",
                param=key, code="conflicting_parameter")


def resolve_request(req: ImageGenerationRequest, settings: GatewaySettings,
                    request_id: str) -> ImageJob:
    """Check ``req`` against the settings and fill every default.

    Raises:
        InvalidRequestError: a field is invalid, unknown, unsupported or conflicts (``param`` names
            it).
        NotFoundError: ``model`` is not the served model (``code="model_not_found"``).
    """
    for name in sorted(req.model_extra or {}):
        raise InvalidRequestError(f"unknown parameter: '{name}'", param=name,
                                  code="unknown_parameter")
    for name, why in UNSUPPORTED_OPENAI_FIELDS.items():
        if getattr(req, name) is not None:
            raise InvalidRequestError(f"'{name}' is not supported: {why}", param=name,
                                      code="unsupported_parameter")
    _check_extra_body_conflicts(req)
    if req.model is not None and req.model != settings.model_name:
        raise NotFoundError(f"the model '{req.model}' does not exist; this gateway serves "
                            f"'{settings.model_name}'", param="model", code="model_not_found")
    if len(req.prompt) > settings.max_prompt_chars:
        raise InvalidRequestError(
            f"prompt is {len(req.prompt)} characters; the maximum is {settings.max_prompt_chars}",
            param="prompt", code="string_above_max_length")
    if is_blank(req.prompt):
        raise InvalidRequestError("prompt must not be blank (it has no visible character)",
                                  param="prompt")
    negative = req.negative_prompt or ""
    if len(negative) > settings.max_prompt_chars:
        raise InvalidRequestError(
            f"negative_prompt is {len(negative)} characters; the maximum is "
            f"{settings.max_prompt_chars}", param="negative_prompt", code="string_above_max_length")
    width, height = parse_size(req.size, settings)
    grid = resolve_ar_grid(req, width, height, req.prompt, negative, settings)
    n = req.n or 1

    output_format = req.output_format or "png"
    if req.output_compression is not None and output_format == "png":
        raise InvalidRequestError("output_compression applies to jpeg and webp only (png is "
                                  "lossless)", param="output_compression")
    compression = 0 if output_format == "png" else (
        DEFAULT_OUTPUT_COMPRESSION if req.output_compression is None else req.output_compression)
    if req.background == "transparent":
        raise InvalidRequestError("background 'transparent' is not supported: the model paints "
                                  "opaque images (use 'opaque' or 'auto')", param="background")

    quality = req.quality or "auto"
    if req.num_inference_steps is not None:
        if req.quality not in (None, "auto"):
            raise InvalidRequestError("give either quality or num_inference_steps, not both",
                                      param="quality", code="conflicting_parameter")
        steps = req.num_inference_steps
    else:
        steps = max(1, round(settings.default_steps * QUALITY_STEP_FACTORS[quality]))
    if steps > settings.max_steps and req.num_inference_steps is None:
        steps = settings.max_steps  # quality scales the default, capped
    with _limit_errors():
        limits.check_image(width, height, steps, limits.from_settings(settings))

    if req.text_guidance_scale is not None:
        if req.style is not None:
            raise InvalidRequestError("give either style or text_guidance_scale, not both",
                                      param="style", code="conflicting_parameter")
        guidance = float(req.text_guidance_scale)
    elif req.style == "natural":
        guidance = max(1.0, settings.default_guidance_scale * NATURAL_GUIDANCE_FACTOR)
    else:
        guidance = float(settings.default_guidance_scale)
    cfg_range = tuple(req.cfg_range) if req.cfg_range is not None else tuple(
        settings.default_cfg_range)

    partial_images = req.partial_images or 0
    if partial_images and not req.stream:
        raise InvalidRequestError("partial_images needs stream=true", param="partial_images")
    if req.stream_progress and not req.stream:
        raise InvalidRequestError("stream_progress needs stream=true", param="stream_progress")
    if partial_images and partial_images > steps:
        raise InvalidRequestError(f"partial_images ({partial_images}) exceeds the number of "
                                  f"denoising steps ({steps})", param="partial_images")

    dit_cache = None
    if req.dit_cache is not None and req.dit_cache.threshold > 0:
        if req.dit_cache.warmup_steps > steps:
            raise InvalidRequestError(f"dit_cache.warmup_steps ({req.dit_cache.warmup_steps}) exceeds the "
                                      f"number of denoising steps ({steps})", param="dit_cache")
        dit_cache = (float(req.dit_cache.threshold), int(req.dit_cache.warmup_steps))

    seed = req.seed if req.seed is not None else secrets.randbelow(2**32)
    if seed + n - 1 > INT64_MAX:
        raise InvalidRequestError("seed + n - 1 must fit in a signed 64-bit integer", param="seed")

    return ImageJob(
        request_id=request_id,
        prompt=req.prompt,
        negative_prompt=negative,
        width=width,
        height=height,
        ar_grid=grid,
        n=n,
        seed=seed,
        num_inference_steps=steps,
        text_guidance_scale=guidance,
        cfg_range=(float(cfg_range[0]), float(cfg_range[1])),
        ar_guidance_scale=float(req.ar_guidance_scale or 0.0),
        decoding=DecodingOptions.resolve(
            req.ar_decoding, req.jacobi_window, req.jacobi_token_reuse, req.jacobi_spatial_init,
            DecodingOptions(settings.default_ar_decoding, settings.default_jacobi_window)),
        output_format=output_format,
        output_compression=compression,
        partial_images=partial_images,
        response_format=req.response_format or "b64_json",
        stream=bool(req.stream),
        quality=QUALITY_ECHO[quality],
        safety_identifier=req.safety_identifier or req.user or None,
        dit_cache=dit_cache,
        stream_progress=bool(req.stream_progress),
    )


def new_request_id(header_value: str | None) -> str:
    """The client's ``x-request-id`` when it is well formed, else ``img-<32 hex>``."""
    if header_value and _REQUEST_ID_RE.match(header_value):
        return header_value
    return f"img-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------------------------
# Admission
# ------------------------------------------------------------------------------------------------


class AdmissionQueue:
    """Bounded queue of requests waiting for their DiT slots.

    A request enters before any stage work and leaves once each of its images holds a slot (or the
    request ends). When ``capacity`` requests are already waiting, `enter` raises
    `OverloadedError` (HTTP 429, ``Retry-After``).
    """

    def __init__(self, capacity: int, metrics: GatewayMetrics) -> None:
        self.capacity = max(1, capacity)
        self.waiting = 0
        self._metrics = metrics

    def enter(self, images: int) -> "AdmissionTicket":
        if self.waiting >= self.capacity:
            raise OverloadedError(
                f"the gateway's queue is full ({self.capacity} requests waiting for a DiT slot); "
                "retry later", retry_after=RETRY_AFTER_SECONDS)
        self.waiting += 1
        self._metrics.queue_depth.set(self.waiting)
        return AdmissionTicket(self, images)

    def _leave(self) -> None:
        self.waiting -= 1
        self._metrics.queue_depth.set(self.waiting)


class AdmissionTicket:
    """One request's place in the `AdmissionQueue`; leaves when every image reserved a slot."""

    def __init__(self, queue: AdmissionQueue, images: int) -> None:
        self._queue = queue
        self._pending = images
        self._left = False

    def image_reserved(self) -> None:
        self._pending -= 1
        if self._pending <= 0:
            self.leave()

    def leave(self) -> None:
        """Leave the queue (idempotent)."""
        if not self._left:
            self._left = True
            self._queue._leave()


# ------------------------------------------------------------------------------------------------
# Orchestration
# ------------------------------------------------------------------------------------------------


@dataclass
class StageProgress:
    """Progress of one image's stage (becomes a ``image_generation.progress`` event)."""

    index: int
    stage: str
    phase: str
    tokens_generated: int | None = None
    total_tokens: int | None = None
    step: int | None = None
    total_steps: int | None = None
    epoch: int | None = None


@dataclass
class PartialImage:
    """An intermediate preview of image ``index`` (the DiT's ``Image{partial: true}``)."""

    index: int
    partial_index: int
    data: bytes


@dataclass
class ImageResult:
    """The final image of one pipeline and what it cost."""

    index: int
    seed: int
    data: bytes
    format: str
    width: int
    height: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    epoch: int = 0
    dit_attempts: int = 1
    dit_address: str = ""
    ar_address: str = ""
    #: Per-stage seconds of this image (`STAGES` order), each measured by the component that did
    #: the work; they partition the image's time from admission to the final image.
    timings: dict[str, float] = field(default_factory=dict)


#: The stages of one image, in pipeline order (metric label ``stage`` and ``Server-Timing`` names):
#: ``queue`` (gateway: waiting for a DiT slot), ``ar_prefill`` / ``ar_decode`` (AR clock: prompt
#: prefill incl. tokenisation and engine admission, then grid decode to the last row),
#: ``transfer`` (last row sent by the AR -> conditions resident on the DiT device), ``dit_denoise``
#: (DiT: condition preparation and the denoising steps), ``dit_vae`` (VAE decode), ``dit_encode``
#: (PNG/JPEG/WebP encoding).
STAGES = ("queue", "ar_prefill", "ar_decode", "transfer", "dit_denoise", "dit_vae", "dit_encode")


def server_timing(timings: dict[str, float], total: float | None = None) -> str:
    """A W3C ``Server-Timing`` header value (durations in milliseconds) for ``timings`` (seconds).

    Example: ``queue;dur=1.2, ar_prefill;dur=30.5, ..., total;dur=812.0``.
    """
    parts = [f"{name};dur={1000.0 * timings[name]:.3f}" for name in STAGES if name in timings]
    if total is not None:
        parts.append(f"total;dur={1000.0 * total:.3f}")
    return ", ".join(parts)


def timings_ms(timings: dict[str, float], total: float | None = None) -> dict[str, float]:
    """``timings`` (seconds) as the streaming ``timings`` extension: milliseconds under the
    `server_timing` names in `STAGES` order, plus ``total`` when given."""
    out = {name: round(1000.0 * timings[name], 3) for name in STAGES if name in timings}
    if total is not None:
        out["total"] = round(1000.0 * total, 3)
    return out


Emit = Callable[[object], None]


class _StageFailure(Exception):
    """A retryable failure of one stage call (``code``: the gRPC status name or a short reason;
    ``refusal``: the ``mammoth.v1.RefusalReason`` in its trailers, 0 for none)."""

    def __init__(self, stage: str, code: str, message: str, address: str = "",
                 refusal: int = 0) -> None:
        super().__init__(f"{stage} {address}: {code}: {message}")
        self.stage = stage
        self.code = code
        self.address = address
        self.refusal = refusal


@dataclass
class _SlotState:
    #: Set when the DiT said ``ConditionsComplete`` (or refused a push for it): no AR retry after.
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    ar_address: str = ""
    ar_done: pb.ARDone | None = None
    ar_started_unix_ms: float = 0.0
    excluded_ars: set[str] = field(default_factory=set)

    @property
    def conditions_complete(self) -> bool:
        return self.complete.is_set()


async def _wait_first(tasks: set[asyncio.Task], event: asyncio.Event, timeout: float) -> None:
    """Wait until one of ``tasks`` is done or ``event`` is set, at most ``timeout`` seconds."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({*tasks, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _remaining(deadline: float) -> float:
    return deadline - asyncio.get_running_loop().time()


def _deadline_error(what: str) -> DeadlineExceededError:
    return DeadlineExceededError(f"the request's time budget ran out {what}")


class Orchestrator:
    """Runs the per-image pipelines against the AR and DiT pools.

    Args:
        settings: gateway settings.
        ar_pool, dit_pool: the stage backends.
        metrics: gateway metrics.
        auth_token: stage-to-stage token sent as ``authorization: Bearer <token>``, or None.
    """

    def __init__(self, settings: GatewaySettings, ar_pool: BackendPool, dit_pool: BackendPool,
                 metrics: GatewayMetrics, auth_token: str | None) -> None:
        self.settings = settings
        self.ar_pool = ar_pool
        self.dit_pool = dit_pool
        self.metrics = metrics
        self._metadata = grpc_common.auth_metadata(auth_token)
        self._slot_freed = asyncio.Event()

    # ---------------------------------------------------------------- public

    async def generate_image(self, job: ImageJob, index: int, deadline: float, emit: Emit,
                             on_reserved: Callable[[], None]) -> ImageResult:
        """Run image ``index`` of ``job`` (seed ``job.seed + index``) to its final image.

        Args:
            deadline: event-loop time (s) by which the image must be done.
            emit: receives `StageProgress` and `PartialImage` as they happen.
            on_reserved: called once, the first time a DiT slot is held.

        Raises:
            DeadlineExceededError: the deadline passed.
            InvalidRequestError: a stage rejected the parameters (INVALID_ARGUMENT).
            BackendError: a stage kept failing (retries exhausted).
        """
        seed = job.seed + index
        pipeline_id = f"{job.request_id}-{index}"
        self.metrics.active_pipelines.inc()
        try:
            with tracing.span("gateway.image", attributes={"mammoth.image_index": index,
                                                           "mammoth.seed": seed}):
                return await self._generate_image(job, index, seed, pipeline_id, deadline, emit,
                                                  on_reserved)
        finally:
            self.metrics.active_pipelines.dec()

    async def _generate_image(self, job: ImageJob, index: int, seed: int, pipeline_id: str,
                              deadline: float, emit: Emit,
                              on_reserved: Callable[[], None]) -> ImageResult:
        """`generate_image`'s DiT attempts (a new slot each)."""
        loop = asyncio.get_running_loop()
        epoch = -1
        reserved_once = False
        for dit_attempt in range(1, MAX_DIT_ATTEMPTS + 1):
            t_queue = loop.time()
            async with contextlib.AsyncExitStack() as stack:
                emit(StageProgress(index, "dit", "queued"))
                dit, call, reserved = await self._reserve(job, pipeline_id, seed, deadline, stack)
                queue_s = loop.time() - t_queue
                self.metrics.stage_duration.labels("queue").observe(queue_s)
                if not reserved_once:
                    reserved_once = True
                    on_reserved()
                emit(StageProgress(index, "dit", "reserved"))
                try:
                    result, epoch = await self._run_with_slot(
                        job, index, seed, pipeline_id, dit, call, reserved, deadline, emit,
                        epoch)
                except _StageFailure as failure:
                    logger.warning("request %s image %d: DiT %s failed (%s); %s",
                                   job.request_id, index, dit.address, failure,
                                   "retrying from scratch" if dit_attempt < MAX_DIT_ATTEMPTS
                                   else "giving up")
                    if failure.code == "UNAVAILABLE":
                        self.dit_pool.mark_failed(dit)
                    if dit_attempt == MAX_DIT_ATTEMPTS:
                        raise BackendError(f"the DiT stage failed {dit_attempt} times: "
                                           f"{failure}") from failure
                    self.metrics.retries_total.labels("dit", failure.code).inc()
                    continue
                result.dit_attempts = dit_attempt
                result.timings = {"queue": queue_s, **result.timings}
                return result
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- DiT

    def _image_params(self, job: ImageJob, seed: int) -> pb.ImageParams:
        return pb.ImageParams(
            width=job.width, height=job.height, num_inference_steps=job.num_inference_steps,
            text_guidance_scale=job.text_guidance_scale, cfg_range_start=job.cfg_range[0],
            cfg_range_end=job.cfg_range[1], seed=seed, output_format=job.output_format,
            output_compression=job.output_compression, partial_images=job.partial_images,
            has_negative=bool(job.negative_prompt),
            dit_cache=None if job.dit_cache is None else pb.DiTCache(threshold=job.dit_cache[0],
                                                                     warmup_steps=job.dit_cache[1]))

    async def _reserve(self, job: ImageJob, pipeline_id: str, seed: int, deadline: float,
                       stack: contextlib.AsyncExitStack
                       ) -> tuple[Backend, grpc.aio.UnaryStreamCall, pb.Reserved]:
        """Open ``DiT.Generate`` on some replica until one answers ``Reserved``.

        The call, its in-flight lease and the ``slots_in_use`` gauge are released by ``stack``.
        """
        request = pb.DiTGenerateRequest(request_id=pipeline_id, params=self._image_params(job, seed))
        metadata = tracing.inject(self._metadata)  # the image's span is the DiT's parent
        backoff = 0.05
        while True:
            tried: set[str] = set()
            while (dit := self.dit_pool.pick(exclude=tried)) is not None:
                tried.add(dit.address)
                remaining = _remaining(deadline)
                if remaining <= 0:
                    raise _deadline_error("waiting for a DiT slot")
                lease = self.dit_pool.lease(dit)
                lease.__enter__()
                call = dit.stub.Generate(request, timeout=remaining, metadata=metadata)
                try:
                    first = await ProgressWatch(call, dit.health).read()
                except grpc.aio.AioRpcError as exc:
                    call.cancel()
                    lease.__exit__(None, None, None)
                    code = exc.code()
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        continue
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise _deadline_error("waiting for a DiT slot") from exc
                    if code == grpc.StatusCode.INVALID_ARGUMENT:
                        raise InvalidRequestError(
                            f"the DiT stage rejected the image parameters: {exc.details()}") from exc
                    if code in FATAL_CODES:
                        raise BackendError(f"the DiT at {dit.address} refused the call: "
                                           f"{code.name} {exc.details()}") from exc
                    if code == grpc.StatusCode.UNAVAILABLE:
                        self.dit_pool.mark_failed(dit)
                    logger.warning("DiT %s refused a reservation: %s %s", dit.address, code.name,
                                   exc.details())
                    continue
                except BaseException:
                    call.cancel()
                    lease.__exit__(None, None, None)
                    raise
                if first is grpc.aio.EOF or first.WhichOneof("event") != "reserved":
                    call.cancel()
                    lease.__exit__(None, None, None)
                    logger.warning("DiT %s answered Generate without Reserved", dit.address)
                    continue
                stack.callback(lease.__exit__, None, None, None)
                stack.callback(self._release_slot, call)
                self.metrics.slots_in_use.inc()
                return dit, call, first.reserved
            remaining = _remaining(deadline)
            if remaining <= 0:
                raise _deadline_error("waiting for a DiT slot")
            self._fail_if_unavailable(self.dit_pool, "DiT")
            await self._wait_for_capacity(min(backoff, remaining))
            backoff = min(backoff * 2, 1.0)

    def _fail_if_unavailable(self, pool: BackendPool, name: str) -> None:
        """Fail at once when no replica of ``pool`` can take the request: none SERVING and none
        being probed (`BackendPool.available`). No replacement is waited for: the gateway cannot
        see one coming (a headless Service lists a pod once it is Ready) and a model load takes
        minutes; the client retries after ``Retry-After`` (docs/RELIABILITY.md).

        Raises:
            UnavailableError: 503 ``no_backend`` with ``Retry-After``.
        """
        if not pool.available():
            raise UnavailableError(f"no {name} backend is serving", code="no_backend",
                                   retry_after=max(RETRY_AFTER_SECONDS,
                                                   self.settings.health_interval_seconds))

    def _release_slot(self, call: grpc.aio.UnaryStreamCall) -> None:
        call.cancel()
        self.metrics.slots_in_use.dec()
        self._slot_freed.set()
        self._slot_freed = asyncio.Event()

    async def _wait_for_capacity(self, timeout: float) -> None:
        """Wait until this gateway frees a slot, a backend changes health, or ``timeout`` s."""
        waiters = [asyncio.ensure_future(self._slot_freed.wait()),
                   asyncio.ensure_future(self.dit_pool.wait_changed(timeout))]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def _consume_dit(self, call: grpc.aio.UnaryStreamCall, state: _SlotState, index: int,
                           dit: Backend, emit: Emit) -> pb.Image:
        """Read the DiT stream after ``Reserved`` until the final image."""
        phases = pb.DiTProgress.Phase
        address = dit.address
        stream = ProgressWatch(call, dit.health)
        try:
            while True:
                msg = await stream.read()
                if msg is grpc.aio.EOF:
                    raise _StageFailure("dit", "EOF", "stream ended without an image", address)
                kind = msg.WhichOneof("event")
                if kind == "conditions_complete":
                    state.complete.set()
                elif kind == "progress":
                    p = msg.progress
                    if p.phase == phases.DENOISING:
                        emit(StageProgress(index, "dit", "denoising", step=p.step,
                                           total_steps=p.total_steps))
                    elif p.phase == phases.DECODING:
                        emit(StageProgress(index, "dit", "vae_decoding", step=p.step,
                                           total_steps=p.total_steps))
                elif kind == "image":
                    if msg.image.partial:
                        emit(PartialImage(index, msg.image.partial_index, msg.image.data))
                        continue
                    state.complete.set()
                    return msg.image
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise _deadline_error("in the DiT stage") from exc
            if exc.code() in FATAL_CODES:
                raise BackendError(f"the DiT at {address} failed: {exc.code().name} "
                                   f"{exc.details()}") from exc
            raise _StageFailure("dit", exc.code().name, exc.details() or "", address) from exc
        finally:
            call.cancel()

    # ---------------------------------------------------------------- AR

    async def _run_ar(self, job: ImageJob, index: int, seed: int, pipeline_id: str, epoch: int,
                      dit: Backend, token: str, deadline: float, state: _SlotState,
                      emit: Emit) -> pb.ARDone:
        """One AR attempt (``epoch``): pick a replica (not a failed one), stream it to ARDone.

        ``RESOURCE_EXHAUSTED`` moves to another replica / waits within the deadline (same epoch:
        nothing was pushed). Other failures raise `_StageFailure`.
        """
        request = pb.ARGenerateRequest(
            request_id=pipeline_id, epoch=epoch, prompt=job.prompt,
            negative_prompt=job.negative_prompt, width=job.width, height=job.height, seed=seed,
            sampling=pb.SamplingParams(), ar_guidance_scale=job.ar_guidance_scale,
            dit_address=dit.address, reservation_token=token, grid_width=job.ar_grid[0],
            grid_height=job.ar_grid[1], decoding=decoding.to_proto(job.decoding))
        backoff = 0.05
        full: set[str] = set()
        while True:
            remaining = _remaining(deadline)
            if remaining <= 0:
                raise _deadline_error("waiting for an AR replica")
            ar = (self.ar_pool.pick(exclude=state.excluded_ars | full)
                  or self.ar_pool.pick(exclude=full))
            if ar is None:
                self._fail_if_unavailable(self.ar_pool, "AR")
                full.clear()
                await self.ar_pool.wait_changed(min(backoff, remaining))
                backoff = min(backoff * 2, 1.0)
                continue
            state.ar_address = ar.address
            state.ar_started_unix_ms = time.time() * 1e3
            with self.ar_pool.lease(ar), tracing.span(
                    "mammoth.v1.AR/Generate", kind="CLIENT",
                    attributes={"mammoth.epoch": epoch, "server.address": ar.address}):
                call = ar.stub.Generate(request, timeout=remaining,
                                        metadata=tracing.inject(self._metadata))
                stream = ProgressWatch(call, ar.health)
                try:
                    while True:
                        msg = await stream.read()
                        if msg is grpc.aio.EOF:
                            raise _StageFailure("ar", "EOF", "stream ended without ARDone",
                                                ar.address)
                        kind = msg.WhichOneof("event")
                        if kind == "progress":
                            emit(StageProgress(index, "ar", "decoding_tokens",
                                               tokens_generated=msg.progress.tokens_generated,
                                               total_tokens=msg.progress.total_tokens, epoch=epoch))
                        elif kind == "done":
                            return msg.done
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        full.add(ar.address)
                        continue
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise _deadline_error("in the AR stage") from exc
                    if code == grpc.StatusCode.INVALID_ARGUMENT and "DiT" not in (exc.details() or ""):
                        # the AR refused the request itself (a push refused by the DiT names it)
                        raise InvalidRequestError(
                            f"the AR stage rejected the request: {exc.details()}") from exc
                    if code in FATAL_CODES:
                        raise BackendError(f"the AR at {ar.address} refused the call: "
                                           f"{code.name} {exc.details()}") from exc
                    if code == grpc.StatusCode.UNAVAILABLE:
                        self.ar_pool.mark_failed(ar)
                    raise _StageFailure("ar", code.name, exc.details() or "", ar.address,
                                        refusal=refusal_of(exc)) from exc
                finally:
                    call.cancel()

    # ---------------------------------------------------------------- both

    async def _run_with_slot(self, job: ImageJob, index: int, seed: int, pipeline_id: str,
                             dit: Backend, call: grpc.aio.UnaryStreamCall, reserved: pb.Reserved,
                             deadline: float, emit: Emit, epoch: int) -> tuple[ImageResult, int]:
        """Drive the AR (with epoch retries) and the DiT stream of one held slot to the image.

        Returns the result and the last epoch used. Raises `_StageFailure` (stage ``dit``) when the
        DiT failed: the caller retries from scratch.
        """
        state = _SlotState()
        dit_task = asyncio.create_task(self._consume_dit(call, state, index, dit, emit))
        ar_task: asyncio.Task | None = None
        ar_attempts = 0
        try:
            while True:
                if ar_task is None and state.ar_done is None and not state.conditions_complete:
                    if ar_attempts >= MAX_AR_ATTEMPTS:
                        raise BackendError(f"the AR stage failed {ar_attempts} times")
                    epoch += 1
                    ar_attempts += 1
                    ar_task = asyncio.create_task(self._run_ar(
                        job, index, seed, pipeline_id, epoch, dit, reserved.reservation_token,
                        deadline, state, emit))
                remaining = _remaining(deadline)
                if remaining <= 0:
                    raise _deadline_error("before the image was done")
                waiting = {dit_task} if ar_task is None else {dit_task, ar_task}
                done, _ = await asyncio.wait(waiting, timeout=remaining,
                                             return_when=asyncio.FIRST_COMPLETED)
                if dit_task in done:
                    image = dit_task.result()  # raises _StageFailure / GatewayError
                    if ar_task is not None and not ar_task.done():
                        # The AR sent its last row (the DiT had every row); its ARDone (usage,
                        # timings) follows within milliseconds unless the host is loaded: wait for
                        # it up to AR_DONE_GRACE_SECONDS, never past the deadline.
                        await asyncio.wait({ar_task},
                                           timeout=min(AR_DONE_GRACE_SECONDS, max(0.0, _remaining(deadline))))
                    if ar_task is not None and ar_task.done() and not ar_task.cancelled() \
                            and ar_task.exception() is None:
                        state.ar_done = ar_task.result()
                    return self._result(index, seed, image, state, epoch, dit), epoch
                if ar_task is not None and ar_task in done:
                    finished, ar_task = ar_task, None
                    exc = finished.exception()
                    if exc is None:
                        state.ar_done = finished.result()
                        continue
                    if isinstance(exc, GatewayError):
                        raise exc
                    if not isinstance(exc, _StageFailure):
                        raise exc
                    if exc.refusal == pb.CONDITIONS_COMPLETE:
                        # the DiT holds every row already: nothing to retry, and no AR failed
                        logger.info("request %s image %d: the DiT refused a push of epoch %d, its "
                                    "conditions are complete", job.request_id, index, epoch)
                        state.complete.set()
                        continue
                    # a dying DiT often takes the AR's push down with it, and a ConditionsComplete
                    # may be on its way on the other stream: let the DiT speak first
                    await _wait_first({dit_task}, state.complete, AR_FAILURE_GRACE_SECONDS)
                    if dit_task.done() or state.conditions_complete:
                        continue
                    logger.warning("request %s image %d: AR failed before the DiT had every row "
                                   "(%s); retrying with epoch %d", job.request_id, index, exc,
                                   epoch + 1)
                    state.excluded_ars.add(exc.address)
                    self.metrics.retries_total.labels("ar", exc.code).inc()
        finally:
            for task in (dit_task, ar_task):
                if task is not None and not task.done():
                    task.cancel()
            pending = [t for t in (dit_task, ar_task) if t is not None]
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*pending, return_exceptions=True)

    def _result(self, index: int, seed: int, image: pb.Image, state: _SlotState, epoch: int,
                dit: Backend) -> ImageResult:
        done = state.ar_done
        t = image.timings
        timings: dict[str, float] = {}
        if done is not None:
            prefill_ms = done.prefill_ms
            if done.last_row_unix_ms and state.ar_started_unix_ms:
                # AR call -> first rows sent: tokenisation and engine admission count as prefill
                # (wall clocks of gateway and AR, like the transfer tail's; never below the AR's own)
                wall_ms = done.last_row_unix_ms - state.ar_started_unix_ms - done.decode_ms
                prefill_ms = max(prefill_ms, wall_ms)
            timings["ar_prefill"] = prefill_ms / 1e3
            timings["ar_decode"] = done.decode_ms / 1e3
        timings["transfer"] = t.transfer_tail_ms / 1e3
        timings["dit_denoise"] = t.denoise_ms / 1e3
        timings["dit_vae"] = t.vae_ms / 1e3
        timings["dit_encode"] = t.encode_ms / 1e3
        for stage, seconds in timings.items():
            self.metrics.stage_duration.labels(stage).observe(seconds)
        return ImageResult(
            index=index, seed=seed, data=image.data, format=image.format or "png",
            width=image.width, height=image.height,
            prompt_tokens=done.prompt_tokens if done is not None else 0,
            generated_tokens=done.generated_tokens if done is not None else 0,
            epoch=epoch, dit_address=dit.address, ar_address=state.ar_address, timings=timings)


# ------------------------------------------------------------------------------------------------
# The endpoint
# ------------------------------------------------------------------------------------------------


@dataclass
class GatewayState:
    """Process-wide flags: ``draining`` after SIGTERM; ``active`` image requests."""

    draining: bool = False
    active: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


def _usage(results: list[ImageResult], job: ImageJob) -> ImageUsage:
    prompt = sum(r.prompt_tokens for r in results)
    generated = sum(r.generated_tokens for r in results)
    return ImageUsage(
        input_tokens=prompt, input_tokens_details=InputTokensDetails(text_tokens=prompt),
        output_tokens=generated, output_tokens_details=OutputTokensDetails(image_tokens=generated),
        total_tokens=prompt + generated, ar_grid="{}x{}".format(*job.ar_grid))


def _sse(event: str, payload: dict) -> bytes:
    """One server-sent event: ``event: <type>`` and a one-line JSON ``data``."""
    return f"event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class OpenAIServingImages:
    """``POST /v1/images/generations``: validation, admission, orchestration, response."""

    def __init__(self, settings: GatewaySettings, orchestrator: Orchestrator, store: ImageStore,
                 metrics: GatewayMetrics, state: GatewayState) -> None:
        self.settings = settings
        self.orchestrator = orchestrator
        self.store = store
        self.metrics = metrics
        self.state = state
        self.admission = AdmissionQueue(settings.queue_size, metrics)

    # ---------------------------------------------------------------- bookkeeping

    @contextlib.contextmanager
    def _track(self) -> Iterator[None]:
        self.state.active += 1
        self.state.idle.clear()
        self.metrics.active_requests.inc()
        try:
            yield
        finally:
            self.state.active -= 1
            self.metrics.active_requests.dec()
            if self.state.active == 0:
                self.state.idle.set()

    def record(self, outcome: str, started: float) -> None:
        """Count one finished request with its ``outcome`` and latency."""
        self.metrics.requests_total.labels(outcome).inc()
        self.metrics.request_duration.labels(outcome).observe(time.perf_counter() - started)
        cause = CANCELLATION_CAUSES.get(outcome)
        if cause is not None:
            self.metrics.cancellations_total.labels(cause).inc()

    def _check_available(self) -> None:
        if self.state.draining:
            raise UnavailableError("the gateway is shutting down; retry on another replica",
                                   code="draining", retry_after=RETRY_AFTER_SECONDS)
        for pool, name in ((self.orchestrator.ar_pool, "AR"), (self.orchestrator.dit_pool, "DiT")):
            if not pool.available():
                raise UnavailableError(f"no {name} backend is serving", code="no_backend",
                                       retry_after=max(RETRY_AFTER_SECONDS,
                                                       self.settings.health_interval_seconds))

    def _image_url(self, raw: Request, image_id: str) -> str:
        base = getattr(self.settings, "public_base_url", None) or str(raw.base_url)
        return f"{base.rstrip('/')}/v1/images/files/{image_id}"

    # ---------------------------------------------------------------- entry

    async def create_image(self, body: ImageGenerationRequest, raw: Request,
                           request_id: str) -> JSONResponse | StreamingResponse:
        """Validate, admit and run the request (errors raise `GatewayError` before any stage work).

        Raises:
            GatewayError: validation (400/404), overload (429/503).
        """
        job = resolve_request(body, self.settings, request_id)
        self._check_available()
        ticket = self.admission.enter(job.n)
        logger.info("request %s: n=%d size=%s ar_grid=%dx%d steps=%d seed=%d user=%s", request_id,
                    job.n, job.size, *job.ar_grid, job.num_inference_steps, job.seed,
                    job.safety_identifier)
        budget = request_budget(raw.headers, self.settings.request_timeout_seconds, job.stream)
        deadline = asyncio.get_running_loop().time() + budget
        if job.stream:
            keepalive = keepalive_interval(raw.headers, SSE_KEEPALIVE_SECONDS)
            return StreamingResponse(
                self._stream(job, raw, ticket, deadline, keepalive), media_type="text/event-stream",
                headers={"x-request-id": request_id, "cache-control": "no-cache",
                         "x-accel-buffering": "no"})
        started = getattr(raw.state, "started", None)
        with self._track():
            try:
                results = await self._run_all(job, ticket, deadline, emit=lambda _e: None)
            finally:
                ticket.leave()
        body = self._response(job, results, raw).model_dump(exclude_none=True)
        # The slowest image decides the latency: its breakdown goes into Server-Timing.
        slowest = max(results, key=lambda r: sum(r.timings.values()))
        total = None if started is None else time.perf_counter() - started
        return JSONResponse(body, headers={"x-request-id": request_id,
                                           "server-timing": server_timing(slowest.timings, total)})

    async def _run_all(self, job: ImageJob, ticket: AdmissionTicket, deadline: float,
                       emit: Emit) -> list[ImageResult]:
        """n pipelines in parallel; the first failure cancels the others and is raised."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.orchestrator.generate_image(
                    job, i, deadline, emit, ticket.image_reserved)) for i in range(job.n)]
        except BaseExceptionGroup as eg:  # noqa: F821 - builtin in 3.11
            raise _first_error(eg) from None
        return [t.result() for t in tasks]

    def _response(self, job: ImageJob, results: list[ImageResult], raw: Request) -> ImagesResponse:
        data = []
        for r in results:
            if job.response_format == "url":
                data.append(ImageObject(url=self._image_url(raw, self.store.put(r.data, r.format)),
                                        seed=r.seed))
            else:
                data.append(ImageObject(b64_json=base64.b64encode(r.data).decode(), seed=r.seed))
        return ImagesResponse(
            created=int(time.time()), data=data, usage=_usage(results, job),
            output_format=job.output_format, quality=job.quality, size=job.size,
            safety_identifier=job.safety_identifier, seed=job.seed,
            num_inference_steps=job.num_inference_steps,
            text_guidance_scale=job.text_guidance_scale, cfg_range=job.cfg_range)

    # ---------------------------------------------------------------- streaming

    async def _stream(self, job: ImageJob, raw: Request, ticket: AdmissionTicket,
                      deadline: float, keepalive: float = SSE_KEEPALIVE_SECONDS) -> AsyncIterator[bytes]:
        """SSE body: partial images as they come (and, for clients that opted in with
        ``stream_progress``, the ``image_generation.progress`` extension events), one completed
        event per image in index order, an ``error`` event on failure; a keep-alive comment every
        ``keepalive`` seconds without events. Cancelled on client disconnect."""
        started = time.perf_counter()
        request_started = getattr(raw.state, "started", started)  # RequestIdMiddleware's clock
        outcome = "cancelled"
        queue: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []

        def emit(event: object) -> None:
            queue.put_nowait(event)

        async def run(i: int) -> None:
            try:
                result = await self.orchestrator.generate_image(job, i, deadline, emit,
                                                                ticket.image_reserved)
                queue.put_nowait(result)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - reported to the client as an event
                queue.put_nowait(exc)

        with self._track():
            try:
                tasks = [asyncio.create_task(run(i)) for i in range(job.n)]
                finished: dict[int, ImageResult] = {}
                next_index = 0
                while next_index < job.n:
                    try:
                        item = await asyncio.wait_for(queue.get(), keepalive)
                    except asyncio.TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    now = int(time.time())
                    if isinstance(item, BaseException):
                        outcome = outcome_of(item)
                        status, info, _ = error_info(item)
                        yield _sse("error", ErrorResponse(error=info).model_dump())
                        return
                    if isinstance(item, StageProgress):
                        if not job.stream_progress:
                            continue  # an extension event: only for clients that asked for it
                        ev = ProgressEvent(created_at=now, image_index=item.index, stage=item.stage,
                                           phase=item.phase, tokens_generated=item.tokens_generated,
                                           total_tokens=item.total_tokens, step=item.step,
                                           total_steps=item.total_steps, epoch=item.epoch)
                        yield _sse(ev.type, ev.model_dump(exclude_none=True))
                    elif isinstance(item, PartialImage):
                        ev = ImageGenPartialImageEvent(
                            b64_json=base64.b64encode(item.data).decode(), created_at=now,
                            output_format=job.output_format, partial_image_index=item.partial_index,
                            quality=job.quality, size=job.size, image_index=item.index)
                        yield _sse(ev.type, ev.model_dump(exclude_none=True))
                    elif isinstance(item, ImageResult):
                        finished[item.index] = item
                        while next_index in finished:
                            r = finished.pop(next_index)
                            url = (self._image_url(raw, self.store.put(r.data, r.format))
                                   if job.response_format == "url" else None)
                            ev = ImageGenCompletedEvent(
                                b64_json=base64.b64encode(r.data).decode(), created_at=now,
                                output_format=job.output_format, quality=job.quality,
                                size=job.size, usage=_usage([r], job),
                                safety_identifier=job.safety_identifier, image_index=r.index,
                                seed=r.seed, url=url,
                                timings=timings_ms(r.timings, time.perf_counter() - request_started))
                            yield _sse(ev.type, ev.model_dump(exclude_none=True))
                            next_index += 1
                outcome = "success"
            finally:
                ticket.leave()
                for t in tasks:
                    t.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(*tasks, return_exceptions=True)
                self.record(outcome, started)


def _first_error(eg: BaseExceptionGroup) -> BaseException:  # noqa: F821
    """The most telling exception of a task group: a GatewayError first, else the first one."""
    flat: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):  # noqa: F821
            for sub in e.exceptions:
                walk(sub)
        else:
            flat.append(e)

    walk(eg)
    for e in flat:
        if isinstance(e, GatewayError):
            return e
    for e in flat:
        if isinstance(e, _StageFailure):
            return BackendError(str(e))
    return flat[0]
