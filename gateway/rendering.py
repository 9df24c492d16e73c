"""HTTP rendering of a request's events: the JSON ``ImagesResponse`` and the SSE stream.

Both consume `gateway.engine_client.EngineClient.generate`'s events: `render_json` waits for every
`ImageReady` (a `Failed` raises its error, rendered by `gateway.errors.create_error_response`);
`render_sse` writes partial images as they come (and, for clients that opted in with
``stream_progress``, the ``image_generation.progress`` extension events), one completed event per
image in index order, an ``error`` event on failure, and a keep-alive comment after each `Idle`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from typing import AsyncIterator, Callable

from gateway.errors import ErrorResponse, error_info, outcome_of
from gateway.events import Event, Failed, Idle, ImageReady, ImageResult, PartialImage, Progress
from gateway.image_job import ImageJob
from gateway.protocol import (ImageGenCompletedEvent, ImageGenPartialImageEvent, ImageObject,
                              ImagesResponse, ImageUsage, InputTokensDetails, OutputTokensDetails,
                              ProgressEvent)

#: The stages of one image, in pipeline order (metric label ``stage`` and ``Server-Timing`` names):
#: ``queue`` (gateway: waiting for a DiT slot), ``ar_prefill`` / ``ar_decode`` (AR clock: prompt
#: prefill incl. tokenisation and engine admission, then grid decode to the last row),
#: ``transfer`` (last row sent by the AR -> conditions resident on the DiT device), ``dit_denoise``
#: (DiT: condition preparation and the denoising steps), ``dit_vae`` (VAE decode), ``dit_encode``
#: (PNG/JPEG/WebP encoding).
STAGES = ("queue", "ar_prefill", "ar_decode", "transfer", "dit_denoise", "dit_vae", "dit_encode")
#: Stores an image for a ``url`` response and returns its URL.
ImageUrl = Callable[[ImageResult], str]


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


def usage(results: list[ImageResult], job: ImageJob) -> ImageUsage:
    """Token counts of ``results``: prompt tokens in, visual tokens out, and the AR grid used."""
    prompt = sum(r.prompt_tokens for r in results)
    generated = sum(r.generated_tokens for r in results)
    return ImageUsage(
        input_tokens=prompt, input_tokens_details=InputTokensDetails(text_tokens=prompt),
        output_tokens=generated, output_tokens_details=OutputTokensDetails(image_tokens=generated),
        total_tokens=prompt + generated, ar_grid="{}x{}".format(*job.ar_grid))


def sse(event: str, payload: dict) -> bytes:
    """One server-sent event: ``event: <type>`` and a one-line JSON ``data``."""
    return f"event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def collect(events: AsyncIterator[Event], n: int) -> list[ImageResult]:
    """The ``n`` results of ``events`` in index order (the generator is closed on return).

    Raises:
        BaseException: the error of a `Failed` event.
    """
    results: dict[int, ImageResult] = {}
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, ImageReady):
                results[event.result.index] = event.result
    return [results[i] for i in range(n)]


def render_json(job: ImageJob, results: list[ImageResult], image_url: ImageUrl) -> ImagesResponse:
    """The ``ImagesResponse`` of a finished non-streaming request."""
    data = []
    for r in results:
        if job.response_format == "url":
            data.append(ImageObject(url=image_url(r), seed=r.seed))
        else:
            data.append(ImageObject(b64_json=base64.b64encode(r.data).decode(), seed=r.seed))
    return ImagesResponse(
        created=int(time.time()), data=data, usage=usage(results, job),
        output_format=job.output_format, quality=job.quality, size=job.size,
        safety_identifier=job.safety_identifier, seed=job.seed,
        num_inference_steps=job.num_inference_steps,
        text_guidance_scale=job.text_guidance_scale, cfg_range=job.cfg_range)


class SSERenderer:
    """Turns one streaming request's events into SSE bytes; `outcome` is the metric label of how
    it ended (``cancelled`` until it finished).

    Args:
        job: the request.
        image_url: stores an image for ``response_format: url``.
        request_started: ``time.perf_counter()`` at the request's start (the ``total`` timing).
    """

    def __init__(self, job: ImageJob, image_url: ImageUrl, request_started: float) -> None:
        self.job = job
        self.image_url = image_url
        self.request_started = request_started
        self.outcome = "cancelled"
        self._finished: dict[int, ImageResult] = {}
        self._next = 0

    async def render(self, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
        """The SSE body of ``events`` (closed when the body ends or is cancelled)."""
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Idle):
                    yield b": keep-alive\n\n"
                elif isinstance(event, Failed):
                    self.outcome = outcome_of(event.error)
                    _, info, _ = error_info(event.error)
                    yield sse("error", ErrorResponse(error=info).model_dump())
                    return
                else:
                    for chunk in self._render(event, int(time.time())):
                        yield chunk
        if self._next == self.job.n:
            self.outcome = "success"

    def visible(self, event: Event) -> bool:
        """Whether `render` writes something for ``event`` (the engine's heartbeat counts silence
        toward the client by it): progress only with ``stream_progress``, an image only when it is
        the next in index order (a later one waits for it)."""
        if isinstance(event, Progress):
            return bool(self.job.stream_progress)
        if isinstance(event, ImageReady):
            return event.result.index == self._next
        return True

    def _render(self, event: Event, now: int) -> list[bytes]:
        job = self.job
        if isinstance(event, Progress):
            if not job.stream_progress:
                return []  # an extension event: only for clients that asked for it
            ev = ProgressEvent(created_at=now, image_index=event.index, stage=event.stage,
                               phase=event.phase, tokens_generated=event.tokens_generated,
                               total_tokens=event.total_tokens, step=event.step,
                               total_steps=event.total_steps, epoch=event.epoch)
            return [sse(ev.type, ev.model_dump(exclude_none=True))]
        if isinstance(event, PartialImage):
            ev = ImageGenPartialImageEvent(
                b64_json=base64.b64encode(event.data).decode(), created_at=now,
                output_format=job.output_format, partial_image_index=event.partial_index,
                quality=job.quality, size=job.size, image_index=event.index)
            return [sse(ev.type, ev.model_dump(exclude_none=True))]
        if isinstance(event, ImageReady):
            self._finished[event.result.index] = event.result
            out = []
            while self._next in self._finished:  # completed events in index order
                out.append(self._completed(self._finished.pop(self._next), now))
                self._next += 1
            return out
        return []

    def _completed(self, r: ImageResult, now: int) -> bytes:
        job = self.job
        url = self.image_url(r) if job.response_format == "url" else None
        ev = ImageGenCompletedEvent(
            b64_json=base64.b64encode(r.data).decode(), created_at=now,
            output_format=job.output_format, quality=job.quality, size=job.size,
            usage=usage([r], job), safety_identifier=job.safety_identifier, image_index=r.index,
            seed=r.seed, url=url,
            timings=timings_ms(r.timings, time.perf_counter() - self.request_started))
        return sse(ev.type, ev.model_dump(exclude_none=True))
