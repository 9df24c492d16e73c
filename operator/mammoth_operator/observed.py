"""The children as the operator observes them: one kopf index per child kind, no list calls.

kopf keeps each index current from the watch stream of its kind (``@kopf.index``, filtered on the
``app.kubernetes.io/managed-by: mammoth-operator`` label), updates it before it runs the handlers of
the same event, and starts no handler before every index holds its initial listing. So a handler
reads the children of a pipeline without calling the API.

:class:`View` is what one convergence reads: the indexes, plus one ``GET`` for a child an index has
no entry for. Such a child is either absent (the usual case: about to be created, or deleted by
hand), created moments ago (its watch event not delivered yet), or an object with the child's name
that does not carry our label (a name conflict): only the ``GET`` tells these apart. The objects the
convergence itself wrote are recorded with :meth:`View.wrote` and win over the indexes for the rest
of that convergence, so the status it writes reflects its own writes; they also go to the process's
:class:`OwnWrites`, which stands in for a child whose index still holds a state older than the
operator's last write of it (a watch delivers late, and a late event is no drift). An optional child the spec
no longer wants is looked up in its index only: one of ours carries the label, and one created so
recently that its event is still on the way is deleted when that event arrives.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from mammoth_operator import kube


@dataclasses.dataclass(frozen=True)
class ChildKind:
    """A kind of child: ``api_version``, ``kind``, the resource ``plural`` and its index's id."""

    api_version: str
    kind: str
    plural: str

    @property
    def index_id(self) -> str:
        """The kopf index id, also the keyword the index arrives under in every handler."""
        return f"{self.plural}_index"


#: Every kind of child a pipeline has, each with its own index and event handler.
CHILD_KINDS = (
    ChildKind("v1", "Secret", "secrets"),
    ChildKind("v1", "ConfigMap", "configmaps"),
    ChildKind("v1", "Service", "services"),
    ChildKind("apps/v1", "Deployment", "deployments"),
    ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ChildKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    ChildKind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
)
KINDS_BY_NAME = {kind.kind: kind for kind in CHILD_KINDS}


