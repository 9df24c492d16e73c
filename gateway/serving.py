"""``POST /v1/images/generations``: request rules, admission, the engine client, rendering.

One request goes through four layers, each in its own module:

1. the request rules (`gateway.protocol.ImageGenerationRequest`: pydantic validators, then
   ``to_image_job(settings)`` -> `gateway.image_job.ImageJob`);
2. admission (`gateway.admission.Admission`: draining, a stage without backends, the bounded
   queue), before any stage work;
3. the engine client (`gateway.engine_client.EngineClient.generate`: typed events from the two
   stages, retries, one classifier of stage errors);
4. rendering (`gateway.rendering`: the JSON body with ``Server-Timing``, or server-sent events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.admission import Admission, AdmissionQueue, AdmissionTicket, GatewayState
from gateway.engine_client import EngineClient
from gateway.events import ImageResult
from gateway.image_job import ImageJob
from gateway.images_store import ImageStore
from gateway.metrics import GatewayMetrics
from gateway.protocol import ImageGenerationRequest
from gateway.rendering import SSERenderer, collect, render_json, server_timing
from gateway.request_budget import keepalive_interval, request_budget
from mammoth_core.settings import GatewaySettings

logger = logging.getLogger(__name__)

SSE_KEEPALIVE_SECONDS = 15.0
#: Request outcome -> ``mammoth_gateway_cancellations_total{cause}`` (work cancelled in the stages).
CANCELLATION_CAUSES = {"cancelled": "client_disconnect", "deadline": "deadline"}


class OpenAIServingImages:
    """``POST /v1/images/generations``: validation, admission, the engine client, the response."""

    def __init__(self, settings: GatewaySettings, engine: EngineClient, store: ImageStore,
                 metrics: GatewayMetrics, state: GatewayState) -> None:
        self.settings = settings
        self.engine = engine
        self.store = store
        self.metrics = metrics
        self.state = state
        self.admission = Admission(
            state, (("AR", engine.ar_pool), ("DiT", engine.dit_pool)),
            AdmissionQueue(settings.queue_size, metrics), settings.health_interval_seconds)

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

    def _image_url(self, raw: Request, result: ImageResult) -> str:
        """Store ``result`` for a ``url`` response; its URL."""
        image_id = self.store.put(result.data, result.format)
        base = getattr(self.settings, "public_base_url", None) or str(raw.base_url)
        return f"{base.rstrip('/')}/v1/images/files/{image_id}"

    async def create_image(self, body: ImageGenerationRequest, raw: Request,
                           request_id: str) -> JSONResponse | StreamingResponse:
        """Check, admit and run the request (errors raise `GatewayError` before any stage work).

        Raises:
            GatewayError: validation (400/404), overload (429/503), and for a non-streaming
                request what the engine client failed with (502/504/400).
        """
        job = body.to_image_job(self.settings, request_id)
        ticket = self.admission.admit(job.n)
        logger.info("request %s: n=%d size=%s ar_grid=%dx%d steps=%d seed=%d user=%r", request_id,
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
                results = await collect(
                    self.engine.generate(job, deadline, ticket.image_reserved), job.n)
            finally:
                ticket.leave()
        body = render_json(job, results, lambda r: self._image_url(raw, r))
        # The slowest image decides the latency: its breakdown goes into Server-Timing.
        slowest = max(results, key=lambda r: sum(r.timings.values()))
        total = None if started is None else time.perf_counter() - started
        return JSONResponse(body.model_dump(exclude_none=True),
                            headers={"x-request-id": request_id,
                                     "server-timing": server_timing(slowest.timings, total)})

    async def _stream(self, job: ImageJob, raw: Request, ticket: AdmissionTicket,
                      deadline: float, keepalive: float) -> AsyncIterator[bytes]:
        """The SSE body (`gateway.rendering.SSERenderer`); cancelled on client disconnect."""
        started = time.perf_counter()
        renderer = SSERenderer(job, lambda r: self._image_url(raw, r),
                               getattr(raw.state, "started", started))  # RequestIdMiddleware's clock
        with self._track():
            try:
                events = self.engine.generate(job, deadline, ticket.image_reserved, keepalive, renderer.visible)
                async for chunk in renderer.render(events):
                    yield chunk
            finally:
                ticket.leave()
                self.record(renderer.outcome, started)
