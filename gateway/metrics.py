"""Prometheus metrics of one gateway (own registry, so several apps can live in one process).

Names (all prefixed ``mammoth_gateway_``):

- ``requests_total{outcome}`` / ``request_duration_seconds{outcome}``: HTTP image requests by outcome
  (``success``, ``invalid_request``, ``auth_error``, ``not_found``, ``overloaded``, ``unavailable``,
  ``deadline``, ``backend_error``, ``internal_error``, ``cancelled``).
- ``stage_duration_seconds{stage}``: per-image breakdown, one label per stage, which partition the
  image's time (`gateway.serving.STAGES`): ``queue`` (waiting for a DiT slot, gateway clock),
  ``ar_prefill`` (AR call -> first rows sent: tokenisation, engine admission, prefill),
  ``ar_decode`` (grid decode to the last row, AR clock), ``transfer`` (last row sent -> conditions
  resident, the transfer tail reported by the DiT), ``dit_denoise`` (condition preparation and the
  denoising steps), ``dit_vae`` (VAE decode), ``dit_encode`` (image encoding), DiT clock. The same
  numbers come back per request in the ``Server-Timing`` response header.
- ``cancellations_total{cause}``: requests whose stage work was cancelled: ``client_disconnect``,
  ``deadline``.
- ``queue_depth``: requests admitted and still waiting for their DiT slots.
- ``slots_in_use``: DiT slots this gateway holds (open ``DiT.Generate`` streams that got ``Reserved``).
- ``active_requests``, ``active_pipelines``: per-request state alive now (0 when idle).
- ``backend_in_flight{stage,backend}``: open ``Generate`` calls per backend.
- ``backends_serving{stage}``: backends whose ``grpc.health.v1`` status is SERVING.
- ``retries_total{stage,reason}``: AR retries with ``epoch + 1`` and DiT retries from scratch.
- ``stored_images`` / ``stored_image_bytes``: images kept for ``url`` responses.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class GatewayMetrics:
    """All gateway metrics on one `CollectorRegistry` (``registry``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "mammoth_gateway_"
        self.requests_total = Counter(p + "requests_total", "Image requests by outcome", ["outcome"],
                                      registry=r)
        self.request_duration = Histogram(p + "request_duration_seconds",
                                          "Image request latency by outcome (seconds)", ["outcome"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.stage_duration = Histogram(p + "stage_duration_seconds",
                                        "Per-image stage time: queue, ar, transfer, dit (seconds)",
                                        ["stage"], buckets=LATENCY_BUCKETS, registry=r)
        self.cancellations_total = Counter(p + "cancellations_total",
                                           "Requests cancelled, by cause", ["cause"], registry=r)
        for cause in ("client_disconnect", "deadline"):
            self.cancellations_total.labels(cause)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for DiT slots", registry=r)
        self.slots_in_use = Gauge(p + "slots_in_use", "DiT slots held by this gateway", registry=r)
        self.active_requests = Gauge(p + "active_requests", "Image requests in progress", registry=r)
        self.active_pipelines = Gauge(p + "active_pipelines", "Per-image pipelines in progress",
                                      registry=r)
        self.backend_in_flight = Gauge(p + "backend_in_flight", "Open Generate calls per backend",
                                       ["stage", "backend"], registry=r)
        self.backends_serving = Gauge(p + "backends_serving", "Backends reporting SERVING",
                                      ["stage"], registry=r)
        self.retries_total = Counter(p + "retries_total", "Stage retries", ["stage", "reason"],
                                     registry=r)
        self.stored_images = Gauge(p + "stored_images", "Images kept for url responses", registry=r)
        self.stored_image_bytes = Gauge(p + "stored_image_bytes", "Bytes kept for url responses",
                                        registry=r)
        for stage in ("ar", "dit"):
            self.backends_serving.labels(stage)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
