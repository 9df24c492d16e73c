"""`stage_ar.scheduler.ARScheduler`: pure Python, no torch kernels (it must not even import torch)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from stage_ar.scheduler import (
    ARScheduler,
    EngineCancelled,
    EngineDeadlineExceeded,
    EngineFull,
    EngineStopped,
    RequestState,
    SchedulerRequest,
    SlotAllocator,
    SlotsExhausted,
)


def req(name: str, slots: int = 1, positions: int = 10, deadline: float | None = None) -> SchedulerRequest:
    return SchedulerRequest(name, slots, positions, deadline)


def test_imports_no_torch():
    code = "import sys, stage_ar.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_against_max_running_sequences_and_slots():
    s = ARScheduler(num_slots=3, slot_capacity=32, max_running_sequences=2)
    a, b = req("a", 2), req("b", 2)
    s.add(a)
    s.add(b)
    with pytest.raises(EngineFull):
        s.add(req("c"))
    out = s.schedule()
    assert out.admitted == [a] and a.first_slot == 0 and a.state is RequestState.RUNNING
    assert b.state is RequestState.WAITING  # only 1 slot left: b (CFG, 2 slots) waits
    s.finish(a)
    assert s.schedule().admitted == [b] and b.first_slot == 0
    with pytest.raises(ValueError, match="positions"):
        s.add(req("long", positions=33))


def test_abort_frees_admission_at_once_and_slots_at_the_next_schedule():
    s = ARScheduler(num_slots=2, slot_capacity=32, max_running_sequences=1)
    a = req("a")
    s.add(a)
    s.schedule()
    assert s.abort(a) and not s.abort(a)  # idempotent
    assert s.num_admitted == 0
    b = req("b")
    s.add(b)  # a strictly sequential client is admitted at once
    assert s.slots.free_slots == 1  # a's slot is still read by the step in flight
    out = s.schedule()
    assert out.aborted == [a] and isinstance(a.abort_reason, EngineCancelled) and a.first_slot is None
    assert out.admitted == [b] and b.first_slot == 0  # lowest free slot first
    s.finish(a)  # finishing an aborted request changes nothing
    assert s.num_admitted == 1


def test_abort_while_waiting_and_finish_after_abort():
    s = ARScheduler(num_slots=1, slot_capacity=32, max_running_sequences=3)
    a, b = req("a"), req("b")
    s.add(a)
    s.add(b)
    s.schedule()
    s.abort(b)  # never got a slot
    out = s.schedule()
    assert out.aborted == [b] and out.admitted == [] and s.num_admitted == 1


def test_deadlines_abort_waiting_and_running_requests():
    now = [100.0]
    s = ARScheduler(num_slots=1, slot_capacity=32, max_running_sequences=2, clock=lambda: now[0])
    a, b = req("a", deadline=101.0), req("b", deadline=105.0)
    s.add(a)
    s.add(b)
    s.schedule()
    now[0] = 102.0
    out = s.schedule()
    assert out.aborted == [a] and isinstance(a.abort_reason, EngineDeadlineExceeded)
    assert out.admitted == [b]  # a's slot went to b in the same call
    now[0] = 106.0
    assert s.schedule().aborted == [b] and s.num_admitted == 0


def test_drain_and_stop():
    s = ARScheduler(num_slots=2, slot_capacity=32, max_running_sequences=2)
    a = req("a")
    s.add(a)
    s.stop_accepting()
    with pytest.raises(EngineStopped):
        s.add(req("b"))
    s.schedule()
    gone = s.drain_all(EngineStopped("stop"))
    assert gone == [a] and s.slots.free_slots == 2 and s.num_admitted == 0


def test_wait_for_work_wakes_on_add_and_abort():
    s = ARScheduler(num_slots=1, slot_capacity=32, max_running_sequences=1)
    assert not s.wait_for_work(0.01)
    threading.Timer(0.05, s.add, args=(req("a"),)).start()
    assert s.wait_for_work(5)


def test_slot_allocator():
    slots = SlotAllocator(4)
    assert (slots.alloc(1), slots.alloc(2)) == (0, 1) and slots.high_water == 3
    with pytest.raises(SlotsExhausted):
        slots.alloc(2)
    slots.free(0)
    assert slots.alloc(1) == 0 and slots.free_slots == 1
