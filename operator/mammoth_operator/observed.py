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
of that convergence, so the status it writes reflects its own writes. An optional child the spec
no longer wants is looked up in its index only: one of ours carries the label, and one created so
recently that its event is still on the way is deleted when that event arrives.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
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


class View:
    """The children of one namespace as one convergence sees them (see the module docstring).

    ``indices`` maps index id -> ``kopf.Index`` (:func:`indices_of`); ``children`` is the API
    client for the ``GET`` of a child no index holds.
    """

    def __init__(self, children: kube.Children, indices: Mapping[str, Any]) -> None:
        self.children = children
        self._indices = indices
        self._written: dict[tuple[str, str, str], dict[str, Any] | None] = {}

    def indexed(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The child as this convergence wrote it or as its index holds it; None when neither has it."""
        key = (kind, namespace, name)
        if key in self._written:
            return self._written[key]
        store = self._indices[KINDS_BY_NAME[kind].index_id].get((namespace, name))
        return next(iter(store), None) if store else None

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

    def wrote(self, kind: str, namespace: str, name: str, obj: Mapping[str, Any] | None) -> None:
        """Record what this convergence wrote (the API's answer; None: deleted)."""
        self._written[(kind, namespace, name)] = None if obj is None else dict(obj)
