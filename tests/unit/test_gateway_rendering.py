"""The gateway's rendering of a request's typed events, in process: the SSE body (order, opt-in
progress, keep-alives, the error event) and the non-streaming collection."""

from __future__ import annotations

import json

import pytest

from gateway.errors import DeadlineExceededError
from gateway.events import Failed, Idle, ImageReady, ImageResult, PartialImage, Progress
from gateway.image_job import ImageJob
from gateway.rendering import SSERenderer, collect

RESULT = dict(data=b"png", format="png", width=64, height=64)


def make_job(n: int = 2, stream_progress: bool = False) -> ImageJob:
    return ImageJob(request_id="r", prompt="p", negative_prompt="", width=64, height=64,
                    ar_grid=(4, 4), n=n, seed=7, num_inference_steps=2, text_guidance_scale=4.0,
                    cfg_range=(0.0, 1.0), ar_guidance_scale=0.0, output_format="png",
                    output_compression=0, partial_images=1, response_format="b64_json",
                    stream=True, quality="high", safety_identifier=None,
                    stream_progress=stream_progress)


class Source:
    """An event generator that records whether it was closed."""

    def __init__(self, events):
        self.events = events
        self.closed = False

    async def __call__(self):
        try:
            for event in self.events:
                yield event
        finally:
            self.closed = True


async def render(job: ImageJob, events) -> tuple[SSERenderer, list[tuple[str, dict]]]:
    renderer = SSERenderer(job, lambda r: "unused", 0.0)
    body = b"".join([chunk async for chunk in renderer.render(events)]).decode()
    out = []
    for block in body.split("\n\n"):
        if block.startswith(": keep-alive"):
            out.append(("keep-alive", {}))
        elif block:
            kind, data = block.split("\n")
            out.append((kind[len("event: "):], json.loads(data[len("data: "):])))
    return renderer, out


async def test_completed_events_come_in_index_order_after_partials():
    events = [Progress(1, "dit", "denoising", step=1, total_steps=2), PartialImage(1, 0, b"p"),
              ImageReady(ImageResult(index=1, seed=8, **RESULT)), Idle(),
              ImageReady(ImageResult(index=0, seed=7, **RESULT))]
    renderer, out = await render(make_job(), Source(events)())
    assert [kind for kind, _ in out] == ["image_generation.partial_image", "keep-alive",
                                         "image_generation.completed",
                                         "image_generation.completed"]
    assert [data["image_index"] for kind, data in out if kind.endswith("completed")] == [0, 1]
    assert renderer.outcome == "success"


async def test_progress_events_only_for_clients_that_opted_in():
    events = [Progress(0, "ar", "decoding_tokens", tokens_generated=3, total_tokens=20, epoch=0),
              ImageReady(ImageResult(index=0, seed=7, **RESULT))]
    _, out = await render(make_job(n=1, stream_progress=True), Source(events)())
    assert out[0] == ("image_generation.progress", {
        "type": "image_generation.progress", "created_at": out[0][1]["created_at"],
        "image_index": 0, "stage": "ar", "phase": "decoding_tokens", "tokens_generated": 3,
        "total_tokens": 20, "epoch": 0})


async def test_a_failure_is_the_last_event_and_closes_the_source():
    source = Source([ImageReady(ImageResult(index=1, seed=8, **RESULT)),
                     Failed(DeadlineExceededError("the request's time budget ran out")),
                     ImageReady(ImageResult(index=0, seed=7, **RESULT))])
    renderer, out = await render(make_job(), source())
    assert out == [("error", {"error": {"message": "the request's time budget ran out",
                                        "type": "timeout", "param": None,
                                        "code": "deadline_exceeded"}})]
    assert renderer.outcome == "deadline" and source.closed


async def test_a_stream_that_ends_early_is_not_a_success():
    renderer, _ = await render(make_job(), Source([ImageReady(ImageResult(index=0, seed=7,
                                                                          **RESULT))])())
    assert renderer.outcome == "cancelled"


async def test_collect_orders_results_and_raises_a_failure_closing_the_source():
    source = Source([ImageReady(ImageResult(index=1, seed=8, **RESULT)), Idle(),
                     ImageReady(ImageResult(index=0, seed=7, **RESULT))])
    assert [r.index for r in await collect(source(), 2)] == [0, 1]
    failing = Source([Failed(DeadlineExceededError("late")), Idle()])
    with pytest.raises(DeadlineExceededError):
        await collect(failing(), 1)
    assert failing.closed
