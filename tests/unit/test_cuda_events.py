"""`mammoth_core.cuda_events.wait_event`: spin on the loop, then wait in a thread.

The event here is a stand-in with `torch.cuda.Event`'s two methods (``query``, ``synchronize``):
what is under test is the waiting, which must return as soon as the event completes and must
never block the event loop. The real CUDA events are exercised on the GPU machine
(`benchmarks/gpu_transport_rules.py`).
"""

from __future__ import annotations

import asyncio
import threading
import time

from mammoth_core.cuda_events import wait_event


class CountdownEvent:
    """Completes after ``n`` queries, or when ``done`` is set (``synchronize`` blocks on it)."""

    def __init__(self, n: int = 10**9):
        self.n = n
        self.queries = 0
        self.synchronized_on: str | None = None
        self.done = threading.Event()

    def query(self) -> bool:
        self.queries += 1
        return self.done.is_set() or self.queries > self.n

    def synchronize(self) -> None:
        self.synchronized_on = threading.current_thread().name
        self.done.wait()


def test_none_and_completed_events_return_at_once():
    asyncio.run(wait_event(None))
    event = CountdownEvent(0)
    asyncio.run(wait_event(event))
    assert event.queries == 1 and event.synchronized_on is None


def test_a_copy_that_completes_soon_is_seen_without_a_millisecond_sleep():
    event = CountdownEvent(5)
    t0 = time.perf_counter()
    asyncio.run(wait_event(event))
    assert event.queries == 6 and event.synchronized_on is None
    assert time.perf_counter() - t0 < 0.05  # a generous bound: no sleep is involved at all


def test_a_long_wait_moves_to_a_thread_and_the_loop_keeps_running():
    async def main():
        event = CountdownEvent()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while not event.done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        waiter = asyncio.create_task(wait_event(event, spin_s=0.01))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        assert event.synchronized_on not in (None, threading.current_thread().name)
        event.done.set()
        await asyncio.wait_for(waiter, 1.0)
        await tick_task
        return ticks

    assert asyncio.run(main()) >= 5  # the loop ran other tasks during the wait
