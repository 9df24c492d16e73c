"""Coordination of the convergences of one operator process (thread-safe; kopf runs sync handlers
in a thread pool).

:class:`Serializer` runs at most one convergence per pipeline at a time; the child events that arrive
meanwhile coalesce, with the children they name, into one more run. :class:`Retries` runs a failed
convergence of some children again after a backoff (at most one timer per pipeline). :class:`Health`
is what the liveness probe reads.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

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
        #: key -> [its lock, the callers using it]; forgotten when the last one leaves with nothing pending
        self._locks: dict[Key, list[Any]] = {}
        self._pending: dict[Key, set[Hashable]] = {}
        self._runs: dict[Key, Callable[[frozenset[Hashable]], None]] = {}

    def _enter(self, key: Key) -> threading.Lock:
        with self._guard:
            entry = self._locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
            return entry[0]

    def _leave(self, key: Key) -> None:
        with self._guard:
            entry = self._locks[key]
            entry[1] -= 1
            if entry[1] == 0 and not self._pending.get(key):
                del self._locks[key]
                self._pending.pop(key, None)
                self._runs.pop(key, None)

    @property
    def keys(self) -> int:
        """How many keys the serializer holds state for (in use or with items pending)."""
        with self._guard:
            return len(self._locks)

    @contextlib.contextmanager
    def exclusive(self, key: Key) -> Iterator[None]:
        """Wait for the key's running convergence, then hold it (it converges every child: the items
        pending now are dropped); when it ends, also by an exception, run the items handed over
        meanwhile (see the class)."""
        lock = self._enter(key)
        try:
            lock.acquire()
            with self._guard:
                self._pending.pop(key, None)
            try:
                yield
            finally:
                self._drain(key, lock, held=True)
        finally:
            self._leave(key)

    def request(self, key: Key, items: Iterable[Hashable], run: Callable[[frozenset[Hashable]], None]) -> None:
        """Run ``run(items)`` now, or, when a run of ``key`` is in flight, make it run once more with
        them. ``run`` should handle its own errors: one it raises ends this call (and is raised here)
        and leaves the items that came meanwhile to the next request."""
        lock = self._enter(key)
        try:
            with self._guard:
                self._pending.setdefault(key, set()).update(items)
                self._runs[key] = run
            self._drain(key, lock, held=False)
        finally:
            self._leave(key)

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


class Retries:
    """Failed convergences of some children of a pipeline, run again after a backoff: 2, 4, 8 ... s
    (``first_delay`` doubled per retry round of the key that failed in a row, at most ``max_delay``),
    reset by :meth:`succeeded`. One timer per key at a time: children failing while it waits join its run,
    with the ``run`` given last. ``run(children)`` runs on the timer's thread, in a copy of the
    context variables of the :meth:`retry` call (kopf keeps its settings in one: ``kopf.warn`` and
    ``kopf.adopt`` need it), and should handle its own errors (a failure calls :meth:`retry` again).
    """

    def __init__(self, first_delay: float = 2.0, max_delay: float = 300.0) -> None:
        self._first_delay, self._max_delay = first_delay, max_delay
        self._guard = threading.Lock()
        self._due: dict[Key, set[Hashable]] = {}
        self._runs: dict[Key, tuple[Callable[[frozenset[Hashable]], None], contextvars.Context]] = {}
        self._timers: dict[Key, threading.Timer] = {}
        self._delays: dict[Key, float] = {}
        self._failures: dict[Key, int] = {}
        self._closed = False

    def retry(self, key: Key, children: Iterable[Hashable], run: Callable[[frozenset[Hashable]], None]) -> float:
        """A run of ``children`` of ``key`` failed: run them with ``run`` after the key's next delay
        (joining a timer already waiting); returns that delay in seconds."""
        with self._guard:
            if self._closed:
                return 0.0
            self._due.setdefault(key, set()).update(children)
            self._runs[key] = (run, contextvars.copy_context())
            if key in self._timers:  # a failure while a retry waits joins it: no new round, no longer delay
                return self._delays[key]
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
            delay = self._delays[key] = min(self._first_delay * 2 ** failures, self._max_delay)
            timer = threading.Timer(delay, self._fire, args=(key,))
            timer.daemon = True
            self._timers[key] = timer
            timer.start()
        return delay

    def succeeded(self, key: Key) -> None:
        """A run of ``key`` succeeded: its next failure is retried after the first delay again."""
        with self._guard:
            self._failures.pop(key, None)

    def _fire(self, key: Key) -> None:
        with self._guard:
            self._timers.pop(key, None)
            self._delays.pop(key, None)
            children = frozenset(self._due.pop(key, set()))
            entry = self._runs.pop(key, None)
            if self._closed or not children or entry is None:
                return
        run, context = entry
        context.run(run, children)

    def close(self) -> None:
        """Cancel every waiting timer and retry nothing more (the operator is stopping)."""
        with self._guard:
            self._closed = True
            for timer in self._timers.values():
                timer.cancel()
            self._timers.clear()
            self._delays.clear()
            self._due.clear()
            self._runs.clear()
