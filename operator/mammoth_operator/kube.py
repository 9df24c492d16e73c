"""Create-or-patch of children through the official ``kubernetes`` client, patching only what differs.

No server-side apply: an object that does not exist is created; one that exists gets a JSON merge
patch (``application/merge-patch+json``) holding only the fields whose observed value differs from the
desired one, so an unchanged spec patches nothing. Fields the operator set before but no longer
wants are removed (``null`` in the patch): the previous desired state is kept in the child's
``mammoth.dev/last-applied`` annotation, the way ``kubectl apply`` keeps its own.

A field the server defaults (``terminationMessagePath``, ``protocol`` ...) is not a difference: the
observed value only has to *contain* the desired one. Lists are compared item by item and replaced as
a whole when they differ (merge-patch semantics). A create-only field (``spec.replicas`` under an
HPA) is never in a patch, not even as ``null`` (a real server defaults a null ``replicas`` to 1).

An object with a child's name that this pipeline does not control (no owner reference with its uid
and ``controller: true``) is never patched: :class:`NameConflict`. Every API call carries a request
timeout (``Children(timeout=...)``), so a stuck API server fails the call instead of hanging it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
from collections.abc import Mapping
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from mammoth_operator.builders import Child, ChildRef, canonical_json
from mammoth_operator.config import GROUP as PIPELINE_GROUP
from mammoth_operator.config import PLURAL as PIPELINE_PLURAL
from mammoth_operator.config import VERSION as PIPELINE_VERSION

LAST_APPLIED_ANNOTATION = "mammoth.dev/last-applied"
MERGE_PATCH = "application/merge-patch+json"

logger = logging.getLogger(__name__)

_MISSING = object()

# (apiVersion, kind) -> (API class, method suffix of its namespaced operations)
_APIS: dict[tuple[str, str], tuple[type, str]] = {
    ("v1", "ConfigMap"): (kubernetes.client.CoreV1Api, "config_map"),
    ("v1", "Secret"): (kubernetes.client.CoreV1Api, "secret"),
    ("v1", "Service"): (kubernetes.client.CoreV1Api, "service"),
    ("apps/v1", "Deployment"): (kubernetes.client.AppsV1Api, "deployment"),
    ("policy/v1", "PodDisruptionBudget"): (kubernetes.client.PolicyV1Api, "pod_disruption_budget"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): (kubernetes.client.AutoscalingV2Api, "horizontal_pod_autoscaler"),
    ("networking.k8s.io/v1", "NetworkPolicy"): (kubernetes.client.NetworkingV1Api, "network_policy"),
}


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    """What :func:`apply` did to one child: ``action`` is ``created``, ``patched`` or ``unchanged``;
    ``patch`` the merge patch sent; ``obj`` the child afterwards (the API's answer, or as observed)."""

    kind: str
    name: str
    action: str
    patch: Mapping[str, Any] | None = None
    obj: Mapping[str, Any] | None = None


class NameConflict(Exception):
    """An object with a child's name exists and this pipeline does not control it (never taken over).

    ``previous`` is true when a pipeline of the same name with another uid controls it: a child of a
    pipeline deleted moments ago, which the garbage collector deletes soon (a pipeline deleted and
    created again); then retry soon, as the message says.
    """

    def __init__(self, kind: str, name: str, previous: bool = False) -> None:
        if previous:
            text = (f"{kind} {name} still belongs to a deleted pipeline of the same name; waiting for the "
                    "garbage collector to delete it")
        else:
            text = f"{kind} {name} exists and is not owned by this pipeline; delete or rename it"
        super().__init__(text)
        self.kind = kind
        self.name = name
        self.previous = previous


def controlled_by(observed: Mapping[str, Any], owner_uid: str) -> bool:
    """True when ``observed`` has an owner reference with ``owner_uid`` and ``controller: true``."""
    owners = (observed.get("metadata") or {}).get("ownerReferences") or []
    return any(o.get("uid") == owner_uid and o.get("controller") for o in owners)


def new_api_client() -> kubernetes.client.ApiClient:
    """An API client from the in-cluster service account, else from the kubeconfig (``KUBECONFIG``).

    No transparent urllib3 retries: a timed-out call fails after one timeout and the handler's own
    backoff decides what happens next (a retry per call would multiply every timeout by four).
    """
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=configuration)
    configuration.retries = 0
    return kubernetes.client.ApiClient(configuration)


