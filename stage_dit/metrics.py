"""Prometheus metrics of the DiT stage, defined once (default registry, served by
`mammoth_core.runtime.start_metrics_server`). The slot pool's and the transport's series
(``mammoth_dit_slots_*``, ``mammoth_dit_reservations_total``, ``mammoth_transport_*`` with
``side="receive"``) are in `mammoth_core.transport_metrics`.

- ``mammoth_dit_requests_total{outcome}``: ``DiT.Generate`` calls by slot outcome.
- ``mammoth_dit_denoise_seconds``: condition preparation + every denoising step, per image.
- ``mammoth_dit_step_seconds``: one denoising step (both CFG branches).
- ``mammoth_dit_vae_seconds`` / ``mammoth_dit_encode_seconds``: VAE decode / image encoding per image.
- ``mammoth_dit_steps_total``: denoising steps run.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from mammoth_core import transport_metrics as metrics

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
DIT_REQUESTS = Counter("mammoth_dit_requests_total", "DiT Generate calls by outcome (slot outcome)",
                       ["outcome"])
DIT_DENOISE = Histogram("mammoth_dit_denoise_seconds",
                        "condition preparation + every denoising step, per image", buckets=_SECONDS)
DIT_STEP = Histogram("mammoth_dit_step_seconds", "one denoising step (both CFG branches)",
                     buckets=_SECONDS)
DIT_VAE = Histogram("mammoth_dit_vae_seconds", "VAE decode per image", buckets=_SECONDS)
DIT_ENCODE = Histogram("mammoth_dit_encode_seconds", "image encoding (PNG/JPEG/WebP) per image",
                       buckets=_SECONDS)
DIT_STEPS = Counter("mammoth_dit_steps_total", "denoising steps run")
for _outcome in metrics.SLOT_OUTCOMES:
    DIT_REQUESTS.labels(_outcome)
