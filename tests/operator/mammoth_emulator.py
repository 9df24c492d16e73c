"""A test-side extension of KMock's ``KubernetesEmulator`` that behaves enough like an API server.

KMock 0.8's emulator stores objects and serves list/watch/get/create/patch/delete, but knows nothing
of Kubernetes semantics. This subclass adds what the operator, kopf and ``kubectl`` rely on:

* ``metadata.uid``, ``resourceVersion`` (a global counter), ``generation`` (bumped when anything but
  ``metadata``/``status`` changes) for the kinds whose API strategy keeps one (`has_generation`:
  not ConfigMaps, Secrets, Services), ``creationTimestamp``, the namespace from the URL;
* the status subresource: a patch to ``.../status`` changes only ``status``, a patch to the object
  ignores ``status`` (for the CRD and Deployments, as declared);
* declared resources with full discovery info (kinds, verbs, namespaced, short names), including the
  core group and ``v1/namespaces``, so ``kubectl`` can map kinds to resources;
* for custom resources whose CRD was created: structural defaulting, pruning of unknown fields,
  validation against the ``openAPIV3Schema`` (``jsonschema``) and evaluation of the
  ``x-kubernetes-validations`` CEL rules (``cel-python``), with the operator's own implementation
  (:mod:`mammoth_operator.validation`, so admission here and the operator's re-check cannot drift);
  a violation answers 422 ``Invalid`` like the real API server;
* a request log of writes (``writes``) to count what a client changed, and of single-object reads
  (``reads``);
* what a real API server does where the operator's faults live: built-in defaulting
  (``emulator_semantics``: a null Deployment ``replicas`` becomes 1 ...), ``PUT`` updates,
  409 ``Conflict`` for a write carrying a stale ``metadata.resourceVersion``, the ``Table`` answer
  to ``kubectl get`` (printer columns), deletion propagation, garbage collection, finalizers,
  namespace termination and per-subject authorization with owner-reference permission enforcement
  (``emulator_lifecycle``); ``stall`` delays chosen requests (timeouts of a stuck server);
* a watch that misses no write made while it sends its listing, and a watch from a
  ``resourceVersion`` that sends only the changes after it, from a bounded history of events
  (the API server's watch cache; ``410 Gone`` for a version older than the history), not the whole
  state again (`MammothEmulator._serve_watch`, :class:`WatchCache`); one version counter for every
  write, and a deletion's event carries a version of its own;
* a write that leaves an object as it was stores nothing: the same ``resourceVersion`` in the answer,
  no watch event (still logged in ``writes``: the client sent it).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import ipaddress
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import aiobus, dicts, enums, k8s, parsing

import emulator_protobuf
from emulator_discovery import (BUILTIN_RESOURCES, EXTRA_BUILTINS, RESOURCE_VERSIONS, VERBS,  # noqa: F401 (re-exported)
                                DiscoveryMixin)
from emulator_lifecycle import LifecycleMixin, Permission, request_permission, resource_key  # noqa: F401 (re-exported)
from emulator_semantics import default_builtin, label_selector, selected
from mammoth_operator.validation import validate_custom_resource

_original_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """KMock 0.8 reads ``/api/v1/namespaces[/NAME]`` as a namespaced path and fails: map it to the resource."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"]:
        if len(parts) == 3:
            return parsing.ParsedPath("", "v1", "namespaces")
        if len(parts) == 4:
            return parsing.ParsedPath("", "v1", "namespaces", None, parts[3])
        if len(parts) == 5 and parts[4] in ("status", "finalize"):
            return parsing.ParsedPath("", "v1", "namespaces", None, parts[3], parts[4])
    return _original_parse_path(path)


parsing.parse_path = _parse_path  # the request parser looks it up on the module at every request

_original_guess_k8s = parsing.guess_k8s


def _guess_k8s(k8s_path: parsing.ParsedPath, method: enums.method, query: dict[str, str]) -> enums.action | None:
    """KMock 0.8 has no action for ``PUT`` on a named object: it is an update (a full replace)."""
    if method == enums.method.PUT and k8s_path.group is not None and k8s_path.name is not None:
        return enums.action.UPDATE
    return _original_guess_k8s(k8s_path, method, query)


parsing.guess_k8s = _guess_k8s
emulator_protobuf.install()  # client-go's typed clients (Helm's storage, kubectl create) send protobuf

