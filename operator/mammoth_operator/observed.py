"""The children as the operator observes them: one kopf index per child kind, no list calls.

kopf keeps each index current from the watch stream of its kind (``@kopf.index``, filtered on the
``app.kubernetes.io/managed-by: mammoth-operator`` label, by the API server too: `handlers.configure`),
updates it before it runs the handlers of
the same event, and starts no handler before every index holds its initial listing. So a handler
reads the children of a pipeline without calling the API.

:class:`View` is what one convergence reads: the indexes, plus one ``GET`` for a child an index has
no entry for. Such a child is either absent (the usual case: about to be created, or deleted by
hand), created moments ago (its watch event not delivered yet), or an object with the child's name
that does not carry our label (a name conflict): only the ``GET`` tells these apart. The objects the
convergence itself wrote are recorded with :meth:`View.wrote` and win over the indexes for the rest
of that convergence, so the status it writes reflects its own writes; they also go to the process's
:class:`OwnWrites`: a child whose index still holds a state older than the operator's last write of
it is read from that write (a watch delivers late, and a late event is no drift), one whose index
state cannot be ordered against the write is read with a ``GET``. An optional child the spec
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


#: Seconds the operator keeps its own write of a child when no state as new as it is observed (the
#: watch delivers it well within this; kopf waits 5 s for its own patches by default,
#: ``settings.persistence.consistency_timeout``): after that the index is believed again.
OWN_WRITE_PATIENCE_SECONDS = 10.0

Key = tuple[str, str, str]  # (kind, namespace, name)


def _managed(obj: Mapping[str, Any] | None) -> tuple[Any, Any]:
    """The metadata the operator writes: labels and its applied record (`kube.LAST_APPLIED_ANNOTATION`)."""
    meta = (obj or {}).get("metadata") or {}
    return meta.get("labels"), (meta.get("annotations") or {}).get(kube.LAST_APPLIED_ANNOTATION)


def _version(obj: Mapping[str, Any] | None) -> tuple[int | None, str | None]:
    meta = (obj or {}).get("metadata") or {}
    generation = meta.get("generation")
    return (int(generation) if generation else None), meta.get("resourceVersion")


#: What :meth:`OwnWrites.judge` says of an observed state: as new as the operator's last write (or
#: no write kept), older than it, or not to be ordered against it from the two objects alone.
CURRENT, OLDER, UNKNOWN = "current", "older", "unknown"


class OwnWrites:
    """What this operator process last wrote to each child, until its watch has delivered that write.

    A watch delivers a child's events in order, but late: an event (and the index it updates) may
    carry a state from before the operator's last write, such as the Deployment controller's status
    write made just before the operator patched the replicas. Taken for the child's state, it looks
    like drift, and a repair would patch the child again and report drift that never happened.

    :meth:`judge` orders an observed state against the write. Its own ``resourceVersion``: current.
    Both carry ``metadata.generation`` (Deployments, PodDisruptionBudgets, NetworkPolicies,
    HorizontalPodAutoscalers: the API server raises it on every spec change): a lower one is older,
    a higher one current; at the same generation the spec is the same, so a state with the write's
    labels and applied record differs only where the operator writes nothing (status): current.
    Anything else cannot be ordered from the objects: a ``resourceVersion`` may only be compared for
    equality (the API's contract: it is opaque), and kinds without a generation (Services,
    ConfigMaps, Secrets) or a write that changed only metadata give nothing else. The caller then
    reads the child from the API (:class:`View`). A write is forgotten once its own version or a higher
    generation is observed, the child is deleted, or :data:`OWN_WRITE_PATIENCE_SECONDS` pass.
    Thread-safe (kopf runs sync handlers in a thread pool).
    """

    def __init__(self, patience: float = OWN_WRITE_PATIENCE_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self._patience = patience
        self._clock = clock
        self._lock = threading.Lock()
        self._writes: dict[Key, tuple[dict[str, Any], float]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._writes)

    def record(self, key: Key, obj: Mapping[str, Any] | None) -> None:
        """The operator wrote ``obj`` (the API's answer) to child ``key``; None: deleted it."""
        with self._lock:
            if obj is None:
                self._writes.pop(key, None)
            else:
                self._writes[key] = (copy.deepcopy(dict(obj)), self._clock())

    def forget(self, key: Key) -> None:
        """The child is gone (its ``DELETED`` event): no write of it is kept any more."""
        with self._lock:
            self._writes.pop(key, None)

    def judge(self, key: Key, observed: Mapping[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
        """(:data:`CURRENT`, :data:`OLDER` or :data:`UNKNOWN`, the write) for ``observed``, a state
        of child ``key`` from an index or an event (None: not observed); the write is None with
        :data:`CURRENT`."""
        with self._lock:
            entry = self._writes.get(key)
            if entry is None:
                return CURRENT, None
            written, at = entry
            if self._clock() - at > self._patience:
                del self._writes[key]
                return CURRENT, None
            (wrote_gen, wrote_rv), (seen_gen, seen_rv) = _version(written), _version(observed)
            if seen_rv is not None and seen_rv == wrote_rv:
                del self._writes[key]
                return CURRENT, None
            if wrote_gen is not None and seen_gen is not None:
                if seen_gen > wrote_gen:
                    del self._writes[key]
                    return CURRENT, None
                if seen_gen < wrote_gen:
                    return OLDER, copy.deepcopy(written)
                if _managed(observed) == _managed(written):
                    return CURRENT, None
            return UNKNOWN, copy.deepcopy(written)


class View:
    """The children of one namespace as one convergence sees them (see the module docstring).

    ``indices`` maps index id -> ``kopf.Index`` (:func:`indices_of`); ``children`` is the API
    client for the ``GET`` of a child no index holds, or whose index state cannot be ordered against
    the operator's own last write of it (``own_writes``: the process's record; None: none kept).
    """

    def __init__(self, children: kube.Children, indices: Mapping[str, Any], own_writes: OwnWrites | None = None) -> None:
        self.children = children
        self._indices = indices
        self._own_writes = own_writes
        self._written: dict[tuple[str, str, str], dict[str, Any] | None] = {}

    def indexed(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The child as this convergence wrote it, else as the operator last wrote it when its index
        holds an older state (:class:`OwnWrites`), else as its index holds it; None when none has it.

        Raises:
            kubernetes.client.exceptions.ApiException: the ``GET`` of a child whose index state could
                not be ordered against the operator's last write of it failed (other than 404).
        """
        key = (kind, namespace, name)
        if key in self._written:
            return self._written[key]
        store = self._indices[KINDS_BY_NAME[kind].index_id].get((namespace, name))
        found = next(iter(store), None) if store else None
        verdict, written = self._own_writes.judge(key, found) if self._own_writes is not None else (CURRENT, None)
        if verdict == OLDER:
            return written
        if verdict == UNKNOWN:  # the API server's state decides: read it (and keep it for this convergence)
            fresh = self.children.read(KINDS_BY_NAME[kind].api_version, kind, namespace, name)
            self._written[key] = fresh
            return fresh
        return found

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The child as last observed (a dict as served), or None when it does not exist: as
        :meth:`indexed`, else from one ``GET``.

        Raises:
            kubernetes.client.exceptions.ApiException: a ``GET`` failed (other than 404).
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
