"""One ``DiT.Generate`` call as an object: wait for the conditions, run the engine job, answer.

`GenerateSession.run` yields the call's responses in order: RECEIVING progress while the AR
pushes, `ConditionsComplete` the moment the conditions are resident, then per engine event
(`stage_dit.engine`) DENOISING progress, previews, DECODING and the final `Image`. `close` cancels
the engine job and releases the slot once the engine has let go of the slot's tensors.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from mammoth_core import errors, tracing
from mammoth_core.errors import Reason, Stage
from mammoth_core.pb import mammoth_pb2 as pb
from stage_dit.conditions import compute_answer_start_index
from stage_dit.denoise import ImageRequest
from stage_dit.engine import EngineJob, ImageFinished, PartialImage, RequestFailed, StepFinished
from stage_dit.step_cache import StepCacheConfig


OUTPUT_FORMATS = ("png", "jpeg", "webp")


def output_format(params: pb.ImageParams) -> str:
    """The encoder format of ``params`` (``jpg`` spelled ``jpeg``; empty = ``png``)."""
    fmt = (params.output_format or "png").lower()
    return "jpeg" if fmt == "jpg" else fmt


def preview_steps(partial_images: int, num_steps: int) -> dict[int, int]:
    """``{step (1-based): preview index}`` for ``partial_images`` previews spread evenly over the
    steps, never on the last one (the final image follows it): e.g. 2 of 8 -> steps 3 and 5."""
    count = max(0, min(int(partial_images), num_steps - 1))
    return {round((i + 1) * num_steps / (count + 1)): i for i in range(count)}


def step_cache(params: pb.ImageParams) -> StepCacheConfig | None:
    """The request's opt-in step cache (``params.dit_cache``), or None when unset or off."""
    if not params.HasField("dit_cache") or params.dit_cache.threshold <= 0:
        return None
    return StepCacheConfig(params.dit_cache.threshold, params.dit_cache.warmup_steps)