class Children:
    """Typed access to the kinds of children a pipeline has, by (apiVersion, kind).

    ``timeout`` (seconds) bounds every call: connect and read (``_request_timeout``); a call past it
    raises ``urllib3`` timeout errors (the handlers retry them like a 5xx answer).
    """

    def __init__(self, api_client: kubernetes.client.ApiClient, timeout: float = 30.0) -> None:
        self.api_client = api_client
        self.timeout = timeout
        self._apis: dict[type, Any] = {}

    def _method(self, api_version: str, kind: str, verb: str) -> Any:
        try:
            cls, suffix = _APIS[(api_version, kind)]
        except KeyError:
            raise ValueError(f"unsupported child kind {api_version}/{kind}") from None
        if cls not in self._apis:
            self._apis[cls] = cls(self.api_client)
        method = getattr(self._apis[cls], f"{verb}_namespaced_{suffix}")
        return functools.partial(method, _request_timeout=self.timeout)

    def ping(self, timeout: float) -> None:
        """One cheap call (``GET /version``) proving the API server answers within ``timeout`` seconds."""
        kubernetes.client.VersionApi(self.api_client).get_code(_request_timeout=timeout)

    def read_pipeline(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The MammothPipeline as served, or None when it does not exist."""
        api = kubernetes.client.CustomObjectsApi(self.api_client)
        try:
            response = api.get_namespaced_custom_object(PIPELINE_GROUP, PIPELINE_VERSION, namespace, PIPELINE_PLURAL,
                                                        name, _preload_content=False, _request_timeout=self.timeout)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(response.data)

    def read(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as a plain dict (camelCase, as served), or None when it does not exist."""
        try:
            response = self._method(api_version, kind, "read")(name, namespace, _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(response.data)

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create ``manifest`` (namespace from its metadata); returns the object as the API stored it."""
        method = self._method(manifest["apiVersion"], manifest["kind"], "create")
        response = method(manifest["metadata"]["namespace"], manifest, _preload_content=False)
        return json.loads(response.data)

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """Send a JSON merge patch; returns the object as the API stored it."""
        method = self._method(api_version, kind, "patch")
        response = method(name, namespace, patch, _content_type=MERGE_PATCH, _preload_content=False)
        return json.loads(response.data)

    def patch_pipeline_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patch ``status`` of a MammothPipeline through its status subresource (no-op when empty)."""
        if not status:
            return
        api = kubernetes.client.CustomObjectsApi(self.api_client)
        api.patch_namespaced_custom_object_status(
            PIPELINE_GROUP, PIPELINE_VERSION, namespace, PIPELINE_PLURAL, name, {"status": dict(status)},
            _content_type=MERGE_PATCH, _preload_content=False, _request_timeout=self.timeout)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete if present; True when something was deleted."""
        try:
            self._method(api_version, kind, "delete")(name, namespace, _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True


#: Keys whose values are resource quantities (a container's ``resources``): compared by amount.
_QUANTITY_MAPS = frozenset({"requests", "limits"})


def _same_quantity(observed: Any, desired: Any) -> bool:
    try:
        return bool(parse_quantity(observed) == parse_quantity(desired))
    except (ValueError, TypeError):
        return False


def covers(observed: Any, desired: Any, quantity: bool = False) -> bool:
    """True when ``observed`` already holds ``desired`` (extra observed keys are server defaults).

    Dicts: every desired key covered. Lists: same length, item by item. Scalars: equal, with
    ``1`` == ``"1"`` (quantities come back as strings). An absent field covers an empty desired one.
    Under ``requests`` and ``limits`` (``quantity``) values are resource quantities, equal by amount:
    the API server serves ``cpu: 0.5`` back as ``500m`` and ``memory: 1024Mi`` as ``1Gi``, which
    compared as text made every event of the Deployment a repair (a patch and a false ``Repaired``).
    """
    if observed is _MISSING:
        return desired in ({}, [], None)
    if isinstance(desired, Mapping):
        return isinstance(observed, Mapping) and all(
            covers(observed.get(k, _MISSING), v, quantity or k in _QUANTITY_MAPS) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(observed, list) and len(observed) == len(desired) and all(
            covers(o, d) for o, d in zip(observed, desired))
    if observed == desired and type(observed) is type(desired):
        return True
    if quantity and _same_quantity(observed, desired):
        return True
    if isinstance(desired, bool) or isinstance(observed, bool):
        return observed is desired
    if isinstance(desired, (int, float)) and isinstance(observed, (int, float)):
        return observed == desired
    if isinstance(desired, (int, str)) and isinstance(observed, (int, str)):
        return str(observed) == str(desired)
    return False


def merge_patch(last: Mapping[str, Any], desired: Mapping[str, Any], observed: Mapping[str, Any]) -> dict[str, Any]:
    """The smallest JSON merge patch turning ``observed`` into something covering ``desired``.

    Keys present in ``last`` (the previous desired state) but not in ``desired`` are removed.
    """
    patch: dict[str, Any] = {}
    for key, want in desired.items():
        have = observed.get(key, _MISSING)
        if isinstance(want, Mapping) and isinstance(have, Mapping):
            prev = last.get(key)
            sub = merge_patch(prev if isinstance(prev, Mapping) else {}, want, have)
            if sub:
                patch[key] = sub
        elif not covers(have, want):
            patch[key] = copy.deepcopy(want)
    for key in last:
        if key not in desired and key in observed:
            patch[key] = None
    return patch


def _without(manifest: Mapping[str, Any], paths: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    result = copy.deepcopy(dict(manifest))
    for path in paths:
        node: Any = result
        for key in path[:-1]:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return result


def _with_last_applied(managed: Mapping[str, Any]) -> dict[str, Any]:
    """``managed`` plus the annotation recording it (the annotation itself excluded from the record)."""
    record = copy.deepcopy(dict(managed))
    record.get("metadata", {}).get("annotations", {}).pop(LAST_APPLIED_ANNOTATION, None)
    result = copy.deepcopy(dict(managed))
    result.setdefault("metadata", {}).setdefault("annotations", {})[LAST_APPLIED_ANNOTATION] = canonical_json(record)
    return result


def apply(children: Children, child: Child, observed: Mapping[str, Any] | None, owner_uid: str) -> ApplyResult:
    """Create ``child`` or patch the fields that differ; never touches its ``create_only`` fields once created.

    ``observed`` is the object as read (None: absent). The manifest must carry ``metadata.namespace``
    (``kopf.adopt`` sets it).

    Raises:
        NameConflict: ``observed`` exists and is not controlled by ``owner_uid``.
        kubernetes.client.exceptions.ApiException: the API server refused (other than 404 on read).
    """
    manifest = child.manifest
    api_version, kind = manifest["apiVersion"], manifest["kind"]
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    managed = _with_last_applied(_without(manifest, child.create_only))
    if observed is None:
        created = children.create(copy.deepcopy(dict(manifest)) | {"metadata": managed["metadata"]})
        return ApplyResult(kind, name, "created", obj=created)
    if not controlled_by(observed, owner_uid):
        ours = {o.get("name") for o in manifest["metadata"].get("ownerReferences") or [] if o.get("uid") == owner_uid}
        previous = any(o.get("controller") and o.get("kind") == "MammothPipeline" and o.get("name") in ours
                       for o in (observed.get("metadata") or {}).get("ownerReferences") or [])
        raise NameConflict(kind, name, previous=previous)
    raw_last = (observed.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED_ANNOTATION)
    try:
        last = json.loads(raw_last) if raw_last else {}
    except ValueError:
        last = {}
    # A create-only field recorded before it became create-only must not turn into a null.
    patch = merge_patch(_without(last, child.create_only), managed, observed)
    if not patch:
        return ApplyResult(kind, name, "unchanged", obj=observed)
    patched = children.patch(api_version, kind, namespace, name, patch)
    return ApplyResult(kind, name, "patched", patch, patched)


def delete_unwanted(children: Children, namespace: str, owner_uid: str,
                    wanted_gone: list[tuple[ChildRef, Mapping[str, Any] | None]]) -> list[ChildRef]:
    """Delete the optional children a spec no longer wants (each with its observed object, None when
    absent), if this owner controls them; returns those deleted."""
    deleted = []
    for ref, observed in wanted_gone:
        if observed is None:
            continue
        if controlled_by(observed, owner_uid):
            if children.delete(ref.api_version, ref.kind, namespace, ref.name):
                deleted.append(ref)
    return deleted
