"""The gateway's calls to the stages: reserve a DiT slot, read the DiT stream, run one AR attempt.

Each call carries ``timeout = deadline - now`` and the stage token; every failure goes through
`gateway.stage_errors.classify` (one classifier), so a call either returns, raises a
`gateway.errors.GatewayError` for the client, or raises a retryable
`gateway.stage_errors.StageFailure`. The retry policy around them is
`gateway.engine_client.EngineClient`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from gateway.admission import require_available
from gateway.backends import Backend, BackendPool
from gateway.errors import DeadlineExceededError, GatewayError
from gateway.events import Emit, PartialImage, Progress
from gateway.image_job import ImageJob
from gateway.metrics import GatewayMetrics
from gateway.progress_watch import ProgressWatch
from gateway.stage_errors import StageFailure, classify
from mammoth_core import decoding, tracing
from mammoth_core.pb import mammoth_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass
class SlotState:
    """What the two streams of one held DiT slot share."""

    #: Set when the DiT said ``ConditionsComplete`` (or refused a push for it): no AR retry after.
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    ar_address: str = ""
    ar_done: pb.ARDone | None = None
    ar_started_unix_ms: float = 0.0
    excluded_ars: set[str] = field(default_factory=set)

    @property
    def conditions_complete(self) -> bool:
        return self.complete.is_set()


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (event-loop time)."""
    return deadline - asyncio.get_running_loop().time()


def deadline_error(what: str) -> DeadlineExceededError:
    """The 504 saying where the request's time ran out."""
    return DeadlineExceededError(f"the request's time budget ran out {what}")


def image_params(job: ImageJob, seed: int) -> pb.ImageParams:
    """The DiT's ``ImageParams`` of ``job``'s image with ``seed``."""
    return pb.ImageParams(
        width=job.width, height=job.height, num_inference_steps=job.num_inference_steps,
        text_guidance_scale=job.text_guidance_scale, cfg_range_start=job.cfg_range[0],
        cfg_range_end=job.cfg_range[1], seed=seed, output_format=job.output_format,
        output_compression=job.output_compression, partial_images=job.partial_images,
        has_negative=bool(job.negative_prompt),
        dit_cache=None if job.dit_cache is None else pb.DiTCache(threshold=job.dit_cache[0],
                                                                 warmup_steps=job.dit_cache[1]))


#: The DiT-slot line's poll interval: first and longest (seconds; `StageCalls.reserve`).
_FIRST_POLL_S, _LAST_POLL_S = 0.05, 1.0
#: Seconds a DiT may take to answer a reservation before the next replica is tried beside it
#: (`StageCalls._reserve_on_some`); a serving DiT answers in milliseconds.
_HEDGE_S = 0.25


