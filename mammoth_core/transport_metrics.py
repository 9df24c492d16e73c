"""Prometheus metrics of the hidden-state transport, defined once for both ends; each stage
registers its own side at start (`export`).

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

from prometheus_client import REGISTRY, Counter, Histogram

SLOT_OUTCOMES = ("completed", "cancelled", "deadline", "producer_lost", "consumer_lost", "rejected", "failed")

# Created unregistered: a stage process exports its own side only (`export`).
SLOT_OUTCOMES_TOTAL = Counter(
    "mammoth_transport_slot_outcomes_total", "Slots retired, by outcome", ["outcome"], registry=None
)
CHUNKS = Counter("mammoth_transport_chunks_total", "Hidden-state chunk messages", ["side"], registry=None)
BYTES = Counter("mammoth_transport_bytes_total", "Hidden-state payload bytes", ["side"], registry=None)
ROWS = Counter("mammoth_transport_rows_total", "Hidden-state rows", ["side"], registry=None)
REJECTED = Counter(
    "mammoth_transport_rejected_chunks_total", "Chunks refused by the receiver", ["code"], registry=None
)
DISCARDED_ROWS = Counter(
    "mammoth_transport_discarded_rows_total", "Rows of superseded or rejected epochs discarded", registry=None
)
PAGEABLE_FALLBACK = Counter(
    "mammoth_transport_pageable_fallback_total",
    "Copies staged through pageable memory because pinned staging was exhausted",
    ["side"], registry=None,
)
STREAMS = Counter(
    "mammoth_transport_streams_total", "PushConditions streams by result", ["side", "result"], registry=None
)
TAIL_SECONDS = Histogram(
    "mammoth_transport_tail_seconds",
    "Last chunk sent by the AR -> conditions resident on the DiT device",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
    registry=None,
)

SIDES = ("send", "receive")
_BOTH_SIDES = (CHUNKS, BYTES, ROWS, PAGEABLE_FALLBACK, STREAMS)
_RECEIVE_ONLY = (SLOT_OUTCOMES_TOTAL, REJECTED, DISCARDED_ROWS, TAIL_SECONDS)
_exported: set[str] = set()


def export(side: str) -> None:
    """Register the series a stage of ``side`` (``send``: the AR; ``receive``: the DiT) reports on
    the default registry (the one its `/metrics` serves), with its side's labels at zero, so each stage
    exports its own series only (an AR pod carries no slot outcomes, a DiT pod no ``side="send"``
    counters). Idempotent; a process that is both (a benchmark) calls it for each side.

    Raises:
        ValueError: ``side`` is not one of `SIDES`.
    """
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    if side in _exported:
        return
    if not _exported:
        for metric in _BOTH_SIDES:
            REGISTRY.register(metric)
    if side == "receive":
        for metric in _RECEIVE_ONLY:
            REGISTRY.register(metric)
        for outcome in SLOT_OUTCOMES:
            SLOT_OUTCOMES_TOTAL.labels(outcome=outcome)
    for metric in (CHUNKS, BYTES, PAGEABLE_FALLBACK):
        metric.labels(side=side)
    _exported.add(side)