async def index_child(body: Mapping[str, Any], namespace: str, name: str,
                      **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """The indexing function of every child kind: ``(namespace, name)`` -> a snapshot of the object
    (a coroutine, so kopf runs it in its event loop, with no thread hop, before the event's handlers)."""
    return {(namespace, name): copy.deepcopy(dict(body))}


def indices_of(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The child indexes among a kopf handler's keyword arguments (index id -> ``kopf.Index``)."""
    return {kind.index_id: kwargs[kind.index_id] for kind in CHILD_KINDS}


#: Seconds the operator's own write of a child stands in for an observed state that is not that write
#: and cannot be ordered against it (no ``metadata.generation``): the watch delivers the write within
#: this time or the observed state is believed. kopf waits 5 s for its own patches by default
#: (``settings.persistence.consistency_timeout``); twice that here, for a loaded API server.
OWN_WRITE_PATIENCE_SECONDS = 10.0

Key = tuple[str, str, str]  # (kind, namespace, name)


def _version(obj: Mapping[str, Any] | None) -> tuple[int | None, str | None]:
    meta = (obj or {}).get("metadata") or {}
    generation = meta.get("generation")
    return (int(generation) if generation else None), meta.get("resourceVersion")


@dataclasses.dataclass(frozen=True)
class StandIn:
    """The operator's own write that stands in for an older observed state of a child.

    ``obj`` is the write (the API's answer); ``recheck_in`` is None when the observed state is known
    to be older (a lower ``metadata.generation``), else the seconds until the observed state is
    believed again (it may be a later change whose event the watch batched with the write's):
    converge that child again then.
    """

    obj: dict[str, Any]
    recheck_in: float | None


class OwnWrites:
    """What this operator process last wrote to each child, until its watch has delivered that write.

    A watch delivers a child's events in order, but late: an event (and the index it updates) may
    carry a state from before the operator's last write, such as the Deployment controller's status
    write made just before the operator patched the replicas. Taken for the child's state, it looks
    like drift, and a repair would patch the child again and report drift that never happened.

    An observed state is older than the write when both carry ``metadata.generation`` (Deployments,
    PodDisruptionBudgets, NetworkPolicies, HorizontalPodAutoscalers: the API server raises it on
    every spec change) and the observed one is lower. Without a generation (Services, ConfigMaps,
    Secrets) a ``resourceVersion`` can only be compared for equality (the API's contract: it is
    opaque), so a state other than the write counts as older for :data:`OWN_WRITE_PATIENCE_SECONDS`
    after the write, with a recheck when that ends (:class:`StandIn`). A write is forgotten once a
    state as new as it is observed, the child is deleted, or (without a generation) its patience ends.
    Thread-safe (kopf runs sync handlers in a thread pool).
    """

    def __init__(self, patience: float = OWN_WRITE_PATIENCE_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self._patience = patience
        self._clock = clock
        self._lock = threading.Lock()
        self._writes: dict[Key, tuple[dict[str, Any], float]] = {}

    def record(self, key: Key, obj: Mapping[str, Any] | None) -> None:
        """The operator wrote ``obj`` (the API's answer) to child ``key``; None: deleted it."""
        with self._lock:
            if obj is None:
                self._writes.pop(key, None)
            else:
                self._writes[key] = (copy.deepcopy(dict(obj)), self._clock())

    def forget(self, key: Key) -> None:
        """The child is gone (its ``DELETED`` event): no write of it stands in any more."""
        with self._lock:
            self._writes.pop(key, None)

    def stand_in(self, key: Key, observed: Mapping[str, Any] | None) -> StandIn | None:
        """The write to use instead of ``observed`` (a state of child ``key`` from an index or an
        event; None: not observed), or None when ``observed`` is as new as the last write (which is
        then forgotten) or there is none."""
        with self._lock:
            entry = self._writes.get(key)
            if entry is None:
                return None
            written, at = entry
            (wrote_gen, wrote_rv), (seen_gen, seen_rv) = _version(written), _version(observed)
            if seen_rv is not None and seen_rv == wrote_rv:
                del self._writes[key]
                return None
            if wrote_gen is not None and seen_gen is not None:
                if seen_gen >= wrote_gen:
                    del self._writes[key]
                    return None
                return StandIn(copy.deepcopy(written), None)
            left = at + self._patience - self._clock()
            if left <= 0:
                del self._writes[key]
                return None
            return StandIn(copy.deepcopy(written), left)


class View:
    """The children of one namespace as one convergence sees them (see the module docstring).

    ``indices`` maps index id -> ``kopf.Index`` (:func:`indices_of`); ``children`` is the API
    client for the ``GET`` of a child no index holds; ``own_writes`` the process's record of what it
    wrote (None: none kept). :attr:`rechecks` collects the children read from a write whose newness
    was not certain (child -> seconds until a convergence of it should run again).
    """

    def __init__(self, children: kube.Children, indices: Mapping[str, Any], own_writes: OwnWrites | None = None) -> None:
        self.children = children
        self._indices = indices
        self._own_writes = own_writes
        self._written: dict[tuple[str, str, str], dict[str, Any] | None] = {}
        self.rechecks: dict[tuple[str, str], float] = {}

    def indexed(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The child as this convergence wrote it, else as the operator last wrote it when its index
        holds an older state (:class:`OwnWrites`), else as its index holds it; None when none has it."""
        key = (kind, namespace, name)
        if key in self._written:
            return self._written[key]
        store = self._indices[KINDS_BY_NAME[kind].index_id].get((namespace, name))
        found = next(iter(store), None) if store else None
        stand_in = self._own_writes.stand_in(key, found) if self._own_writes is not None else None
        if stand_in is None:
            return found
        if stand_in.recheck_in is not None:
            self.rechecks[(kind, name)] = max(self.rechecks.get((kind, name), 0.0), stand_in.recheck_in)
        return stand_in.obj

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The child as last observed (a dict as served), or None when it does not exist: as
        :meth:`indexed`, else from one ``GET``.

        Raises:
            kubernetes.client.exceptions.ApiException: the fallback ``GET`` failed (other than 404).
        """
        found = self.indexed(kind, namespace, name)
        if found is not None or (kind, namespace, name) in self._written:
            return found
        return self.children.read(KINDS_BY_NAME[kind].api_version, kind, namespace, name)

    def wrote(self, kind: str, namespace: str, name: str, obj: Mapping[str, Any] | None, sent: bool = True) -> None:
        """Record the child as this convergence left it (the API's answer; None: deleted), here and,
        when a write was ``sent`` (not an unchanged child), in the process's :class:`OwnWrites`."""
        self._written[(kind, namespace, name)] = None if obj is None else dict(obj)
        if sent and self._own_writes is not None:
            self._own_writes.record((kind, namespace, name), obj)
