"""Prometheus metrics of the hidden-state transport, defined once for both ends.

The sender (AR process) and the receiver (DiT process) label their series with ``side`` =
``send``/``receive`` where a metric exists on both ends. Names:

- ``mammoth_transport_slot_outcomes_total{outcome}``: how each slot was retired (exactly once):
  ``completed`` | ``cancelled`` | ``deadline`` | ``producer_lost`` | ``consumer_lost`` | ``rejected``.
- ``mammoth_transport_chunks_total{side}``, ``mammoth_transport_bytes_total{side}`` (payload bytes),
  ``mammoth_transport_rows_total{side}``.
- ``mammoth_transport_rejected_chunks_total{code}``: chunks refused by the receiver (gRPC code).
- ``mammoth_transport_discarded_rows_total``: rows of a superseded or rejected epoch thrown away.
- ``mammoth_transport_pageable_fallback_total{side}``: copies staged through pageable memory because
  the pinned staging pool was exhausted.
- ``mammoth_transport_streams_total{side,result}``: PushConditions streams by result.
- ``mammoth_transport_tail_seconds``: last chunk handed to gRPC by the AR -> conditions resident
  on the DiT device (sender clock vs receiver clock: meaningful on synchronised clocks).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

SLOT_OUTCOMES = ("completed", "cancelled", "deadline", "producer_lost", "consumer_lost", "rejected", "failed")

SLOT_OUTCOMES_TOTAL = Counter(
    "mammoth_transport_slot_outcomes_total", "Slots retired, by outcome", ["outcome"]
)
CHUNKS = Counter("mammoth_transport_chunks_total", "Hidden-state chunk messages", ["side"])
BYTES = Counter("mammoth_transport_bytes_total", "Hidden-state payload bytes", ["side"])
ROWS = Counter("mammoth_transport_rows_total", "Hidden-state rows", ["side"])
REJECTED = Counter(
    "mammoth_transport_rejected_chunks_total", "Chunks refused by the receiver", ["code"]
)
DISCARDED_ROWS = Counter(
    "mammoth_transport_discarded_rows_total", "Rows of superseded or rejected epochs discarded"
)
PAGEABLE_FALLBACK = Counter(
    "mammoth_transport_pageable_fallback_total",
    "Copies staged through pageable memory because pinned staging was exhausted",
    ["side"],
)
STREAMS = Counter(
    "mammoth_transport_streams_total", "PushConditions streams by result", ["side", "result"]
)
TAIL_SECONDS = Histogram(
    "mammoth_transport_tail_seconds",
    "Last chunk sent by the AR -> conditions resident on the DiT device",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)

for _outcome in SLOT_OUTCOMES:
    SLOT_OUTCOMES_TOTAL.labels(outcome=_outcome)
for _side in ("send", "receive"):
    CHUNKS.labels(side=_side)
    BYTES.labels(side=_side)
    PAGEABLE_FALLBACK.labels(side=_side)
