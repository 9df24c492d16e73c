"""Coordination of the convergences of one operator process (thread-safe; kopf runs sync handlers
in a thread pool).

:class:`Serializer` runs at most one convergence per pipeline at a time; the child events that arrive
meanwhile coalesce, with the children they name, into one more run. :class:`Rechecks` runs a
convergence of some children later (at most one timer per pipeline). :class:`Health` is what the
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
    once more with every item handed over meanwhile, an exclusive run too: when it ends, the items
    handed to it run with the ``run`` of the latest request (its convergence read those children
    before their events' changes, so it does not cover them).
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Key, threading.Lock] = {}
        self._pending: dict[Key, set[Hashable]] = {}
        self._runs: dict[Key, Callable[[frozenset[Hashable]], None]] = {}

    def _lock(self, key: Key) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    @contextlib.contextmanager
    def exclusive(self, key: Key) -> Iterator[None]:
        """Wait for the key's running convergence, then hold it (it converges every child: the items
        pending now are dropped); when it ends, also by an exception, run the items handed over
        meanwhile (see the class)."""
        lock = self._lock(key)
        lock.acquire()
        with self._guard:
            self._pending.pop(key, None)
        try:
            yield
        finally:
            self._drain(key, lock, held=True)

    def request(self, key: Key, items: Iterable[Hashable], run: Callable[[frozenset[Hashable]], None]) -> None:
        """Run ``run(items)`` now, or, when a run of ``key`` is in flight, make it run once more with
        them. ``run`` should handle its own errors: one it raises ends this call (and is raised here)
        and leaves the items that came meanwhile to the next request."""
        lock = self._lock(key)
        with self._guard:
            self._pending.setdefault(key, set()).update(items)
            self._runs[key] = run
        self._drain(key, lock, held=False)

    def _drain(self, key: Key, lock: threading.Lock, held: bool) -> None:
        """Run the pending items of ``key`` until none are left, holding its lock (``held``: already
        held by this thread); return at once when another thread holds it (that one runs them)."""
        while True:
            if not held and not lock.acquire(blocking=False):
                return  # the holder sees the pending items
            try:
                while (taken := self._take(key)) is not None:
                    with self._guard:
                        run = self._runs[key]
                    run(taken)
            finally:
                lock.release()
                held = False
            with self._guard:
                if not self._pending.get(key):
                    return

    def _take(self, key: Key) -> frozenset[Hashable] | None:
        with self._guard:
            items = self._pending.pop(key, None)
            return frozenset(items) if items else None


class Rechecks:
    """Convergences of some children of a pipeline to run later, one timer per key at a time: the
    children scheduled while a timer waits join its run, at the time asked for the first of them
    (a convergence that still finds a child uncertain schedules it again).

    ``run(key, children)`` runs on the timer's thread; it should handle its own errors.
    """

    def __init__(self, run: Callable[[Key, frozenset[Hashable]], None]) -> None:
        self._run = run
        self._guard = threading.Lock()
        self._due: dict[Key, set[Hashable]] = {}
        self._timers: dict[Key, threading.Timer] = {}
        self._closed = False

    def schedule(self, key: Key, children: Iterable[Hashable], delay: float) -> None:
        """Converge ``children`` of ``key`` in ``delay`` seconds (joining a timer already waiting)."""
        with self._guard:
            if self._closed:
                return
            self._due.setdefault(key, set()).update(children)
            if key in self._timers:
                return
            timer = threading.Timer(delay, self._fire, args=(key,))
            timer.daemon = True
            self._timers[key] = timer
            timer.start()

    def _fire(self, key: Key) -> None:
        with self._guard:
            self._timers.pop(key, None)
            children = frozenset(self._due.pop(key, set()))
            if self._closed or not children:
                return
        self._run(key, children)

    def close(self) -> None:
        """Cancel every waiting timer and schedule nothing more (the operator is stopping)."""
        with self._guard:
            self._closed = True
            for timer in self._timers.values():
                timer.cancel()
            self._timers.clear()
            self._due.clear()
