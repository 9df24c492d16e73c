"""Coordination of the convergences of one operator process (thread-safe; kopf runs sync handlers
in a thread pool).

:class:`Serializer` runs at most one convergence per pipeline at a time; the child events that arrive
meanwhile coalesce, with the children they name, into one more run. :class:`Health` is what the
liveness probe reads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator

Key = tuple[str, str]


class Health:
    """Time of the last successful reconcile or API observation, and the runs in progress (monotonic s)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last_success = time.monotonic()
        self._running: dict[int, float] = {}

    def succeeded(self) -> None:
        with self._lock:
            self.last_success = time.monotonic()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        token = id(threading.current_thread())
        with self._lock:
            self._running[token] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(token, None)

    def problem(self, stale_seconds: float) -> str | None:
        """Why the operator looks stuck (None: healthy): no success for ``stale_seconds``, or a run that long."""
        now = time.monotonic()
        with self._lock:
            age = now - self.last_success
            longest = max((now - t for t in self._running.values()), default=0.0)
        if age > stale_seconds:
            return f"no successful reconcile or API call for {age:.0f} s (limit {stale_seconds:.0f} s)"
        if longest > stale_seconds:
            return f"a reconcile has been running for {longest:.0f} s (limit {stale_seconds:.0f} s)"
        return None


class Serializer:
    """At most one convergence per key (``(namespace, pipeline)``) at a time.

    :meth:`exclusive` (the pipeline's own handlers) waits for the running one; :meth:`request` (child
    events) runs now or hands its items (the children that changed) to the run in flight, which runs
    once more with every item handed over meanwhile.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Key, threading.Lock] = {}
        self._pending: dict[Key, set[Hashable]] = {}

    def _lock(self, key: Key) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    @contextlib.contextmanager
    def exclusive(self, key: Key) -> Iterator[None]:
        """Wait for the key's running convergence, then hold it (it converges every child: pending
        items are dropped)."""
        with self._lock(key):
            with self._guard:
                self._pending.pop(key, None)
            yield

    def request(self, key: Key, items: Iterable[Hashable], run: Callable[[frozenset[Hashable]], None]) -> None:
        """Run ``run(items)`` now, or, when a run of ``key`` is in flight, make it run once more with them."""
        lock = self._lock(key)
        with self._guard:
            self._pending.setdefault(key, set()).update(items)
        while True:
            if not lock.acquire(blocking=False):
                return  # the holder sees the pending items
            try:
                while (taken := self._take(key)) is not None:
                    run(taken)
            finally:
                lock.release()
            with self._guard:
                if not self._pending.get(key):
                    return

    def _take(self, key: Key) -> frozenset[Hashable] | None:
        with self._guard:
            items = self._pending.pop(key, None)
            return frozenset(items) if items else None