_RV = RESOURCE_VERSIONS

def _invalid(kind: str, name: str, causes: list[str]) -> k8s.KubernetesError:
    return k8s.KubernetesError(
        status=422, reason="Invalid",
        message=f'{kind} "{name}" is invalid: ' + "; ".join(causes),
        details={"name": name, "kind": kind, "causes": [{"message": c} for c in causes]},
    )


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _removal_patch(old: Any, new: Any) -> Any:
    """A merge patch turning ``old`` into exactly ``new`` (``None`` for removed keys)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        if key in old and isinstance(old[key], dict) and isinstance(value, dict):
            patch[key] = _removal_patch(old[key], value)
        else:
            patch[key] = value
    return patch


#: Groups and resources whose objects carry ``metadata.generation`` on a real API server (their
#: registry strategy sets and raises it); custom resources always do. Core ``v1`` objects here
#: (ConfigMaps, Secrets, Services, Namespaces, Events) have none.
_GENERATION_PREFIXES = ("apps/", "batch/", "policy/", "autoscaling/", "networking.k8s.io/",
                        "apiextensions.k8s.io/")


def has_generation(key: str, custom: bool) -> bool:
    """Whether objects of resource ``key`` (``group/version/plural``) carry ``metadata.generation``."""
    return custom or key.startswith(_GENERATION_PREFIXES)


def _version(event: dict[str, Any]) -> int:
    return int((event.get("object") or {}).get("metadata", {}).get("resourceVersion") or 0)


@attrs.mutable(weakref_slot=True)
class WatchCache(aiobus.Bus[Any]):
    """KMock's event bus of one resource that also keeps its last ``limit`` events, as the API
    server's watch cache does, so a watch can start from a ``resourceVersion``.

    A ``DELETED`` event gets a version of its own (the API server's deletion is a write; KMock sent
    the object's last version). Each event carries the object's previous state under ``_prev`` (for
    a watch's label selector, see `MammothEmulator._serve_watch`; not sent). Every ``put`` happens
    under the emulator's lock, so the history is in version order.
    """

    limit: int = 10_000
    history: collections.deque[dict[str, Any]] = attrs.field(init=False)
    #: The version of the newest event dropped from ``history`` (0: none dropped).
    expired: int = attrs.field(init=False, default=0)
    #: (namespace, name) -> the object as its last event left it (each event's ``_prev``)
    last: dict[tuple[Any, Any], dict[str, Any]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.history = collections.deque()

    async def put(self, *items: Any) -> None:
        stamped = []
        for event in items:
            if isinstance(event, dict) and event.get("type") == "DELETED":
                obj = copy.deepcopy(event["object"])
                obj.setdefault("metadata", {})["resourceVersion"] = str(next(_RV))
                event = {"type": "DELETED", "object": obj}
            if isinstance(event, dict):
                meta = (event.get("object") or {}).get("metadata") or {}
                where = (meta.get("namespace"), meta.get("name"))
                event = dict(event, _prev=self.last.get(where))
                if event["type"] == "DELETED":
                    self.last.pop(where, None)
                else:
                    self.last[where] = copy.deepcopy(event["object"])
                self.history.append(event)
                while len(self.history) > self.limit:
                    self.expired = _version(self.history.popleft())
            stamped.append(event)
        await super().put(*stamped)

    def since(self, version: str) -> list[dict[str, Any]] | None:
        """The events after ``version`` in order, or None when the history no longer reaches back to it.

        Raises:
            ValueError: ``version`` is not a number (the API server answers 400 then; so does the watch).
        """
        after = int(version)
        if after < self.expired:
            return None
        return [event for event in self.history if _version(event) > after]


@attrs.define(kw_only=True)
class MammothEmulator(LifecycleMixin, DiscoveryMixin, kmock.KubernetesEmulator):
    """KMock's emulator plus metadata, status subresources, discovery, CRD validation, defaulting,
    conflicts, tables, deletion semantics and authorization (see module)."""

    crds: dict[str, dict[str, Any]] = attrs.field(factory=dict)  # "group/version/plural" -> CRD
    status_subresources: set[str] = attrs.field(factory=set)
    writes: list[dict[str, Any]] = attrs.field(factory=list)
    #: ``GET`` requests of one named object (resource key, namespace, name), to count what a client read.
    reads: list[tuple[str, str | None, str]] = attrs.field(factory=list)
    pruned: list[str] = attrs.field(factory=list)
    openapi_paths: dict[str, Any] = attrs.field(factory=dict)
    admission: bool = True  # False: store custom resources unchecked (an older CRD, a bypassed webhook)
    #: Decides the requests bearing ``subject_token`` (None: every request is allowed).
    authorizer: Callable[[Permission], bool] | None = None
    subject_token: str = "operator-serviceaccount-token"
    denied: list[Permission] = attrs.field(factory=list)
    checks: list[Permission] = attrs.field(factory=list)
    #: Seconds to hold a request before answering it (None or 0: answer at once).
    stall: Callable[[kmock.Request], float] | None = None
    _cluster_ips: Any = attrs.field(factory=lambda: iter(ipaddress.ip_network("10.96.0.0/16").hosts()))
    #: ids of the requests being answered whose write leaves the stored object as it was
    _unchanged: set[int] = attrs.field(factory=set)
    #: Events each resource's watch cache keeps (:class:`WatchCache`).
    watch_history: int = 10_000
    #: Resource keys (``"apps/v1/deployments"``) whose watch events are held back, in order, until the
    #: key is removed: a lagging watch (the API server's or the network's), which the ``stall`` of
    #: requests cannot make because a watch's events flow long after its request was answered.
    watch_lag: set[str] = attrs.field(factory=set)

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """A watch as the API server serves it (KMock's had two gaps).

        * No ``resourceVersion`` (or ``"0"``): the state now as ``ADDED`` events, then every change.
          The listing's snapshot and the subscription to the event bus are taken under one hold of
          the lock every write takes, so a write made while the listing is being sent reaches the
          watcher after it (KMock subscribed only once the listing was sent: such a write was lost).
        * A ``resourceVersion``: only the changes after it, from the resource's :class:`WatchCache`,
          then every change; ``ERROR 410 Expired`` when the cache no longer reaches back to it (the
          client lists again). KMock sent the whole state as ``ADDED`` events instead, so every
          watch a client (re)started from its listing's version replayed old state as new events.
        """
        yield b""
        bus = self._buses[request.resource]
        version = request.params.get("resourceVersion") or "0"
        try:
            matches = label_selector(request.params.get("labelSelector"))
        except ValueError:
            matches, version = None, ""
        async with self._lock:
            if version == "0":
                objs = self._KubernetesEmulator__get_objs(request, strict=False)
                backlog: list[dict[str, Any]] | None = [{"type": "ADDED", "object": obj.raw} for obj in objs
                                                        if not obj.deleted]
            else:
                try:
                    backlog = bus.since(version) if version else []
                except ValueError:
                    backlog = []
                    version = ""
            marker = await bus.mark()
        try:
            if not version:
                yield {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                   "reason": "BadRequest", "code": 400,
                                                   "message": "resourceVersion or labelSelector: not valid"}}
                return
            if backlog is None:
                yield {"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410,
                    "message": f"too old resource version: {version} ({bus.expired})"}}
                return
            for event in backlog:
                if (seen := self._watched(request, matches, event)) is not None:
                    yield seen
            async for event in bus.stream(since=marker):
                while self._key(request) in self.watch_lag:
                    await asyncio.sleep(0.02)
                if (seen := self._watched(request, matches, event)) is not None:
                    yield seen
        finally:
            await bus.unmark(marker)

    def _watched(self, request: kmock.Request, matches: Any, event: dict[str, Any]) -> dict[str, Any] | None:
        """The event as this watch sees it (None: not at all): its namespace and name, and its label
        selector as the API server's watch cache applies it: an object that starts matching is
        ``ADDED``, one that stops matching ``DELETED`` (its previous content, the event's version)."""
        obj = event.get("object", {})
        meta = obj.get("metadata", {})
        if not self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"), meta.get("name"),
                                               strict=False):
            return None
        kind, prev = event.get("type"), event.get("_prev")
        if kind not in ("ADDED", "MODIFIED", "DELETED") or matches is None:
            return {"type": kind, "object": obj}
        now_ok, before_ok = selected(matches, obj), selected(matches, prev)
        if kind == "DELETED":
            return {"type": kind, "object": obj} if now_ok else None
        if now_ok:
            return {"type": "MODIFIED" if kind == "MODIFIED" and before_ok else "ADDED", "object": obj}
        if before_ok:
            gone = copy.deepcopy(prev)
            gone.setdefault("metadata", {})["resourceVersion"] = meta.get("resourceVersion")
            return {"type": "DELETED", "object": gone}
        return None

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._buses = collections.defaultdict(lambda: WatchCache(limit=self.watch_history))
        for key, kind, namespaced, short, subresources in BUILTIN_RESOURCES:
            self.resources[key] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=namespaced, verbs=VERBS,
                shortnames=short, subresources=subresources)
            if "status" in subresources and key not in ("v1/namespaces",):
                self.status_subresources.add(key)
        self.fallback["get /openapi/v3"] << (lambda request: {"paths": self.openapi_paths})
        self._serve_builtin_openapi()
        self.objects["v1/namespaces", None, "default"] = {
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "default", "uid": str(uuid.uuid4()), "resourceVersion": "1"}}

    # -- request interception -----------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> Any:
        if self.stall is not None and (delay := self.stall(request)):
            await asyncio.sleep(delay)
        if request.resource is not None and request.method == enums.method.GET and request.name:
            self.reads.append((self._key(request), request.namespace, request.name))
        if request.resource is not None:
            self._server_side_apply(request)
            self._authorize_request(request)
        if request.resource is not None and request.action in (enums.action.CREATE, enums.action.UPDATE):
            async with self._lock:
                self._refuse_create_in_terminating(request)
                self._prepare_write(request)
        if request.resource is not None and request.action == enums.action.DELETE and request.name:
            async with self._lock:
                self._prepare_delete(request, self._key(request))
        try:
            if id(request) in self._unchanged:  # answer with the stored object, as KMock's update does,
                self._unchanged.discard(id(request))  # without its patch and MODIFIED event
                return await super(kmock.KubernetesEmulator, self)._handle(request)
            return await super()._handle(request)
        finally:
            if request.resource is not None and request.action in (enums.action.CREATE, enums.action.UPDATE, enums.action.DELETE):
                async with self._lock:
                    await self._collect_garbage()

    def _server_side_apply(self, request: kmock.Request) -> None:
        """``application/apply-patch+yaml`` (Helm 4's default): creates a missing object, else merges.

        The merge is a JSON merge patch (lists replaced, no field managers): enough for installs and
        upgrades of whole manifests, which is how Helm applies.
        """
        if request.action != enums.action.UPDATE or "apply-patch" not in str(request.headers.get("Content-Type", "")):
            return
        if self._stored(request) is None and isinstance(request.data, dict):
            request.data.setdefault("metadata", {}).setdefault("name", request.name)
            object.__setattr__(request, "action", enums.action.CREATE)
            object.__setattr__(request, "method", enums.method.POST)

    def _key(self, request: kmock.Request) -> str:
        return resource_key(request.resource)

    def _default(self, key: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Built-in defaulting (after admission), as the API server applies it on every write."""
        if key not in self.crds:
            default_builtin(key, obj, str(next(self._cluster_ips)))
        return obj

    def _prepare_write(self, request: kmock.Request) -> None:
        """Turn the request body into what a real API server would store (mutating it in place)."""
        if not isinstance(request.data, dict):
            if request.action == enums.action.UPDATE and isinstance(request.data, list):
                self._jsonpatch_to_merge(request)
            else:
                raise k8s.KubernetesError(status=415, reason="UnsupportedMediaType", message="body must be a JSON object")
        key = self._key(request)
        data: dict[str, Any] = request.data
        if request.action == enums.action.CREATE:
            meta = data.setdefault("metadata", {})
            if request.namespace:
                meta["namespace"] = request.namespace
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = str(next(_RV))
            meta.pop("generation", None)
            if has_generation(key, key in self.crds):
                meta["generation"] = 1
            meta["creationTimestamp"] = _now()
            final = self._default(key, self._admit(key, copy.deepcopy(data), meta.get("name", ""), request))
            self._enforce_owner_references(request, final, None)
            data.clear()
            data.update(final)
            if key == "apiextensions.k8s.io/v1/customresourcedefinitions":
                self._register_crd(final)
            self.writes.append({"verb": "create", "resource": key, "namespace": meta.get("namespace"),
                                "name": meta.get("name"), "body": copy.deepcopy(final)})
            return

        obj = self._stored(request)
        if obj is None:
            return  # the base class answers 404
        old = copy.deepcopy(obj.raw)
        logged = copy.deepcopy(data)
        self._refuse_stale(key, request, old, data)
        new = self._updated(key, request, old, copy.deepcopy(data))
        new.setdefault("metadata", {})
        for field in ("uid", "namespace", "name", "creationTimestamp", "generation"):
            if field in old.get("metadata", {}):
                new["metadata"][field] = old["metadata"][field]
        final = self._admit(key, new, request.name or "", request)
        if request.subresource != "status":
            final = self._default(key, final)
            self._enforce_owner_references(request, final, old)
        strip = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        if has_generation(key, key in self.crds):
            generation = int(old.get("metadata", {}).get("generation", 1))
            if strip(final) != strip(old):
                generation += 1
            final["metadata"]["generation"] = generation
        else:
            final["metadata"].pop("generation", None)
        self.writes.append({"verb": "patch", "resource": key, "namespace": request.namespace, "name": request.name,
                            "subresource": request.subresource, "body": logged})
        final["metadata"]["resourceVersion"] = old.get("metadata", {}).get("resourceVersion")
        if final == old:  # the API server stores nothing: same resourceVersion, no watch event
            self._unchanged.add(id(request))
            return
        final["metadata"]["resourceVersion"] = str(next(_RV))
        data.clear()
        data.update(_removal_patch(old, final))

    def _updated(self, key: str, request: kmock.Request, old: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        """The object after a merge patch or, for ``PUT``, a full replace (status kept apart)."""
        status_apart = key in self.status_subresources
        if request.method == enums.method.PUT:
            if status_apart and request.subresource == "status":
                new = dict(copy.deepcopy(old), status=body.get("status"))
            else:
                new = body
                if status_apart:
                    new.pop("status", None)
                    if "status" in old:
                        new["status"] = copy.deepcopy(old["status"])
            return {k: v for k, v in new.items() if v is not None}
        if request.subresource == "scale":  # only the replica count goes through the scale subresource
            body = {"spec": {"replicas": (body.get("spec") or {}).get("replicas")}}
        elif status_apart:
            if request.subresource == "status":
                body = {"status": body.get("status")} if "status" in body else {}
            else:
                body.pop("status", None)
        return dict(dicts.patch_dict(copy.deepcopy(old), body))

    @staticmethod
    def _refuse_stale(key: str, request: kmock.Request, old: dict[str, Any], body: dict[str, Any]) -> None:
        """409 Conflict when the write names a ``resourceVersion`` other than the stored one."""
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        stored = (old.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and str(wanted) != str(stored):
            group = key.split("/")[0] if key.count("/") == 2 else ""
            plural = key.rsplit("/", 1)[-1]
            raise k8s.KubernetesError(status=409, reason="Conflict", message=(
                f'Operation cannot be fulfilled on {plural}{"." + group if group else ""} "{request.name}": '
                "the object has been modified; please apply your changes to the latest version and try again"))

    def _jsonpatch_to_merge(self, request: kmock.Request) -> None:
        obj = self._stored(request)
        if obj is None:
            return
        old = copy.deepcopy(obj.raw)
        try:
            new = dicts.patch_dict(copy.deepcopy(old), request.data)
        except jsonpatch.JsonPatchTestFailed as e:
            raise k8s.KubernetesError(status=409, reason="Conflict", message=f"the object has been modified: {e}") from e
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
            raise k8s.KubernetesError(status=422, reason="Invalid", message=f"invalid JSON patch: {e}") from e
        request.data.clear()  # type: ignore[union-attr]
        object.__setattr__(request, "data", _removal_patch(old, dict(new)))

    def _stored(self, request: kmock.Request) -> Any:
        key = (request.resource, request.namespace, request.name)
        if not request.name or key not in self.objects:
            return None
        obj = self.objects[key]
        return None if obj.deleted else obj

    def _admit(self, key: str, obj: dict[str, Any], name: str, request: kmock.Request) -> dict[str, Any]:
        crd = self.crds.get(key)
        if crd is None or not self.admission:
            return obj
        final, pruned, violations = validate_custom_resource(crd, obj)
        if pruned and request.params.get("fieldValidation") == "Strict":
            violations = [f'unknown field "{p}"' for p in pruned] + violations
        if violations:
            raise _invalid(crd["spec"]["names"]["kind"], name, violations)
        self.pruned.extend(f"{name}: {p}" for p in pruned)
        return final

