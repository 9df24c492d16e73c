"""Admission: whether an image request may start, and its place in the bounded queue.

A request is admitted before any stage work (DESIGN.md, "Request path"): refused with 503
``draining`` while the gateway drains, 503 ``no_backend`` when a stage has no replica that can take
it (`require_available`, also asked again while a request waits), 429 ``queue_full`` when
``queue_size`` requests already wait for their DiT slots; else it holds an `AdmissionTicket` until
each of its images holds a slot (or the request ends). Every refusal carries ``Retry-After``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from gateway.errors import OverloadedError, UnavailableError
from gateway.metrics import GatewayMetrics

#: ``Retry-After`` (seconds) of a full queue or a draining gateway; the floor of ``no_backend``'s.
RETRY_AFTER_SECONDS = 1.0


class _Pool(Protocol):
    def available(self) -> bool: ...


@dataclass
class GatewayState:
    """Process-wide flags: ``draining`` after SIGTERM; ``active`` image requests (``idle`` is set
    when there are none)."""

    draining: bool = False
    active: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


def require_available(pool: _Pool, name: str, health_interval_seconds: float) -> None:
    """Fail at once when no replica of ``pool`` can take the request: none SERVING and none being
    probed (`gateway.backends.BackendPool.available`). No replacement is waited for: the gateway
    cannot see one coming (a headless Service lists a pod once it is Ready) and a model load takes
    minutes; the client retries after ``Retry-After`` (docs/RELIABILITY.md).

    Raises:
        UnavailableError: 503 ``no_backend``, ``Retry-After`` = max(1 s, the health interval).
    """
    if not pool.available():
        raise UnavailableError(f"no {name} backend is serving", code="no_backend",
                               retry_after=max(RETRY_AFTER_SECONDS, health_interval_seconds))


class AdmissionQueue:
    """Bounded queue of requests waiting for their DiT slots.

    A request enters before any stage work and leaves once each of its images holds a slot (or the
    request ends). When ``capacity`` requests are already waiting, `enter` raises
    `OverloadedError` (HTTP 429, ``Retry-After``).
    """

    def __init__(self, capacity: int, metrics: GatewayMetrics) -> None:
        self.capacity = max(1, capacity)
        self.waiting = 0
        self._metrics = metrics

    def enter(self, images: int) -> "AdmissionTicket":
        """A place for a request of ``images`` images.

        Raises:
            OverloadedError: ``capacity`` requests are already waiting.
        """
        if self.waiting >= self.capacity:
            raise OverloadedError(
                f"the gateway's queue is full ({self.capacity} requests waiting for a DiT slot); "
                "retry later", retry_after=RETRY_AFTER_SECONDS)
        self.waiting += 1
        self._metrics.queue_depth.set(self.waiting)
        return AdmissionTicket(self, images)

    def _leave(self) -> None:
        self.waiting -= 1
        self._metrics.queue_depth.set(self.waiting)


class AdmissionTicket:
    """One request's place in the `AdmissionQueue`; leaves when every image reserved a slot."""

    def __init__(self, queue: AdmissionQueue, images: int) -> None:
        self._queue = queue
        self._pending = images
        self._left = False

    def image_reserved(self) -> None:
        """One image holds its DiT slot (call once per image)."""
        self._pending -= 1
        if self._pending <= 0:
            self.leave()

    def leave(self) -> None:
        """Leave the queue (idempotent)."""
        if not self._left:
            self._left = True
            self._queue._leave()


class Admission:
    """The admission decision of `POST /v1/images/generations`, in the order the client sees it:
    draining, then a stage without a serving backend, then a full queue.

    Args:
        state: the process's `GatewayState` (``draining``).
        pools: ``(name, pool)`` of each stage (``"AR"``, ``"DiT"``), checked in this order.
        queue: the bounded queue.
        health_interval_seconds: the backends' health interval (``no_backend``'s Retry-After).
    """

    def __init__(self, state: GatewayState, pools: Sequence[tuple[str, _Pool]], queue: AdmissionQueue,
                 health_interval_seconds: float) -> None:
        self.state = state
        self.pools = list(pools)
        self.queue = queue
        self.health_interval_seconds = health_interval_seconds

    def admit(self, images: int) -> AdmissionTicket:
        """A ticket for a request of ``images`` images.

        Raises:
            UnavailableError: 503 ``draining`` or ``no_backend`` (with ``Retry-After``).
            OverloadedError: 429 ``queue_full`` (with ``Retry-After``).
        """
        if self.state.draining:
            raise UnavailableError("the gateway is shutting down; retry on another replica",
                                   code="draining", retry_after=RETRY_AFTER_SECONDS)
        for name, pool in self.pools:
            require_available(pool, name, self.health_interval_seconds)
        return self.queue.enter(images)
