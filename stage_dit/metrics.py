"""The DiT stage's Prometheus metrics, one home (the transport's live in `mammoth_core.transport_metrics`).

Per image: ``mammoth_dit_requests_total{outcome}``, ``mammoth_dit_denoise_seconds``,
``mammoth_dit_vae_seconds``, ``mammoth_dit_encode_seconds``. Per forward of the worker loop
(`stage_dit.engine`): ``mammoth_dit_step_seconds`` (one step of every active request),
``mammoth_dit_steps_total`` (request-steps), ``mammoth_dit_forwards_total`` (forwards; the mean
batch is their ratio), ``mammoth_dit_batch_requests`` (requests in the last forward),
``mammoth_dit_active_requests`` (requests denoising now), ``mammoth_dit_cache_skipped_steps_total``
(steps the opt-in step cache answered without the remaining layers). Capacity, set at start
(`stage_dit.capacity`): ``mammoth_dit_max_batch_requests``, ``mammoth_dit_request_memory_bytes``,
``mammoth_dit_capacity_measured`` (1: from GPU memory, 0: configured). The condition slot pool
(`stage_dit.receiver.SlotPool`): ``mammoth_dit_slots_capacity`` / ``mammoth_dit_slots_in_use`` (pool
size and occupancy), ``mammoth_dit_reservations_total{result}``: ``reserved`` | ``exhausted`` (fail
fast) | ``timeout`` (waited, deadline passed) | ``refused`` (draining). Only the DiT process
imports this module, so an AR pod exports none of these series.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from mammoth_core import transport_metrics

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)

SLOTS_TOTAL = Gauge("mammoth_dit_slots_capacity", "Condition slots in the DiT pool")
SLOTS_IN_USE = Gauge("mammoth_dit_slots_in_use", "Condition slots reserved (not yet retired)")
RESERVATIONS = Counter("mammoth_dit_reservations_total", "Slot reservation attempts by result", ["result"])
REQUESTS = Counter("mammoth_dit_requests_total", "DiT Generate calls by outcome (slot outcome)", ["outcome"])
DENOISE = Histogram("mammoth_dit_denoise_seconds",
                    "condition preparation + every denoising step, per image", buckets=_SECONDS)
STEP = Histogram("mammoth_dit_step_seconds",
                 "one worker-loop step: one forward per resolution over every active request", buckets=_SECONDS)
VAE = Histogram("mammoth_dit_vae_seconds", "VAE decode per image", buckets=_SECONDS)
ENCODE = Histogram("mammoth_dit_encode_seconds", "image encoding (PNG/JPEG/WebP) per image", buckets=_SECONDS)
STEPS = Counter("mammoth_dit_steps_total", "denoising steps run (one per request per step)")
BATCH = Gauge("mammoth_dit_batch_requests", "requests in the last transformer forward")
FORWARDS = Counter("mammoth_dit_forwards_total",
                   "transformer forwards of the worker loop (steps_total / forwards_total = mean batch)")
ACTIVE = Gauge("mammoth_dit_active_requests", "requests being denoised by the worker loop")
CACHE_SKIPPED = Counter("mammoth_dit_cache_skipped_steps_total",
                        "steps the opt-in step cache answered without the remaining joint layers")
MAX_BATCH = Gauge("mammoth_dit_max_batch_requests", "most requests denoised in one forward")
REQUEST_MEMORY = Gauge("mammoth_dit_request_memory_bytes",
                       "GPU memory one request at the largest size needs in a forward (0: not measured)")
MEASURED = Gauge("mammoth_dit_capacity_measured", "1: slots and batch limit from GPU memory; 0: configured")

for _outcome in transport_metrics.SLOT_OUTCOMES:
    REQUESTS.labels(_outcome)
