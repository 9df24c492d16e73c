"""Deletion, garbage collection and authorization for the emulator (mixed into ``MammothEmulator``).

What a real control plane does around deletion, done synchronously after every write:

* ``DELETE`` with ``propagationPolicy`` (query or ``DeleteOptions`` body): ``Background`` (the
  default) deletes the object, then the garbage collector deletes its dependents (objects whose
  every owner reference points at an absent uid); ``Foreground`` gives the owner a
  ``foregroundDeletion`` finalizer and a ``deletionTimestamp``, deletes the dependents, and
  removes the owner only once no dependent with ``blockOwnerDeletion`` remains; ``Orphan`` strips
  the owner references from the dependents.
* finalizers block deletion: an object with finalizers only gets a ``deletionTimestamp`` and goes
  away when the last finalizer is removed (KMock's own rule, kept).
* ``DELETE`` of a namespace marks it ``Terminating``; its content is deleted (finalizers still
  block); the namespace goes when it is empty; creating in a terminating namespace is forbidden.
* authorization for one subject (the operator's ServiceAccount token): every request and the
  ``OwnerReferencesPermissionEnforcement`` checks (setting ``blockOwnerDeletion`` needs ``update``
  on the owner's ``finalizers`` subresource; changing owner references on an update needs
  ``delete`` on the object) go through ``authorizer``; a refusal is 403 Forbidden.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from kmock._internal import enums, k8s

from emulator_discovery import RESOURCE_VERSIONS
from emulator_semantics import changed_owner_references, new_blocking_owners

#: (apiGroup, resource[/subresource], verb, namespace or None) of one authorization check.
Permission = tuple[str, str, str, "str | None"]
FOREGROUND = "foregroundDeletion"
ORPHAN = "orphan"
NAMESPACE_FINALIZER = "kubernetes"
NAMESPACES = "v1/namespaces"
_RV = RESOURCE_VERSIONS  # the one counter of every write (watches order by it)


def request_permission(request: Any) -> Permission | None:
    """(apiGroup, resource[/subresource], verb, namespace) of one API request; None for discovery."""
    if request.resource is None or not getattr(request.resource, "plural", None):
        return None
    method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
    watch = str(request.params.get("watch", "")).lower() in ("true", "1")
    if method == "GET":
        verb = "get" if request.name else ("watch" if watch else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if request.name else "deletecollection"}.get(method, method.lower())
    resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
    return (request.resource.group or "", resource, verb, request.namespace)


def forbidden(permission: Permission, why: str = "") -> k8s.KubernetesError:
    group, resource, verb, namespace = permission
    where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
    return k8s.KubernetesError(
        status=403, reason="Forbidden",
        message=(why + ": " if why else "") + f'{resource}{"." + group if group else ""} is forbidden: User '
                f'"system:serviceaccount:operator" cannot {verb} resource "{resource}" in API group "{group}"{where}')


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def resource_key(resource: Any) -> str:
    """``group/version/plural`` (``version/plural`` for the core group) of a KMock resource."""
    return f"{resource.group}/{resource.version}/{resource.plural}" if resource.group else f"{resource.version}/{resource.plural}"


def _meta(obj: Any) -> dict[str, Any]:
    return obj.raw.get("metadata") or {}


class LifecycleMixin:
    """Deletion propagation, garbage collection, namespace termination, authorization (see module)."""

    objects: Any
    resources: Any
    _buses: Any
    authorizer: Callable[[Permission], bool] | None
    subject_token: str
    denied: list[Permission]
    checks: list[Permission]

    # -- authorization ------------------------------------------------------------------------------

    def _is_subject(self, request: Any) -> bool:
        return self.authorizer is not None and request.headers.get("Authorization") == f"Bearer {self.subject_token}"

    def _check(self, permission: Permission, why: str = "") -> None:
        self.checks.append(permission)
        assert self.authorizer is not None
        if not self.authorizer(permission):
            self.denied.append(permission)
            raise forbidden(permission, why)

    def _authorize_request(self, request: Any) -> None:
        if self._is_subject(request) and (permission := request_permission(request)) is not None:
            self._check(permission)

    def _plural_of(self, api_version: str, kind: str) -> tuple[str, str]:
        group, _, version = api_version.rpartition("/")
        for resource in self.resources:
            info = self.resources[resource]
            if info.kind == kind and resource.group == group and resource.version == version:
                return group, resource.plural
        return group, kind.lower() + "s"

    def _enforce_owner_references(self, request: Any, new: dict[str, Any], old: dict[str, Any] | None) -> None:
        """The OwnerReferencesPermissionEnforcement admission plugin, for the authorized subject."""
        if not self._is_subject(request) or not changed_owner_references(new, old):
            return
        namespace = request.namespace
        if old is not None:
            r = request.resource
            self._check((r.group or "", r.plural, "delete", namespace),
                        "cannot set an ownerRef on a resource you can't delete")
        for ref in new_blocking_owners(new, old):
            group, plural = self._plural_of(str(ref.get("apiVersion", "")), str(ref.get("kind", "")))
            self._check((group, f"{plural}/finalizers", "update", namespace),
                        "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set finalizers on")

    # -- deletion -------------------------------------------------------------------------------------

    def _terminating_namespaces(self) -> set[str]:
        return {name for (resource, _, name), obj in self.objects.items()
                if resource_key(resource) == NAMESPACES and not obj.deleted and _meta(obj).get("deletionTimestamp")}

    def _refuse_create_in_terminating(self, request: Any) -> None:
        if request.action == enums.action.CREATE and request.namespace in self._terminating_namespaces():
            raise k8s.KubernetesError(status=403, reason="Forbidden", message=(
                f"unable to create new content in namespace {request.namespace} because it is being terminated"))

    def _prepare_delete(self, request: Any, key: str) -> None:
        """Before KMock deletes: add the finalizer the propagation policy (or a namespace) needs."""
        object_key = (request.resource, request.namespace, request.name)
        stored = self.objects[object_key] if request.name and object_key in self.objects else None
        if stored is None or stored.deleted or _meta(stored).get("deletionTimestamp"):
            return
        body = request.data if isinstance(request.data, dict) else {}
        policy = request.params.get("propagationPolicy") or body.get("propagationPolicy") or "Background"
        if body.get("orphanDependents") is True:
            policy = "Orphan"
        extra = NAMESPACE_FINALIZER if key == NAMESPACES else {"Foreground": FOREGROUND, "Orphan": ORPHAN}.get(policy)
        if extra is None:
            return
        finalizers = list(_meta(stored).get("finalizers") or [])
        if extra not in finalizers:
            finalizers.append(extra)
        changes: dict[str, Any] = {"metadata": {"finalizers": finalizers, "resourceVersion": str(next(_RV))}}
        if key == NAMESPACES:
            changes["status"] = {"phase": "Terminating"}
        stored.patch(changes)

    async def _delete(self, key: tuple[Any, Any, Any]) -> None:
        obj = self.objects[key]
        if _meta(obj).get("finalizers"):
            if not _meta(obj).get("deletionTimestamp"):
                obj.patch({"metadata": {"deletionTimestamp": _now(), "resourceVersion": str(next(_RV))}})
                await self._buses[key[0]].put({"type": "MODIFIED", "object": obj.raw})
            return
        raw = obj.raw
        obj.delete()
        await self._buses[key[0]].put({"type": "DELETED", "object": raw})

    async def _drop_finalizer(self, key: tuple[Any, Any, Any], finalizer: str, changes: dict[str, Any] | None = None) -> None:
        obj = self.objects[key]
        finalizers = [f for f in _meta(obj).get("finalizers") or [] if f != finalizer]
        obj.patch({"metadata": {"finalizers": finalizers or None, "resourceVersion": str(next(_RV))}, **(changes or {})})
        if not finalizers and _meta(obj).get("deletionTimestamp"):
            raw = obj.raw
            obj.delete()
            await self._buses[key[0]].put({"type": "DELETED", "object": raw})
        else:
            await self._buses[key[0]].put({"type": "MODIFIED", "object": obj.raw})

    async def _collect_garbage(self) -> None:
        """Run garbage collection and namespace termination until nothing changes (bounded)."""
        for _ in range(50):
            if not await self._gc_pass():
                return

    async def _gc_pass(self) -> bool:
        live = {key: obj for key, obj in list(self.objects.items()) if not obj.deleted}
        by_uid = {_meta(obj).get("uid"): key for key, obj in live.items()}
        terminating = self._terminating_namespaces()
        for key, obj in live.items():
            meta = _meta(obj)
            deleting = bool(meta.get("deletionTimestamp"))
            if key[1] in terminating and not deleting:
                await self._delete(key)
                return True
            refs = meta.get("ownerReferences") or []
            owners = [live[by_uid[r.get("uid")]] for r in refs if r.get("uid") in by_uid]
            if refs and not deleting and (not owners or any(
                    FOREGROUND in (_meta(o).get("finalizers") or []) and _meta(o).get("deletionTimestamp") for o in owners)):
                await self._delete(key)
                return True
        for key, obj in live.items():
            meta = _meta(obj)
            if not meta.get("deletionTimestamp"):
                continue
            finalizers = meta.get("finalizers") or []
            uid = meta.get("uid")
            dependents = [(k, o) for k, o in live.items() if k != key and any(
                r.get("uid") == uid for r in _meta(o).get("ownerReferences") or [])]
            if ORPHAN in finalizers:
                for dep_key, dep in dependents:
                    kept = [r for r in _meta(dep).get("ownerReferences") or [] if r.get("uid") != uid]
                    dep.patch({"metadata": {"ownerReferences": kept or None, "resourceVersion": str(next(_RV))}})
                    await self._buses[dep_key[0]].put({"type": "MODIFIED", "object": dep.raw})
                await self._drop_finalizer(key, ORPHAN)
                return True
            if FOREGROUND in finalizers and not any(
                    r.get("uid") == uid and r.get("blockOwnerDeletion")
                    for _, dep in dependents for r in _meta(dep).get("ownerReferences") or []):
                await self._drop_finalizer(key, FOREGROUND)
                return True
            if (resource_key(key[0]) == NAMESPACES and NAMESPACE_FINALIZER in finalizers
                    and not any(k[1] == key[2] for k in live if k != key)):
                await self._drop_finalizer(key, NAMESPACE_FINALIZER)
                return True
        return False
