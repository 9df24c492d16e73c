"""The engine client: runs a request's images through the two stages and yields typed events.

Per image (DESIGN.md, "Request path"):

1. reserve a DiT slot (`gateway.stage_calls.StageCalls.reserve`: ``DiT.Generate`` with the
   `ImageParams`, read ``Reserved{reservation_token}``);
2. open ``AR.Generate`` with the prompt, size, seed, guidance, ``dit_address`` (the address the
   gateway dialled) and the token;
3. read both streams concurrently: AR progress (tokens), DiT progress (steps), DiT partial images,
   and the final DiT ``Image``.

Failure rules (`gateway.stage_errors`: one classifier, pure retry rules): an AR failure before the
DiT said ``ConditionsComplete`` (its explicit event: every condition row is resident) is retried on
another AR with the same request id and ``epoch + 1`` (the slot survives); after that event no AR
retry starts, and an AR failure is harmless. A push the DiT refused because the conditions are
already complete (the origin reason CONDITIONS_COMPLETE, relayed by the AR) is not an AR failure:
it is neither retried nor counted. A DiT failure drops the slot and starts over (new slot, new AR
run) while the deadline allows. Every RPC carries ``timeout = deadline - now``. Closing the event
generator (client disconnect) cancels both calls; the DiT frees the slot when its ``Generate``
stream closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

import anyio
import grpc

from gateway.backends import Backend, BackendPool
from gateway.errors import BackendError
from gateway.events import Emit, Event, Failed, Idle, ImageReady, ImageResult, Progress
from gateway.image_job import ImageJob
from gateway.metrics import GatewayMetrics
from gateway.stage_calls import SlotState, StageCalls, deadline_error, remaining
from gateway.stage_errors import (MAX_DIT_ATTEMPTS, ARVerdict, StageFailure, after_ar_failure,
                                  after_dit_failure, check_ar_attempts)
from mammoth_core import grpc_common, tracing
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.settings import GatewaySettings

logger = logging.getLogger(__name__)

#: After the image arrived, how long to wait for the AR's ARDone (usage and AR timings), seconds.
AR_DONE_GRACE_SECONDS = 10.0
#: After an AR failure, how long the DiT stream may take to say it failed too or that the
#: conditions are complete (then no AR retry starts), seconds.
AR_FAILURE_GRACE_SECONDS = 0.1


class EngineClient:
    """Runs the per-image pipelines of a request against the AR and DiT pools.

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
        self.calls = StageCalls(ar_pool, dit_pool, metrics, grpc_common.auth_metadata(auth_token),
                                settings.health_interval_seconds)

    async def generate(self, job: ImageJob, deadline: float, on_reserved: Callable[[], None],
                       heartbeat: float | None = None,
                       visible: Callable[[Event], bool] | None = None) -> AsyncIterator[Event]:
        """The events of ``job``'s ``n`` images, run in parallel (image i with seed ``seed + i``):
        `Progress` and `PartialImage` as they happen, one `ImageReady` per image (in the order they
        finish), `Idle` after ``heartbeat`` seconds without a visible event, and on the first failure
        one `Failed` as the last event (the other images are cancelled). Closing the generator
        (``contextlib.aclosing``) cancels every call of the request.

        Args:
            deadline: event-loop time (s) by which every image must be done.
            on_reserved: called once per image, the first time it holds a DiT slot.
            heartbeat: seconds of silence toward the client before an `Idle` (None: never).
            visible: whether an event reaches the client (resets the silence); None: every event
                does. A stream without progress events writes nothing for `Progress`, so without
                this a request whose stages report every step would never be `Idle` and its client
                would read nothing until the image.
        """
        queue: asyncio.Queue[Event] = asyncio.Queue()

        async def run(index: int) -> None:
            try:
                result = await self.generate_image(job, index, deadline, queue.put_nowait,
                                                   on_reserved)
                queue.put_nowait(ImageReady(result))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - reported to the client as an event
                queue.put_nowait(Failed(BackendError(str(exc)) if isinstance(exc, StageFailure)
                                        else exc))

        tasks = [asyncio.create_task(run(i)) for i in range(job.n)]
        loop = asyncio.get_running_loop()
        try:
            ready, last_visible = 0, loop.time()
            while ready < job.n:
                wait = None if heartbeat is None else max(0.0, last_visible + heartbeat - loop.time())
                try:
                    event = await asyncio.wait_for(queue.get(), wait)
                except asyncio.TimeoutError:
                    last_visible = loop.time()
                    yield Idle()
                    continue
                if visible is None or visible(event):
                    last_visible = loop.time()
                yield event
                if isinstance(event, Failed):
                    return
                ready += isinstance(event, ImageReady)
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def generate_image(self, job: ImageJob, index: int, deadline: float, emit: Emit,
                             on_reserved: Callable[[], None]) -> ImageResult:
        """Run image ``index`` of ``job`` (seed ``job.seed + index``) to its final image.

        Args:
            deadline: event-loop time (s) by which the image must be done.
            emit: receives `Progress` and `PartialImage` events as they happen.
            on_reserved: called once, the first time a DiT slot is held.

        Raises:
            DeadlineExceededError: the deadline passed.
            InvalidRequestError: a stage rejected the request (INVALID_ARGUMENT of its own).
            BackendError: a stage kept failing (retries exhausted) or refused the gateway.
        """
        seed = job.seed + index
        self.metrics.active_pipelines.inc()
        try:
            with tracing.span("gateway.image", attributes={"mammoth.image_index": index,
                                                           "mammoth.seed": seed}):
                return await self._dit_attempts(job, index, seed, deadline, emit, on_reserved)
        finally:
            self.metrics.active_pipelines.dec()

    async def _dit_attempts(self, job: ImageJob, index: int, seed: int, deadline: float,
                            emit: Emit, on_reserved: Callable[[], None]) -> ImageResult:
        """`generate_image`'s DiT attempts (a new slot each, `after_dit_failure`)."""
        loop = asyncio.get_running_loop()
        pipeline_id = f"{job.request_id}-{index}"
        epoch = -1
        reserved_once = False
        arrived = loop.time()  # a retry keeps its place in the line for a slot
        for dit_attempt in range(1, MAX_DIT_ATTEMPTS + 1):
            t_queue = loop.time()
            async with contextlib.AsyncExitStack() as stack:
                emit(Progress(index, "dit", "queued"))
                dit, call, reserved = await self.calls.reserve(job, pipeline_id, seed, deadline,
                                                               stack, arrived)
                queue_s = loop.time() - t_queue
                self.metrics.stage_duration.labels("queue").observe(queue_s)
                if not reserved_once:
                    reserved_once = True
                    on_reserved()
                emit(Progress(index, "dit", "reserved"))
                try:
                    result, epoch = await self._run_with_slot(
                        job, index, seed, pipeline_id, dit, call, reserved, deadline, emit, epoch)
                except StageFailure as failure:
                    give_up = after_dit_failure(failure, dit_attempt)
                    logger.warning("request %s image %d: DiT %s failed (%s); %s", job.request_id,
                                   index, dit.address, failure,
                                   "giving up" if give_up else "retrying from scratch")
                    if give_up is not None:
                        raise give_up from failure
                    self.metrics.retries_total.labels("dit", failure.code).inc()
                    continue
                result.dit_attempts = dit_attempt
                result.timings = {"queue": queue_s, **result.timings}
                return result
        raise AssertionError("unreachable")

    async def _run_with_slot(self, job: ImageJob, index: int, seed: int, pipeline_id: str,
                             dit: Backend, call: grpc.aio.UnaryStreamCall, reserved: pb.Reserved,
                             deadline: float, emit: Emit, epoch: int) -> tuple[ImageResult, int]:
        """Drive the AR (with epoch retries) and the DiT stream of one held slot to the image.

        Returns the result and the last epoch used. Raises `StageFailure` (stage ``dit``) when the
        DiT failed: the caller retries from scratch.
        """
        state = SlotState()
        dit_task = asyncio.create_task(self.calls.consume_dit(call, state, index, dit, emit))
        ar_task: asyncio.Task | None = None
        ar_attempts = 0
        try:
            while True:
                if ar_task is None and state.ar_done is None and not state.conditions_complete:
                    check_ar_attempts(ar_attempts)
                    epoch += 1
                    ar_attempts += 1
                    ar_task = asyncio.create_task(self.calls.run_ar(
                        job, index, seed, pipeline_id, epoch, dit, reserved.reservation_token,
                        deadline, state, emit))
                left = remaining(deadline)
                if left <= 0:
                    raise deadline_error("before the image was done")
                waiting = {dit_task} if ar_task is None else {dit_task, ar_task}
                done, _ = await asyncio.wait(waiting, timeout=left,
                                             return_when=asyncio.FIRST_COMPLETED)
                if dit_task in done:
                    image = dit_task.result()  # raises StageFailure / GatewayError
                    await self._collect_ar_done(ar_task, state, deadline)
                    return self._result(index, seed, image, state, epoch, dit), epoch
                if ar_task is not None and ar_task in done:
                    finished, ar_task = ar_task, None
                    await self._after_ar_attempt(finished, state, dit_task, job, index, epoch)
        finally:
            for task in (dit_task, ar_task):
                if task is not None and not task.done():
                    task.cancel()
            pending = [t for t in (dit_task, ar_task) if t is not None]
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*pending, return_exceptions=True)

    async def _after_ar_attempt(self, finished: asyncio.Task, state: SlotState,
                                dit_task: asyncio.Task, job: ImageJob, index: int,
                                epoch: int) -> None:
        """Record a finished AR attempt's ARDone, or apply `after_ar_failure` to its failure
        (a retry is started by the caller's loop unless the conditions are complete)."""
        exc = finished.exception()
        if exc is None:
            state.ar_done = finished.result()
            return
        if not isinstance(exc, StageFailure):
            raise exc
        verdict = after_ar_failure(exc, state.conditions_complete, dit_task.done())
        if verdict is ARVerdict.RETRY:
            # a dying DiT often takes the AR's push down with it, and a ConditionsComplete may be
            # on its way on the other stream: let the DiT speak first
            await _wait_first({dit_task}, state.complete, AR_FAILURE_GRACE_SECONDS)
            verdict = after_ar_failure(exc, state.conditions_complete, dit_task.done())
        if verdict is ARVerdict.CONDITIONS_COMPLETE:
            logger.info("request %s image %d: the DiT refused a push of epoch %d, its conditions "
                        "are complete", job.request_id, index, epoch)
            state.complete.set()
        elif verdict is ARVerdict.RETRY:
            logger.warning("request %s image %d: AR failed before the DiT had every row (%s); "
                           "retrying with epoch %d", job.request_id, index, exc, epoch + 1)
            state.excluded_ars.add(exc.address)
            self.metrics.retries_total.labels("ar", exc.code).inc()

    @staticmethod
    async def _collect_ar_done(ar_task: asyncio.Task | None, state: SlotState,
                               deadline: float) -> None:
        """After the image: the AR sent its last row (the DiT had every row); its ARDone (usage,
        timings) follows within milliseconds unless the host is loaded: wait for it up to
        `AR_DONE_GRACE_SECONDS`, never past the deadline."""
        if ar_task is None:
            return
        if not ar_task.done():
            await asyncio.wait({ar_task},
                               timeout=min(AR_DONE_GRACE_SECONDS, max(0.0, remaining(deadline))))
        if ar_task.done() and not ar_task.cancelled() and ar_task.exception() is None:
            state.ar_done = ar_task.result()

    def _result(self, index: int, seed: int, image: pb.Image, state: SlotState, epoch: int,
                dit: Backend) -> ImageResult:
        """The `ImageResult` of a finished image, its stage timings observed in the metrics."""
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


async def _wait_first(tasks: set[asyncio.Task], event: asyncio.Event, timeout: float) -> None:
    """Wait until one of ``tasks`` is done or ``event`` is set, at most ``timeout`` seconds."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({*tasks, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
