"""Slot count and batch limit from GPU memory (`stage_dit.capacity.plan_capacity`, pure) and the CPU default."""

from __future__ import annotations

import pytest

from stage_dit.capacity import DiTCapacity, largest_side, measure_capacity, plan_capacity

GiB = 2**30


def test_memory_bounds_slots_and_batch():
    # 100 GiB free, 90 % usable, 10 GiB per request, 1 GiB per slot: 8 slots fit (8 x 11 = 88 GiB),
    # then the batch is what the remaining 82 GiB hold (8), capped by the configured 16 / 8
    assert plan_capacity(100 * GiB, 10 * GiB, GiB, slots=16, max_batch=16, utilization=0.9) == \
        DiTCapacity(8, 8, 10 * GiB, True)
    # plenty of memory: the configured limits win; batch never above the slots
    assert plan_capacity(1000 * GiB, GiB, GiB, slots=4, max_batch=8, utilization=0.9).max_batch_requests == 4
    # too little memory still serves one request
    tight = plan_capacity(GiB, 10 * GiB, GiB, slots=4, max_batch=8, utilization=0.9)
    assert (tight.slots, tight.max_batch_requests) == (1, 1)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        plan_capacity(GiB, 0, GiB, slots=4, max_batch=8, utilization=0.9)
    with pytest.raises(ValueError):
        plan_capacity(GiB, GiB, GiB, slots=4, max_batch=8, utilization=1.5)


def test_largest_side_within_the_pixel_limit():
    assert largest_side(2_359_296, 16) == 1536
    assert largest_side(1000, 16) == 16


def test_cpu_uses_the_configured_values():
    class CpuPipeline:
        device = type("D", (), {"type": "cpu"})()

    cap = measure_capacity(CpuPipeline(), slots=4, max_batch=8, slot_bytes=1, max_pixels=1024, utilization=0.9)
    assert cap == DiTCapacity(4, 4, 0, False)
