"""How many slots and how large a batch the DiT runs: from GPU memory, measured at start.

On CUDA, `measure_capacity` runs one guided step of one request at the largest size the limits
allow and reads the peak memory it added (``request_bytes``: both CFG branches' activations); with
the memory free after loading it plans (`plan_capacity`) the slot count and the batch limit, never
above the configured ones. On the CPU the configured values are used as they are. The result is
exported as gauges (`stage_dit.metrics`: ``mammoth_dit_max_batch_requests``,
``mammoth_dit_request_memory_bytes``, ``mammoth_dit_capacity_measured``; the slot pool's size is
``mammoth_dit_slots_capacity``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from stage_dit import metrics
from stage_dit.denoise import DenoiseState, ImageRequest, denoise_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiTCapacity:
    """Slots and batch limit of one DiT.

    Attributes:
        slots: condition slots (concurrent requests).
        max_batch_requests: requests in one forward of the worker loop.
        request_bytes: GPU bytes one request adds to a forward at the largest size (0: not measured).
        measured: True when derived from GPU memory.
    """

    slots: int
    max_batch_requests: int
    request_bytes: int = 0
    measured: bool = False

    def export(self) -> None:
        """Set the capacity gauges."""
        metrics.MAX_BATCH.set(self.max_batch_requests)
        metrics.REQUEST_MEMORY.set(self.request_bytes)
        metrics.MEASURED.set(1 if self.measured else 0)


def plan_capacity(free_bytes: int, request_bytes: int, slot_bytes: int, slots: int, max_batch: int,
                  utilization: float) -> DiTCapacity:
    """Slots and batch limit that fit ``utilization x free_bytes``.

    Each slot holds ``slot_bytes`` (its device buffer); each request in a forward needs
    ``request_bytes``. Slots: as many as fit with one request's activations each, at most ``slots``;
    batch: what the rest holds, at most ``max_batch`` and the slot count; both at least 1.

    Raises:
        ValueError: non-positive ``request_bytes`` or ``utilization`` outside (0, 1].
    """
    if request_bytes <= 0 or not 0.0 < utilization <= 1.0:
        raise ValueError(f"request_bytes ({request_bytes}) must be > 0 and utilization ({utilization}) in (0, 1]")
    budget = int(free_bytes * utilization)
    fit_slots = max(1, min(slots, budget // (slot_bytes + request_bytes)))
    fit_batch = max(1, min(max_batch, fit_slots, (budget - fit_slots * slot_bytes) // request_bytes))
    return DiTCapacity(int(fit_slots), int(fit_batch), int(request_bytes), True)


def largest_side(max_pixels: int, multiple: int) -> int:
    """The side of the largest square image within ``max_pixels`` (a multiple of ``multiple``)."""
    return max(multiple, int(math.isqrt(max_pixels)) // multiple * multiple)


def measure_request_bytes(pipeline, side: int, condition_rows: int) -> int:
    """Peak CUDA bytes one guided step of one ``side`` x ``side`` request adds (both branches)."""
    condition = torch.zeros(condition_rows, pipeline.llm_hidden_size, device=pipeline.device, dtype=pipeline.dtype)
    request = ImageRequest(condition, None, side, side, 1, 2.0)
    state = DenoiseState(pipeline, request)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    denoise_step(pipeline.transformer, [state])
    torch.cuda.synchronize()
    return max(1, torch.cuda.max_memory_allocated() - base)


def measure_capacity(pipeline, *, slots: int, max_batch: int, slot_bytes: int, max_pixels: int,
                     utilization: float, condition_rows: int = 256) -> DiTCapacity:
    """`plan_capacity` from a measured request on CUDA; the configured values elsewhere."""
    if pipeline.device.type != "cuda":
        return DiTCapacity(slots, min(max_batch, slots))
    side = largest_side(max_pixels, pipeline.size_multiple)
    request_bytes = measure_request_bytes(pipeline, side, condition_rows)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(pipeline.device)
    capacity = plan_capacity(free, request_bytes, slot_bytes, slots, max_batch, utilization)
    logger.info("DiT capacity from GPU memory: %d slots, batch %d (%.2f GiB per %dx%d request, %.1f GiB free)",
                capacity.slots, capacity.max_batch_requests, request_bytes / 2**30, side, side, free / 2**30)
    return capacity
