"""Per-call progress deadlines: a stage call whose messages stop coming is checked, and failed
when its backend is hung (`gateway.health`).

A stage streams progress while it works: the AR one event per ``progress_interval_s`` of decode,
the DiT one per denoising step (and RECEIVING progress while rows arrive). `ProgressWatch.read`
reads the next message of one call and keeps the expected gap between messages (an exponential
average of the gaps seen on this call). When no message has come for ``STALL_FACTOR`` times that
gap (at least ``MIN_STALL_SECONDS``) it asks the backend's `HealthMonitor` for a probe at once;
a slow step is not a fault (the stage answers the probe and the call goes on), a stage that answers
no probe within its deadline twice in a row is hung, and the read fails with ``UNAVAILABLE``: the
engine client treats it like a broken stream and retries the request on another replica within its
budget.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from gateway.health import HealthMonitor

#: A call is overdue after this many expected gaps without a message ...
STALL_FACTOR = 4.0
#: ... and never before this many seconds.
MIN_STALL_SECONDS = 0.5
#: Weight of the newest gap in the expected gap (exponential moving average).
GAP_WEIGHT = 0.3


def hung_error(health: HealthMonitor) -> grpc.aio.AioRpcError:
    """The ``UNAVAILABLE`` error a read on a hung backend fails with."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
        details=f"{health.label} is hung (no health answer within {health.timeout:.1f} s)")


class ProgressWatch:
    """Reads of one stage call with a progress deadline (see the module docstring).

    Args:
        call: the streaming `grpc.aio` call (``read()`` returns the next message or EOF).
        health: the `HealthMonitor` of the backend the call went to.
    """

    def __init__(self, call: Any, health: HealthMonitor) -> None:
        self._call = call
        self._health = health
        self._gap: float | None = None
        self._last = time.monotonic()

    def _stall_seconds(self) -> float:
        if self._gap is None:
            return MIN_STALL_SECONDS
        return max(MIN_STALL_SECONDS, STALL_FACTOR * self._gap)

    async def read(self) -> Any:
        """The call's next message (or ``grpc.aio.EOF``).

        Raises:
            grpc.aio.AioRpcError: the call failed, or ``UNAVAILABLE`` when the backend was found
                hung first.
        """
        if self._health.hung.is_set():
            raise hung_error(self._health)
        reading = asyncio.ensure_future(self._call.read())
        try:
            while True:
                hung = asyncio.ensure_future(self._health.hung.wait())
                try:
                    done, _ = await asyncio.wait({reading, hung}, timeout=self._stall_seconds(),
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    hung.cancel()
                if reading in done:
                    self._observe()
                    return reading.result()
                if hung in done:
                    raise hung_error(self._health)
                self._health.probe_now()  # overdue: is the stage still there?
        finally:
            if not reading.done():
                reading.cancel()

    def _observe(self) -> None:
        now = time.monotonic()
        gap, self._last = now - self._last, now
        self._gap = gap if self._gap is None else (1 - GAP_WEIGHT) * self._gap + GAP_WEIGHT * gap
