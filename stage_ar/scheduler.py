"""`ARScheduler`: admission, KV-slot assignment, joins, leaves, cancellation and deadlines (pure Python).

The scheduler owns who runs, never how: it imports no torch and touches no tensor. The engine
thread calls `ARScheduler.schedule` between decode steps; any thread may call `add` and `abort`.

Life of a request (`SchedulerRequest`)::

    add() ──▶ WAITING ──schedule(): slots assigned──▶ RUNNING ──finish()──▶ FINISHED
                 │                                       │
                 └────────── abort() / deadline ─────────┴──▶ ABORTED (reaped by the next schedule)

Admission counts requests that are waiting or running and not aborted, against
``max_running_sequences``. An abort takes effect at once: the request stops counting the moment
`abort` returns (so a client that cancels and immediately sends its next request is admitted), and
its KV slots come back at the next `schedule`, which the engine thread runs before it prefills
anything (the slots may still be read by the step in flight until then).

KV slots: a fixed number of pool slots; a request needs one (two adjacent with AR-side CFG), lowest
free run first, so the running requests stay packed at the front of the pool.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections import deque
from typing import Any, Callable

__all__ = [
    "ARScheduler",
    "EngineCancelled",
    "EngineDeadlineExceeded",
    "EngineFull",
    "EngineStopped",
    "RequestState",
    "SchedulerOutput",
    "SchedulerRequest",
    "SlotAllocator",
    "SlotsExhausted",
]


class EngineFull(RuntimeError):
    """No room for another running sequence (``max_running_sequences`` reached)."""


class EngineStopped(RuntimeError):
    """The engine is draining or stopped and accepts no new sequence."""


class EngineCancelled(RuntimeError):
    """The request was cancelled (client gone, or its push failed)."""


class EngineDeadlineExceeded(EngineCancelled):
    """The request's deadline passed before it finished."""


class SlotsExhausted(RuntimeError):
    """No run of free adjacent KV slots is large enough."""


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclasses.dataclass(eq=False)
class SchedulerRequest:
    """One request as the scheduler sees it.

    Attributes:
        request_id: for messages.
        slots_needed: KV slots (1, or 2 with AR-side CFG).
        positions_needed: positions per slot (prompt + grid); checked against the slot capacity.
        deadline: `time.monotonic()` seconds after which the request is aborted, or None.
        payload: the engine's own object (the job); the scheduler never looks inside.
        state, first_slot: scheduler-owned; ``first_slot`` is set while RUNNING.
        abort_reason: why it was aborted (an `EngineCancelled` or subclass).
    """

    request_id: str
    slots_needed: int
    positions_needed: int
    deadline: float | None = None
    payload: Any = None
    state: RequestState = RequestState.WAITING
    first_slot: int | None = None
    abort_reason: BaseException | None = None


@dataclasses.dataclass
class SchedulerOutput:
    """What changed since the previous `ARScheduler.schedule`.

    Attributes:
        aborted: requests to drop now (cancelled or past their deadline); their slots are free.
        admitted: requests that got slots (``first_slot``) and must be prefilled, in arrival order.
    """

    aborted: list[SchedulerRequest]
    admitted: list[SchedulerRequest]


