"""Waiting on CUDA events from asyncio code (the transport's D2H-ready and H2D-complete rules).

One home for the AR's hidden-state sender and the DiT's receiver.

Why not ``while not event.query(): await asyncio.sleep(0.0002)``: asyncio's epoll selector rounds
every timeout *up* to whole milliseconds (``epoll_wait`` takes ms), so each such sleep costs about
1 ms, not 0.2 ms, and a copy that completes in 20 µs is seen a millisecond late. That was the fixed
per-request cost in the GPU transfer tail (`docs/PERFORMANCE.md`). Here the loop is yielded with
zero timeouts for a short spin window (transport copies of one chunk finish within tens of µs),
then the wait moves to a worker thread (`torch.cuda.Event.synchronize` releases the GIL), so a
long wait neither blocks nor busy-spins the event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

#: How long `wait_event` polls on the event loop before handing the wait to a thread, in seconds.
SPIN_S = 0.002


async def wait_event(event: Any, spin_s: float = SPIN_S) -> None:
    """Return once ``event`` (a `torch.cuda.Event`, or None) has completed.

    Polls ``event.query()`` between zero-timeout yields of the loop for up to ``spin_s`` seconds
    (other tasks keep running), then awaits ``event.synchronize()`` in the default executor.
    None (CPU paths: no event) returns at once. Raises whatever ``query``/``synchronize`` raise
    (a CUDA error of the copy).
    """
    if event is None or event.query():
        return
    deadline = time.perf_counter() + spin_s
    while time.perf_counter() < deadline:
        await asyncio.sleep(0)
        if event.query():
            return
    await asyncio.get_running_loop().run_in_executor(None, event.synchronize)
