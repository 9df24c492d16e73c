"""One ``AR.Generate`` call: `ARSession` owns what the call starts and must stop.

A session is built from a validated `ARPlan` (the tokenised request). It owns the request's
`DecodeJob` in the `DecodeEngine`, its `HiddenStateSender` (the ``DiT.PushConditions`` stream,
run as a task on the event loop), its tracing spans and its channel lease. The engine thread talks
to the event loop through one queue of typed `SessionEvent` s (`DecodeProgress`,
`DecodeFinished`, `PushEnded`); nothing else crosses threads.

The call's end is one of: `ARSession.progress` finishes (decoded and pushed, then `done_message`),
or it raises `CallFailed` naming the status (deadline, decode failure, push failure, the DiT
closing the stream early), or the call is cancelled. In every case `ARSession.close` cancels the job
(its KV cache is freed before the engine's next step), aborts the push, returns the channel lease,
counts the outcome and ends the spans; it is idempotent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable, Union

import grpc

from mammoth_core import decoding, tracing
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core import errors
from mammoth_core.errors import Reason, Stage
from mammoth_core.request_trace import write_request_trace
from stage_ar import metrics
from stage_ar.engine import (
    DecodeEngine, DecodeJob, EngineDeadlineExceeded, EngineFull, EngineStopped, JobStats, Role,
)
from stage_ar.sender import HiddenStateSender, SenderAborted

logger = logging.getLogger(__name__)

PB_ROLES = {Role.CONDITION: pb.CONDITION, Role.NEGATIVE: pb.NEGATIVE}


@dataclasses.dataclass(frozen=True)
class ARPlan:
    """A validated ``AR.Generate`` request, tokenised.

    Attributes:
        request: the request as received.
        prompt_ids / negative_ids: the text-to-image envelope and the negative prompt (or None).
        grid: ``(width, height)`` of the AR grid in cells.
        condition_rows: CONDITION rows the DiT will receive (prompt + ``height * (width + 1)``).
    """

    request: pb.ARGenerateRequest
    prompt_ids: list[int]
    negative_ids: list[int] | None
    grid: tuple[int, int]
    condition_rows: int

    @property
    def negative_rows(self) -> int:
        """NEGATIVE rows the DiT will receive (0: no negative prompt)."""
        return len(self.negative_ids) if self.negative_ids else 0


@dataclasses.dataclass(frozen=True)
class DecodeProgress:
    """Engine thread: ``tokens_generated`` of ``total_tokens`` grid tokens decoded."""

    tokens_generated: int
    total_tokens: int


@dataclasses.dataclass(frozen=True)
class DecodeFinished:
    """Engine thread: the job left the engine (``error`` None on success)."""

    error: BaseException | None
    stats: JobStats


@dataclasses.dataclass(frozen=True)
class PushEnded:
    """Event loop: the push task ended (acknowledged, refused or failed)."""


SessionEvent = Union[DecodeProgress, DecodeFinished, PushEnded]


class CallFailed(Exception):
    """The call ends with ``code`` and ``details``; ``outcome`` labels it in
    ``mammoth_ar_requests_total`` (None: not counted, the model is still loading); ``origin`` is
    where the error arose and why (`mammoth_core.errors`: this AR, or the DiT behind a failed push),
    sent with the status; ``field`` the request field at fault, if one is."""

    def __init__(self, code: grpc.StatusCode, details: str, outcome: str | None,
                 reason: Reason | str, stage: Stage | str = Stage.AR, field: str | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.outcome, self.field = code, details, outcome, field
        self.origin = errors.Origin(str(stage), str(reason))


class ProtoRoleSink:
    """The engine's `stage_ar.engine.RowSink` over a `HiddenStateSender`: engine roles become the
    ``mammoth.v1`` roles here, the one place they meet."""

    def __init__(self, sender: HiddenStateSender) -> None:
        self.sender = sender

    def put_rows(self, role: Role, hidden, token_ids: list[int]) -> None:
        self.sender.put_rows(PB_ROLES[role], hidden, token_ids)

    def finish(self) -> None:
        self.sender.finish()

    def abort(self) -> None:
        self.sender.abort()


class ARSession:
    """The state of one ``AR.Generate`` call (see the module docstring).

    Args:
        plan: the validated request.
        engine: the running decode engine.
        sender_for: ``(plan, push span) -> HiddenStateSender`` on the DiT's channel (the servicer
            holds the channel lease and the transport settings).
        release_channel: returns the channel lease (called once, by `close`).
        deadline_s: the call's remaining time in seconds (None: no deadline).
        server_span: this call's tracing span (None when tracing is off).
        trace_dir: where the request trace goes (None: none).
    """

    def __init__(self, plan: ARPlan, engine: DecodeEngine,
                 sender_for: Callable[[ARPlan, object], HiddenStateSender],
                 release_channel: Callable[[], None], *, deadline_s: float | None, server_span=None,
                 trace_dir: str | None = None) -> None:
        self.plan, self.engine, self.trace_dir = plan, engine, trace_dir
        self.server_span = server_span
        self.push_span = tracing.start_span(
            "mammoth.v1.DiT/PushConditions", tracing.context_of(server_span), kind="CLIENT",
            attributes={"server.address": plan.request.dit_address})
        self.sender = sender_for(plan, self.push_span)
        self._release_channel = release_channel
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[SessionEvent] = asyncio.Queue()
        self.job = self._job(deadline_s)
        self.stats: JobStats | None = None
        self.outcome = "cancelled"
        self._push: asyncio.Task | None = None
        self._closed = False

    def _job(self, deadline_s: float | None) -> DecodeJob:
        r, plan = self.plan.request, self.plan
        return DecodeJob(
            request_id=r.request_id, epoch=r.epoch, prompt_ids=plan.prompt_ids, negative_ids=plan.negative_ids,
            ar_width=plan.grid[0], ar_height=plan.grid[1], seed=r.seed,
            temperature=0.0, top_k=0, top_p=0.0,  # 0: the checkpoint's generation config samples
            ar_guidance_scale=r.ar_guidance_scale, sink=ProtoRoleSink(self.sender),
            on_progress=lambda done, total: self._post(DecodeProgress(done, total)),
            on_done=self._on_done,
            deadline=None if deadline_s is None else time.monotonic() + deadline_s,
            row_times=[] if self.trace_dir else None, decoding=decoding.from_proto(r.decoding),
        )

    def _post(self, event: SessionEvent) -> None:
        """From any thread: queue ``event`` for the event loop."""
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def _on_done(self, error: BaseException | None, stats: JobStats) -> None:
        # Engine thread, after the job left the engine: the gauge is exact here.
        metrics.RUNNING.set(self.engine.running)
        self._post(DecodeFinished(error, stats))

    # -- the call ---------------------------------------------------------------------------

    def start(self) -> None:
        """Admit the job and start the push.

        Raises:
            CallFailed: RESOURCE_EXHAUSTED when the engine is full, UNAVAILABLE when it drains
                (reason DRAINING) or its loop failed (ENGINE_FAILED).
        """
        try:
            self.engine.submit(self.job)
        except EngineFull as exc:
            raise self._failed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "rejected_full",
                               Reason.FULL) from None
        except EngineStopped as exc:
            raise self._failed(grpc.StatusCode.UNAVAILABLE, str(exc), "rejected_draining",
                               Reason.DRAINING if self.engine.failure is None else Reason.ENGINE_FAILED) from None
        metrics.RUNNING.set(self.engine.running)
        self._push = asyncio.create_task(self.sender.run(), name=f"push-{self.plan.request.request_id}")
        self._push.add_done_callback(lambda task: self._events.put_nowait(PushEnded()))
        if self.push_span is not None:
            self._push.add_done_callback(lambda t: tracing.end_span(
                self.push_span, error=None if not t.cancelled() and t.exception() is None else "push failed"))

    def _failed(self, code: grpc.StatusCode, details: str, outcome: str, reason: Reason | str,
                stage: Stage | str = Stage.AR) -> CallFailed:
        self.outcome = outcome
        return CallFailed(code, details, outcome, reason, stage)

    async def progress(self) -> AsyncIterator[pb.ARProgress]:
        """`ARProgress` while the engine decodes, until decoding finished and the DiT acknowledged
        the push.

        Raises:
            CallFailed: DEADLINE_EXCEEDED (decode deadline), INTERNAL (decode failed), the push's
                status (`push_status`), or ABORTED when the DiT closed the stream before decoding
                finished.
        """
        decoded, error = False, None
        while not (decoded and self._push.done()):
            event = await self._events.get()
            if isinstance(event, DecodeProgress):
                yield pb.ARProgress(prompt_tokens=len(self.plan.prompt_ids), tokens_generated=event.tokens_generated,
                                    total_tokens=event.total_tokens, rows_sent=self.sender.rows_sent[pb.CONDITION])
            elif isinstance(event, DecodeFinished):
                decoded, error, self.stats = True, event.error, event.stats
                if error is not None:
                    break
            elif self._push.done() and not decoded and not self._push_aborted_by_engine():
                break  # the push ended before decoding finished: the DiT refused or went away
        self._raise_failure(decoded, error)

    def _push_aborted_by_engine(self) -> bool:
        """The push ended because the engine aborted it: the engine fails a job by aborting its push,
        then reporting the error (`DecodeFinished`, always sent), so the call waits for that report
        and fails with the decode's reason instead of the abort's, whichever arrives first."""
        return not self._push.cancelled() and isinstance(self._push.exception(), SenderAborted)

    def _raise_failure(self, decoded: bool, error: BaseException | None) -> None:
        if isinstance(error, EngineDeadlineExceeded):
            raise self._failed(grpc.StatusCode.DEADLINE_EXCEEDED, str(error), "deadline", Reason.DEADLINE)
        if error is not None:
            logger.error("decode failed: %s", error)
            raise self._failed(grpc.StatusCode.INTERNAL, f"AR decode failed: {error}", "failed",
                               Reason.DECODE_FAILED)
        push_error = self._push.exception() if self._push.done() else None
        if push_error is not None:
            code, details, origin = push_status(push_error)
            logger.warning("push to %s failed: %s %s", self.plan.request.dit_address, code.name, details)
            raise self._failed(code, f"pushing hidden states to the DiT failed: {details}", "push_failed",
                               origin.reason, origin.stage)
        if not decoded:
            raise self._failed(grpc.StatusCode.ABORTED, "the DiT closed the condition stream early", "push_failed",
                               Reason.PUSH_FAILED, Stage.DIT)

    def done_message(self) -> pb.ARDone:
        """After `progress` finished: count the decode, write the trace, and the `ARDone`."""
        stats = self.stats or JobStats()
        response = self._push.result()
        metrics.observe_decode(stats)
        self.outcome = "ok"
        logger.info("done: %d prompt + %d grid tokens, prefill %.1f ms, decode %.1f ms",
                    stats.prompt_tokens, stats.generated_tokens, stats.prefill_ms, stats.decode_ms)
        r = self.plan.request
        if self.job.row_times is not None:
            write_request_trace(self.trace_dir, "ar", r.request_id, r.epoch, {
                "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
                "rows": self.job.row_times})
        accepted = response.rows_accepted + response.negative_rows_accepted
        return pb.ARDone(
            prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated_tokens,
            rows_sent=accepted or self.plan.condition_rows + self.plan.negative_rows,
            prefill_ms=stats.prefill_ms, decode_ms=stats.decode_ms, last_row_unix_ms=stats.last_row_unix_ms,
        )

    def close(self) -> None:
        """Stop everything this call started and count its outcome (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.job.cancel()
        push = self._push
        if push is not None:
            if not push.done():
                self.sender.abort()
                push.cancel()
            # The push's own error (if any) was reported or is moot now: retrieve it so asyncio
            # does not log "Task exception was never retrieved".
            push.add_done_callback(lambda t: t.cancelled() or t.exception())
        elif self.push_span is not None:
            tracing.end_span(self.push_span, error=self.outcome)
        self._release_channel()
        metrics.REQUESTS.labels(self.outcome).inc()
        metrics.RUNNING.set(self.engine.running)
        if self.server_span is not None:
            _record_engine_spans(self.server_span, self.stats)
            tracing.end_span(self.server_span, error=None if self.outcome == "ok" else self.outcome)


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


def push_status(exc: BaseException) -> tuple[grpc.StatusCode, str, errors.Origin]:
    """Status code, details and origin for a failed push: a status the DiT (or the channel to it)
    answered is relayed unchanged with the DiT's origin (its own `mammoth_core.errors.Origin` when
    it sent one), so the gateway tells a DiT failure behind this AR from the AR's own; a failure on
    this side is the AR's (INTERNAL)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        origin = errors.origin_of(exc) or errors.Origin(Stage.DIT, Reason.PUSH_FAILED)
        return exc.code(), exc.details() or exc.code().name, origin
    code = getattr(exc, "code", None)
    if isinstance(code, grpc.StatusCode):
        return grpc.StatusCode.ABORTED, f"{code.name}: {exc}", errors.Origin(Stage.DIT, Reason.PUSH_FAILED)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}", errors.Origin(Stage.AR, Reason.PUSH_FAILED)