class SlotAllocator:
    """Lowest-first allocation of runs of adjacent slots among ``num_slots`` (pure Python).

    Raises:
        ValueError: ``num_slots`` below 1.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._used = [False] * num_slots

    @property
    def free_slots(self) -> int:
        """Slots not owned by any request."""
        return self._used.count(False)

    @property
    def high_water(self) -> int:
        """One past the highest slot in use (0 when none is)."""
        for i in range(self.num_slots - 1, -1, -1):
            if self._used[i]:
                return i + 1
        return 0

    def alloc(self, count: int = 1) -> int:
        """Take the lowest run of ``count`` free adjacent slots and return its first index.

        Raises:
            SlotsExhausted: no such run.
        """
        run = 0
        for i in range(self.num_slots):
            run = run + 1 if not self._used[i] else 0
            if run == count:
                first = i - count + 1
                self._used[first : i + 1] = [True] * count
                return first
        raise SlotsExhausted(f"no {count} adjacent free slots among {self.num_slots} ({self.free_slots} free)")

    def free(self, first: int, count: int = 1) -> None:
        """Give slots ``[first, first + count)`` back (idempotent)."""
        self._used[first : first + count] = [False] * count


class ARScheduler:
    """Admission and slot assignment for the AR decode engine.

    Args:
        num_slots: KV-pool slots.
        slot_capacity: positions per slot; a longer request is refused by `add`.
        max_running_sequences: admitted (waiting + running, not aborted) requests at most.
        clock: monotonic seconds (tests pass a fake).

    Raises:
        ValueError: ``max_running_sequences`` below 1.
    """

    def __init__(
        self,
        num_slots: int,
        slot_capacity: int,
        max_running_sequences: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_running_sequences < 1:
            raise ValueError(f"max_running_sequences must be >= 1, got {max_running_sequences}")
        self.slots = SlotAllocator(num_slots)
        self.slot_capacity = slot_capacity
        self.max_running_sequences = max_running_sequences
        self._clock = clock
        self._cond = threading.Condition()
        self._waiting: deque[SchedulerRequest] = deque()
        self._running: list[SchedulerRequest] = []
        self._to_reap: list[SchedulerRequest] = []
        self._admitted = 0
        self._accepting = True

    # -- any thread ----------------------------------------------------------------------------

    @property
    def num_admitted(self) -> int:
        """Requests counting against ``max_running_sequences`` now."""
        with self._cond:
            return self._admitted

    @property
    def running(self) -> list[SchedulerRequest]:
        """RUNNING requests (holding slots), in admission order (a copy)."""
        with self._cond:
            return list(self._running)

    def stop_accepting(self) -> None:
        """Drain: `add` raises `EngineStopped` from now on."""
        with self._cond:
            self._accepting = False
            self._cond.notify_all()

    def add(self, request: SchedulerRequest) -> None:
        """Admit ``request`` (state WAITING; it gets slots at the next `schedule`).

        Raises:
            EngineStopped: draining or stopped.
            EngineFull: ``max_running_sequences`` requests are admitted.
            ValueError: it needs more positions than a slot holds, or more slots than exist.
        """
        if request.positions_needed > self.slot_capacity:
            raise ValueError(
                f"sequence needs {request.positions_needed} positions; a decode slot holds {self.slot_capacity}")
        if request.slots_needed > self.slots.num_slots:
            raise ValueError(f"request needs {request.slots_needed} slots; the pool has {self.slots.num_slots}")
        with self._cond:
            if not self._accepting:
                raise EngineStopped("AR engine is draining")
            if self._admitted >= self.max_running_sequences:
                raise EngineFull(
                    f"AR has {self._admitted} running sequences (max_running_sequences={self.max_running_sequences})")
            self._admitted += 1
            request.state = RequestState.WAITING
            self._waiting.append(request)
            self._cond.notify_all()

    def abort(self, request: SchedulerRequest, reason: BaseException | None = None) -> bool:
        """Abort ``request`` now: it stops counting for admission before this returns; it is
        handed back by the next `schedule` (slots freed there). Idempotent.

        Returns:
            True if this call aborted it (False: it had already finished or been aborted).
        """
        with self._cond:
            if request.state not in (RequestState.WAITING, RequestState.RUNNING):
                return False
            self._abort_locked(request, reason or EngineCancelled(request.request_id))
            self._cond.notify_all()
            return True

    def wait_for_work(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until something is waiting or to be reaped."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._waiting or self._to_reap), timeout)

    # -- engine thread -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Reap aborted and expired requests (freeing their slots), then give slots to waiting
        requests in arrival order while slots last."""
        with self._cond:
            now = self._clock()
            for request in [*self._waiting, *self._running]:
                if request.deadline is not None and now >= request.deadline:
                    self._abort_locked(request, EngineDeadlineExceeded(f"{request.request_id}: deadline exceeded"))
            aborted, self._to_reap = self._to_reap, []
            for request in aborted:
                if request.first_slot is not None:
                    self.slots.free(request.first_slot, request.slots_needed)
                    request.first_slot = None
            admitted = []
            while self._waiting:
                request = self._waiting[0]
                try:
                    request.first_slot = self.slots.alloc(request.slots_needed)
                except SlotsExhausted:
                    break
                self._waiting.popleft()
                request.state = RequestState.RUNNING
                self._running.append(request)
                admitted.append(request)
            return SchedulerOutput(aborted, admitted)

    def finish(self, request: SchedulerRequest) -> None:
        """A RUNNING request completed (or failed): free its slots and its admission. Idempotent;
        a request aborted meanwhile is left to the reaper."""
        with self._cond:
            if request.state is not RequestState.RUNNING:
                return
            request.state = RequestState.FINISHED
            self._running.remove(request)
            self._admitted -= 1
            if request.first_slot is not None:
                self.slots.free(request.first_slot, request.slots_needed)
                request.first_slot = None

    def drain_all(self, reason: BaseException) -> list[SchedulerRequest]:
        """Abort every request (engine stop) and return them all, slots freed."""
        with self._cond:
            self._accepting = False
            for request in [*self._waiting, *self._running]:
                self._abort_locked(request, reason)
            out, self._to_reap = self._to_reap, []
            for request in out:
                if request.first_slot is not None:
                    self.slots.free(request.first_slot, request.slots_needed)
                    request.first_slot = None
            return out

    def _abort_locked(self, request: SchedulerRequest, reason: BaseException) -> None:
        if request.state is RequestState.WAITING:
            self._waiting.remove(request)
        elif request.state is RequestState.RUNNING:
            self._running.remove(request)
        else:
            return
        request.state = RequestState.ABORTED
        request.abort_reason = reason
        self._admitted -= 1
        self._to_reap.append(request)
