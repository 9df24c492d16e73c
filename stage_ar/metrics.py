"""Prometheus metrics of the AR stage, defined once (default registry, served by
`mammoth_core.runtime.start_metrics_server`). The transport's own series (chunks, bytes, rows,
streams, pageable fallbacks with ``side="send"``) are in `mammoth_core.transport_metrics`.

- ``mammoth_ar_requests_total{outcome}``: ``AR.Generate`` calls by outcome (`OUTCOMES`).
- ``mammoth_ar_running_sequences``: sequences admitted to the decode engine.
- ``mammoth_ar_generated_tokens_total``: grid tokens decoded.
- ``mammoth_ar_prefill_seconds`` / ``mammoth_ar_decode_seconds``: per request.
- ``mammoth_ar_decode_tokens_per_second``: grid tokens per second of decode, per request.
- ``mammoth_ar_staging_blocks{state}``: the hidden-state sender's host staging blocks (pinned on
  CUDA, `stage_ar.staging`), ``capacity`` and ``free`` now; built before the stage is ready.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from stage_ar.engine import JobStats
from stage_ar.staging import default_pool_blocks

#: Every outcome label of ``mammoth_ar_requests_total``.
OUTCOMES = ("ok", "invalid", "refused_dit", "rejected_full", "rejected_draining", "deadline", "failed",
            "push_failed", "cancelled")

REQUESTS = Counter("mammoth_ar_requests_total", "AR Generate calls by outcome", ["outcome"])
RUNNING = Gauge("mammoth_ar_running_sequences", "sequences admitted to the decode engine")
TOKENS = Counter("mammoth_ar_generated_tokens_total", "grid tokens decoded")
PREFILL = Histogram(
    "mammoth_ar_prefill_seconds", "prefill time per request",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
)
DECODE = Histogram(
    "mammoth_ar_decode_seconds", "decode time per request",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
TOKENS_PER_SECOND = Histogram(
    "mammoth_ar_decode_tokens_per_second", "grid tokens decoded per second of decode, per request",
    buckets=(10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400),
)
STAGING_BLOCKS = Gauge("mammoth_ar_staging_blocks", "host staging blocks of the hidden-state sender, by state",
                       ["state"])
STAGING_BLOCKS.labels("capacity").set_function(lambda: default_pool_blocks()[0])
STAGING_BLOCKS.labels("free").set_function(lambda: default_pool_blocks()[1])
for _outcome in OUTCOMES:
    REQUESTS.labels(_outcome)


def observe_decode(stats: JobStats) -> None:
    """Count one finished decode: tokens, prefill and decode time, decode rate."""
    TOKENS.inc(stats.generated_tokens)
    PREFILL.observe(stats.prefill_ms / 1e3)
    DECODE.observe(stats.decode_ms / 1e3)
    if stats.decode_ms > 0:
        TOKENS_PER_SECOND.observe(stats.generated_tokens / (stats.decode_ms / 1e3))