class GenerateSession:
    """State of one Generate call (created after the slot was reserved).

    Args:
        servicer: the `stage_dit.server.DiTServicer` (pipeline, engine, settings).
        request: the call's `DiTGenerateRequest`.
        context: its servicer context (aborts go through it).
        slot: the reserved `stage_dit.receiver.Slot`.
    """

    def __init__(self, servicer, request: pb.DiTGenerateRequest, context, slot) -> None:
        self.servicer = servicer
        self.request = request
        self.params = request.params
        self.context = context
        self.slot = slot
        self.outcome = "consumer_lost"
        self.job: EngineJob | None = None
        self.conds = None
        #: the call's tracing span (None when tracing is off), set by the servicer
        self.span = None
        self.timings = None

    async def run(self):
        """The call's responses (see the module docstring); sets ``outcome`` to ``completed``."""
        yield pb.DiTGenerateResponse(reserved=pb.Reserved(reservation_token=self.slot.token,
                                                          slot_id=self.slot.slot_id))
        async for message in self._wait_conditions():
            yield message
        async for message in self._denoise():
            yield message

    async def _wait_conditions(self):
        """RECEIVING progress until the conditions are complete (within the deadline), then
        `ConditionsComplete` and a last RECEIVING message with every row."""
        servicer, slot = self.servicer, self.slot
        budget = min(self.context.time_remaining() or 0.0, servicer.condition_timeout_s)
        wait_until = time.monotonic() + budget
        last_rows, last_sent = -1, 0.0
        while not slot.complete:
            rows = slot.rows_received(pb.CONDITION) + slot.rows_received(pb.NEGATIVE)
            now = time.monotonic()
            if rows != last_rows and now - last_sent >= servicer.progress_interval_s:
                yield pb.DiTGenerateResponse(progress=pb.DiTProgress(phase=pb.DiTProgress.RECEIVING,
                                                                     rows_received=rows))
                last_rows, last_sent = rows, now
            if now >= wait_until:
                self.outcome = servicer.waiting_outcome(slot, timed_out=True)
                await errors.abort(self.context, grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"conditions incomplete after {budget:.1f} s ({self.outcome})",
                                   stage=Stage.DIT, reason=Reason.DEADLINE)
            if servicer.producer_gone(slot, now):
                self.outcome = "producer_lost"
                await errors.abort(self.context, grpc.StatusCode.ABORTED, "the producer's stream broke and no "
                                   f"retry began within {servicer.producer_grace_s:.1f} s",
                                   stage=Stage.DIT, reason=Reason.PRODUCER_LOST)
            await slot.wait_changed(min(wait_until - now, servicer.progress_interval_s))
        conds = self.conds = slot.conditions()
        negative_rows = 0 if conds.negative is None else conds.negative.shape[0]
        yield pb.DiTGenerateResponse(conditions_complete=pb.ConditionsComplete(
            epoch=slot.epoch or 0, condition_rows=conds.hidden.shape[0], negative_rows=negative_rows))
        span = self.span
        if span is not None and slot.timings.first_chunk_at and slot.timings.resident_at:
            tracing.record_span("dit.receive", span, tracing.monotonic_to_unix_ns(slot.timings.first_chunk_at),
                                tracing.monotonic_to_unix_ns(slot.timings.resident_at))
        yield pb.DiTGenerateResponse(progress=pb.DiTProgress(
            phase=pb.DiTProgress.RECEIVING, rows_received=conds.hidden.shape[0] + negative_rows))

    def _prepare(self) -> ImageRequest:
        """On the engine's thread at admission: the condition split and refiner, the request."""
        pipe, conds, params = self.servicer.pipeline, self.conds, self.params
        rule = conds.metadata.answer_boundary or self.servicer.answer_boundary
        answer_start = compute_answer_start_index(int(conds.metadata.answer_start_index),
                                                  int(conds.hidden.shape[0]), rule)
        condition = pipe.prepare_conditions(conds.hidden.to(pipe.dtype), conds.token_ids, answer_start)
        negative = None if conds.negative is None else conds.negative.to(pipe.dtype).clone()
        return ImageRequest(
            condition, negative, width=params.width, height=params.height,
            num_inference_steps=params.num_inference_steps, text_guidance_scale=params.text_guidance_scale,
            cfg_range=(params.cfg_range_start, params.cfg_range_end), seed=params.seed,
            cache=step_cache(params), request_id=self.request.request_id)

    async def _denoise(self):
        """Submit the engine job and turn its events into responses."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        params, fmt = self.params, output_format(self.params)
        self.job = self.servicer.engine.submit(EngineJob(
            prepare=self._prepare, sink=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
            output_type=fmt, compression=params.output_compression,
            previews=preview_steps(params.partial_images, params.num_inference_steps),
            request_id=self.request.request_id))
        while True:
            event = await events.get()
            if isinstance(event, StepFinished):
                yield pb.DiTGenerateResponse(progress=pb.DiTProgress(
                    phase=pb.DiTProgress.DENOISING, step=event.step, total_steps=event.total))
                if event.step == event.total:
                    yield pb.DiTGenerateResponse(progress=pb.DiTProgress(
                        phase=pb.DiTProgress.DECODING, step=event.step, total_steps=event.total))
            elif isinstance(event, PartialImage):
                yield pb.DiTGenerateResponse(image=pb.Image(
                    data=event.data, format=fmt, width=params.width, height=params.height, partial=True,
                    partial_index=event.index))
            elif isinstance(event, RequestFailed):
                raise event.error
            elif isinstance(event, ImageFinished):
                yield self._final_image(event, fmt)
                return

    def _final_image(self, event: ImageFinished, fmt: str) -> pb.DiTGenerateResponse:
        t, conds, params = self.slot.timings, self.conds, self.params
        timings = pb.DiTTimings(denoise_ms=event.timings.denoise_ms, vae_ms=event.timings.vae_ms,
                                encode_ms=event.timings.encode_ms,
                                queue_ms=1000.0 * ((t.first_chunk_at or t.reserved_at) - t.reserved_at),
                                receive_ms=1000.0 * ((t.last_chunk_at or 0.0) - (t.first_chunk_at or 0.0)))
        if t.last_sent_unix_ms and t.resident_unix_ms:
            timings.transfer_tail_ms = max(0.0, t.resident_unix_ms - t.last_sent_unix_ms)
        self.timings = event.timings
        self.outcome = "completed"
        return pb.DiTGenerateResponse(image=pb.Image(
            data=event.output, format=fmt, width=params.width, height=params.height, timings=timings,
            condition_rows=conds.hidden.shape[0], steps_skipped=event.timings.steps_skipped,
            negative_rows=0 if conds.negative is None else conds.negative.shape[0]))

    def close(self, outcome: str) -> None:
        """Cancel the engine job (if any) and release the slot once the engine let go of it
        (call on the event loop)."""
        slot, job = self.slot, self.job
        if job is None or job.retired.done():
            slot.release(outcome)
            return
        job.cancel()
        loop = asyncio.get_running_loop()
        job.retired.add_done_callback(lambda _: loop.call_soon_threadsafe(slot.release, outcome))