@dataclass(eq=False)
class _Place:
    """A request's place in the line for a DiT slot: when it first asked (event-loop seconds) and
    the event set when it should try."""

    arrived: float
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class StageCalls:
    """The AR and DiT calls of one gateway.

    Args:
        ar_pool, dit_pool: the stage backends.
        metrics: gateway metrics.
        metadata: call metadata (the stage token, `mammoth_core.grpc_common.auth_metadata`).
        health_interval_seconds: the backends' health interval (``no_backend``'s Retry-After).
    """

    def __init__(self, ar_pool: BackendPool, dit_pool: BackendPool, metrics: GatewayMetrics,
                 metadata: tuple[tuple[str, str], ...], health_interval_seconds: float) -> None:
        self.ar_pool = ar_pool
        self.dit_pool = dit_pool
        self.metrics = metrics
        self._metadata = metadata
        self._health_interval = health_interval_seconds
        #: requests waiting for a DiT slot, in arrival order (`reserve`)
        self._line: list[_Place] = []
        #: seconds the head of the line waits before trying again unwoken (for slots freed by other
        #: gateways): 0.05 doubling to 1 while the line lasts, 0.05 again once it is empty
        self._poll_interval = _FIRST_POLL_S
        #: after this gateway freed a slot and until someone reserves one: the head's next retry
        #: interval (0.05 s doubling), or None
        self._release_poll: float | None = None

    # ---------------------------------------------------------------- DiT

    async def reserve(self, job: ImageJob, pipeline_id: str, seed: int, deadline: float,
                      stack: contextlib.AsyncExitStack, arrived: float | None = None,
                      ) -> tuple[Backend, grpc.aio.UnaryStreamCall, pb.Reserved]:
        """Open ``DiT.Generate`` on some replica until one answers ``Reserved``.

        When every replica is full the request joins this gateway's line of waiters (and a request
        that finds a line joins it before trying), ordered by ``arrived`` (the event loop's time of
        the image's first attempt; now by default): a retry after a failed DiT keeps its place.
        Only the head of the line tries again: when this gateway frees a slot (the DiT may free it
        a step later, so the poll interval restarts), when a backend changes health, or after the
        line's poll interval (0.05 s doubling to 1 s: slots freed by other gateways); the others
        wait for their turn. So a freed slot goes to the request that has waited longest and costs
        one ``Generate``, not one per waiter.

        The call, its in-flight lease and the ``slots_in_use`` gauge are released by ``stack``.

        Raises:
            GatewayError: 504 at the deadline, 503 with no DiT available, or what `classify` says.
        """
        request = pb.DiTGenerateRequest(request_id=pipeline_id, params=image_params(job, seed))
        metadata = tracing.inject(self._metadata)  # the image's span is the DiT's parent
        arrived = asyncio.get_running_loop().time() if arrived is None else arrived
        turn: _Place | None = self._join_line(arrived) if self._line else None
        try:
            while True:
                if turn is None or self._line[0] is turn:
                    got = await self._reserve_on_some(request, metadata, deadline)
                    if got is not None:
                        dit, (lease, call, reserved) = got
                        stack.callback(lease.__exit__, None, None, None)
                        stack.callback(self._release_slot, call)
                        self.metrics.slots_in_use.inc()
                        self._release_poll = None
                        return dit, call, reserved
                    turn = turn or self._join_line(arrived)
                left = remaining(deadline)
                if left <= 0:
                    raise deadline_error("waiting for a DiT slot")
                require_available(self.dit_pool, "DiT", self._health_interval)
                if self._line[0] is turn:
                    await self._wait_for_capacity(turn, min(self._next_poll(), left))
                else:
                    await self._wait_for_capacity(turn, left)
        finally:
            if turn is not None:
                self._leave_line(turn)

    def _next_poll(self) -> float:
        """Seconds the head waits before trying again unwoken: the release's short interval while
        one is unclaimed, else the line's (each doubles per use, up to 1 s)."""
        if self._release_poll is not None:
            interval = self._release_poll
            self._release_poll = interval * 2 if interval * 2 <= _LAST_POLL_S else None
            return interval
        interval = self._poll_interval
        self._poll_interval = min(interval * 2, _LAST_POLL_S)
        return interval

    def _join_line(self, arrived: float) -> _Place:
        """A place in the line after every waiter that arrived no later than ``arrived``."""
        turn = _Place(arrived)
        at = len(self._line)
        while at > 0 and self._line[at - 1].arrived > arrived:
            at -= 1
        self._line.insert(at, turn)
        return turn

    def _leave_line(self, turn: _Place) -> None:
        """Leave the line (reserved, failed, cancelled or out of time); the next head tries now."""
        head = self._line[0] is turn
        self._line.remove(turn)
        if not self._line:
            self._poll_interval = _FIRST_POLL_S
        elif head:
            self._line[0].wake.set()

    async def _reserve_on_some(self, request: pb.DiTGenerateRequest, metadata, deadline: float):
        """``(backend, (lease, call, Reserved))`` from the first replica (in `BackendPool.pick` order)
        that reserves a slot, or None when every serving replica refused.

        Replicas are tried one at a time, but one that has not answered within `_HEDGE_S` (hung,
        or its event loop starved) gets the next replica tried beside it (a hedged request, as in
        Dean and Barroso, "The Tail at Scale"): the head of the line is not held by one silent DiT
        while another has a free slot. The first ``Reserved`` wins; every other attempt is
        cancelled, and a second ``Reserved`` released at once.

        Raises:
            GatewayError: 504 at the deadline, or what `classify` says of an attempt.
        """
        tried: set[str] = set()
        attempts: dict[asyncio.Future, Backend] = {}
        try:
            while True:
                if remaining(deadline) <= 0:
                    raise deadline_error("waiting for a DiT slot")
                dit = self.dit_pool.pick(exclude=tried)
                if dit is not None:
                    tried.add(dit.address)
                    attempts[asyncio.ensure_future(self._try_reserve(dit, request, metadata, deadline))] = dit
                if not attempts:
                    return None
                done, _ = await asyncio.wait(attempts, timeout=_HEDGE_S if dit is not None else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                for attempt in done:
                    backend = attempts.pop(attempt)
                    held = attempt.result()
                    if held is not None:
                        return backend, held
        finally:
            for attempt in attempts:
                if not attempt.done():
                    attempt.cancel()  # `_try_reserve` cancels its call and lease
                elif not attempt.cancelled() and attempt.exception() is None and attempt.result() is not None:
                    lease, call, _ = attempt.result()  # a second slot: give it back
                    call.cancel()
                    lease.__exit__(None, None, None)

    async def _try_reserve(self, dit: Backend, request: pb.DiTGenerateRequest, metadata,
                           deadline: float):
        """``(lease, call, Reserved)`` from ``dit``, or None when it cannot take the image now."""
        lease = self.dit_pool.lease(dit)
        lease.__enter__()
        call = dit.stub.Generate(request, timeout=remaining(deadline), metadata=metadata)
        try:
            first = await ProgressWatch(call, dit.health).read()
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            lease.__exit__(None, None, None)
            verdict = classify(exc, "dit", dit.address, "waiting for a DiT slot")
            if isinstance(verdict, GatewayError):
                raise verdict from exc
            if verdict.down:
                self.dit_pool.mark_failed(dit)
            if not verdict.full:
                logger.warning("DiT %s refused a reservation: %s", dit.address, verdict)
            return None
        except BaseException:
            call.cancel()
            lease.__exit__(None, None, None)
            raise
        if first is grpc.aio.EOF or first.WhichOneof("event") != "reserved":
            call.cancel()
            lease.__exit__(None, None, None)
            logger.warning("DiT %s answered Generate without Reserved", dit.address)
            return None
        return lease, call, first.reserved

    def _release_slot(self, call: grpc.aio.UnaryStreamCall) -> None:
        call.cancel()
        self.metrics.slots_in_use.dec()
        if self._line:  # the slot goes to the longest waiter
            # a cancelled call's slot is free only when the DiT's current step ends: the head looks
            # again at 0.05 s doubling until it gets one (or 1 s has passed)
            self._release_poll = _FIRST_POLL_S
            self._line[0].wake.set()

    async def _wait_for_capacity(self, turn: _Place, timeout: float) -> None:
        """Wait until ``turn`` is woken (a freed slot, or its turn came), a backend changes health,
        or ``timeout`` s; the wake-up is cleared for the next wait."""
        waiters = [asyncio.ensure_future(turn.wake.wait()),
                   asyncio.ensure_future(self.dit_pool.wait_changed(timeout))]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            turn.wake.clear()

    async def consume_dit(self, call: grpc.aio.UnaryStreamCall, state: SlotState, index: int,
                          dit: Backend, emit: Emit) -> pb.Image:
        """Read the DiT stream after ``Reserved`` until the final image.

        Raises:
            StageFailure: the DiT failed (the caller starts over with a new slot).
            GatewayError: what `classify` says (deadline, configuration).
        """
        return await self._read(call, dit, self.dit_pool, "dit", "an image", "in the DiT stage",
                                lambda msg: self._dit_event(msg, state, index, emit))

    @staticmethod
    def _dit_event(msg: pb.DiTGenerateResponse, state: SlotState, index: int,
                   emit: Emit) -> pb.Image | None:
        """Handle one DiT stream message; the final image when it is one."""
        kind = msg.WhichOneof("event")
        if kind == "conditions_complete":
            state.complete.set()
        elif kind == "progress":
            p = msg.progress
            phase = {pb.DiTProgress.DENOISING: "denoising",
                     pb.DiTProgress.DECODING: "vae_decoding"}.get(p.phase)
            if phase is not None:
                emit(Progress(index, "dit", phase, step=p.step, total_steps=p.total_steps))
        elif kind == "image":
            if msg.image.partial:
                emit(PartialImage(index, msg.image.partial_index, msg.image.data))
                return None
            state.complete.set()
            return msg.image
        return None

    # ---------------------------------------------------------------- AR

    async def run_ar(self, job: ImageJob, index: int, seed: int, pipeline_id: str, epoch: int,
                     dit: Backend, token: str, deadline: float, state: SlotState,
                     emit: Emit) -> pb.ARDone:
        """One AR attempt (``epoch``): pick a replica (not a failed one), stream it to ARDone.

        A replica answering ``RESOURCE_EXHAUSTED`` of its own (`StageFailure.full`) moves the
        attempt to another replica, waiting within the deadline when all are full (same epoch:
        nothing was pushed).

        Raises:
            StageFailure: the attempt failed (the caller decides on a retry).
            GatewayError: what `classify` says, 504 at the deadline, 503 with no AR available.
        """
        request = pb.ARGenerateRequest(
            request_id=pipeline_id, epoch=epoch, prompt=job.prompt,
            negative_prompt=job.negative_prompt, width=job.width, height=job.height, seed=seed,
            ar_guidance_scale=job.ar_guidance_scale,
            dit_address=dit.address, reservation_token=token, grid_width=job.ar_grid[0],
            grid_height=job.ar_grid[1], decoding=decoding.to_proto(job.decoding))
        backoff = 0.05
        full: set[str] = set()
        while True:
            left = remaining(deadline)
            if left <= 0:
                raise deadline_error("waiting for an AR replica")
            ar = (self.ar_pool.pick(exclude=state.excluded_ars | full)
                  or self.ar_pool.pick(exclude=full))
            if ar is None:
                require_available(self.ar_pool, "AR", self._health_interval)
                full.clear()
                await self.ar_pool.wait_changed(min(backoff, left))
                backoff = min(backoff * 2, 1.0)
                continue
            try:
                return await self._ar_call(ar, request, epoch, index, deadline, state, emit)
            except StageFailure as failure:
                if not failure.full:
                    raise
                full.add(ar.address)

    async def _ar_call(self, ar: Backend, request: pb.ARGenerateRequest, epoch: int, index: int,
                       deadline: float, state: SlotState, emit: Emit) -> pb.ARDone:
        """``AR.Generate`` on ``ar`` to its ``ARDone``, relaying token progress."""
        state.ar_address = ar.address
        state.ar_started_unix_ms = time.time() * 1e3
        with self.ar_pool.lease(ar), tracing.span(
                "mammoth.v1.AR/Generate", kind="CLIENT",
                attributes={"mammoth.epoch": epoch, "server.address": ar.address}):
            call = ar.stub.Generate(request, timeout=remaining(deadline),
                                    metadata=tracing.inject(self._metadata))

            def on_message(msg: pb.ARGenerateResponse) -> pb.ARDone | None:
                kind = msg.WhichOneof("event")
                if kind == "progress":
                    emit(Progress(index, "ar", "decoding_tokens",
                                  tokens_generated=msg.progress.tokens_generated,
                                  total_tokens=msg.progress.total_tokens, epoch=epoch))
                return msg.done if kind == "done" else None

            return await self._read(call, ar, self.ar_pool, "ar", "ARDone", "in the AR stage",
                                    on_message)

    @staticmethod
    async def _read(call: grpc.aio.UnaryStreamCall, backend: Backend, pool: BackendPool,
                    stage: str, what: str, during: str,
                    on_message: Callable[[Any], Any]) -> Any:
        """Read the stream of ``call`` (under `ProgressWatch`) until ``on_message`` returns
        something other than None, and return that; the call is cancelled on the way out.

        Raises:
            StageFailure: the stream ended without ``what``, or `classify` says retry (a replica
                ``down`` is marked failed in ``pool`` first).
            GatewayError: what `classify` says.
        """
        stream = ProgressWatch(call, backend.health)
        try:
            while True:
                msg = await stream.read()
                if msg is grpc.aio.EOF:
                    raise StageFailure(stage, "EOF", f"stream ended without {what}", backend.address)
                result = on_message(msg)
                if result is not None:
                    return result
        except grpc.aio.AioRpcError as exc:
            verdict = classify(exc, stage, backend.address, during)
            if isinstance(verdict, StageFailure) and verdict.down:
                pool.mark_failed(backend)
            raise verdict from exc
        finally:
            call.cancel()
