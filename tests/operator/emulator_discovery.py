"""Discovery, OpenAPI, listing and subresource views of the emulator (mixed into ``MammothEmulator``).

* declared resources (built-ins and each CRD's versions) with full discovery info, the core group's
  ``groupVersion`` fixed for kubectl, Kubernetes 1.35 at ``/version``;
* OpenAPI v3 documents: the CRDs' schemas (``kubectl apply`` validates with ``fieldValidation``)
  and permissive ones for the built-ins (Helm insists on a document; the manifests' real schemas
  are checked with ``kubernetes-validate`` elsewhere);
* lists with ``kind``/``apiVersion`` and a ``resourceVersion``; the ``Table`` answer for
  ``kubectl get`` (printer columns); the ``autoscaling/v1`` Scale view of a Deployment's ``scale``.
"""

from __future__ import annotations

import itertools
from typing import Any

import kmock

from emulator_semantics import TABLE_ACCEPT, label_selector, selected, to_table

#: One counter for every resourceVersion the emulator hands out (objects and lists).
RESOURCE_VERSIONS = itertools.count(1000)


# (group/version/plural, kind, namespaced, short names, subresources)
BUILTIN_RESOURCES = [
    ("v1/namespaces", "Namespace", False, ["ns"], ["status"]),
    ("v1/configmaps", "ConfigMap", True, ["cm"], []),
    ("v1/services", "Service", True, ["svc"], ["status"]),
    ("v1/secrets", "Secret", True, [], []),
    ("v1/pods", "Pod", True, ["po"], ["status"]),
    ("v1/events", "Event", True, ["ev"], []),
    ("apps/v1/deployments", "Deployment", True, ["deploy"], ["status", "scale"]),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, ["pdb"], ["status"]),
    ("autoscaling/v2/horizontalpodautoscalers", "HorizontalPodAutoscaler", True, ["hpa"], ["status"]),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, ["netpol"], []),
    ("events.k8s.io/v1/events", "Event", True, ["ev"], []),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, ["crd", "crds"], ["status"]),
]
#: Kinds the chart installs besides the operator's children (served with OpenAPI documents).
EXTRA_BUILTINS = [
    ("v1/serviceaccounts", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole"),
    ("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding"),
    ("rbac.authorization.k8s.io/v1/roles", "Role"),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding"),
]
VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


class DiscoveryMixin:
    """CRD registration, discovery and OpenAPI documents, list/fetch/update views (see module)."""

    crds: dict[str, dict[str, Any]]
    status_subresources: set[str]
    openapi_paths: dict[str, Any]
    resources: Any
    fallback: Any

    # -- CRDs -------------------------------------------------------------------------------------

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            key = f"{spec['group']}/{version['name']}/{names['plural']}"
            subresources = list((version.get("subresources") or {}).keys())
            self.resources[key] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular", names["kind"].lower()),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced", verbs=VERBS,
                shortnames=names.get("shortNames", []), categories=names.get("categories", []),
                subresources=subresources)
            if "status" in subresources:
                self.status_subresources.add(key)
            self.crds[key] = crd
            self._serve_openapi(spec["group"], version["name"], names, version["schema"]["openAPIV3Schema"])

    def _serve_builtin_openapi(self) -> None:
        """Permissive OpenAPI v3 documents of the built-in group-versions (any field accepted), so
        clients that insist on a schema (Helm, ``kubectl apply`` validation) find one; the manifests'
        real schemas are checked with ``kubernetes-validate`` in the chart and builder tests."""
        kinds: dict[str, list[dict[str, str]]] = {}
        for key, kind, *_ in BUILTIN_RESOURCES + list(EXTRA_BUILTINS):
            group_version = key.rsplit("/", 1)[0]
            group, _, version = group_version.rpartition("/")
            kinds.setdefault(group_version, []).append({"group": group, "version": version, "kind": kind})
        for group_version, gvks in kinds.items():
            schemas = {f"{g['group'] or 'core'}.{g['version']}.{g['kind']}": {
                "type": "object", "x-kubernetes-preserve-unknown-fields": True,
                "x-kubernetes-group-version-kind": [g]} for g in gvks}
            document = {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.35.0"},
                        "paths": {}, "components": {"schemas": schemas}}
            relative = ("api/" if "/" not in group_version else "apis/") + group_version
            self.openapi_paths[relative] = {"serverRelativeURL": f"/openapi/v3/{relative}"}
            self.fallback[f"get /openapi/v3/{relative}"] << document
        self.fallback["get /openapi/v2"] << (lambda request: {
            "swagger": "2.0", "info": {"title": "Kubernetes", "version": "v1.35.0"}, "paths": {},
            "definitions": {f"{g['group'] or 'core'}.{g['version']}.{g['kind']}": {
                "type": "object", "x-kubernetes-group-version-kind": [g]}
                for gvks in kinds.values() for g in gvks}})

    def _serve_openapi(self, group: str, version: str, names: dict[str, Any], schema: dict[str, Any]) -> None:
        """An OpenAPI v3 group-version document, so kubectl's schema and ``fieldValidation`` checks work."""
        gvk = {"group": group, "version": version, "kind": names["kind"]}
        collection = f"/apis/{group}/{version}/namespaces/{{namespace}}/{names['plural']}"
        params = [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}]
        document = {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": "v1.35.0"},
            "paths": {
                collection: {"post": {"parameters": params, "x-kubernetes-group-version-kind": gvk,
                                      "x-kubernetes-action": "post", "responses": {}}},
                collection + "/{name}": {"patch": {"parameters": params, "x-kubernetes-group-version-kind": gvk,
                                                   "x-kubernetes-action": "patch", "responses": {}}},
            },
            "components": {"schemas": {
                f"{'.'.join(reversed(group.split('.')))}.{version}.{names['kind']}":
                    dict(schema, **{"x-kubernetes-group-version-kind": [gvk]}),
            }},
        }
        url = f"/openapi/v3/apis/{group}/{version}"
        self.openapi_paths[url.removeprefix("/openapi/v3/")] = {"serverRelativeURL": url}
        self.fallback[f"get {url}"] << document

    # -- discovery and listing fixes for kubectl ----------------------------------------------------

    async def _serve_server_version(self, request: kmock.Request) -> Any:
        """Kubernetes 1.35, the version the chart and the kubectl used here target."""
        return {"major": "1", "minor": "35", "gitVersion": "v1.35.0", "gitCommit": "emulator",
                "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25",
                "compiler": "gc", "platform": "linux/amd64"}

    async def _serve_version(self, request: kmock.Request) -> Any:
        """Subresource entries (``x/status``) carry no short names or categories (kubectl warns otherwise)."""
        payload = await super()._serve_version(request)
        if str(payload.get("groupVersion", "")).startswith("/"):
            payload["groupVersion"] = payload["groupVersion"][1:]  # KMock 0.8 answers "/v1" for the core group
        for entry in payload["resources"]:
            if "/" in entry["name"]:
                entry["shortNames"], entry["categories"] = [], []
        return payload

    async def _serve_list(self, request: kmock.Request) -> Any:
        """Lists carry ``kind``/``apiVersion`` and a real ``resourceVersion`` (kubectl decodes them).

        The version is taken before the snapshot: a write made meanwhile is in the listing and also
        after the version, so a watch from it sends that write again (at least once), never not at all.
        """
        version = str(next(RESOURCE_VERSIONS))
        payload = await super()._serve_list(request)
        info = self.resources[self._key(request)]
        r = request.resource
        payload["kind"] = f"{info.kind}List"
        payload["apiVersion"] = f"{r.group}/{r.version}" if r.group else r.version
        payload["metadata"] = {"resourceVersion": version}
        matches = label_selector(request.params.get("labelSelector"))
        payload["items"] = [item for item in payload["items"] if selected(matches, item)]
        for item in payload["items"]:
            item.setdefault("kind", info.kind)
            item.setdefault("apiVersion", payload["apiVersion"])
        if self._wants_table(request):
            return to_table(payload["items"], self._crd_version(request), payload["metadata"]["resourceVersion"])
        return payload

    async def _serve_update(self, request: kmock.Request) -> Any:
        payload = await super()._serve_update(request)
        return self._as_scale(payload) if request.subresource == "scale" else payload

    @staticmethod
    def _as_scale(obj: dict[str, Any]) -> dict[str, Any]:
        """The ``autoscaling/v1`` Scale view of a Deployment (its ``scale`` subresource)."""
        meta = obj.get("metadata") or {}
        labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta},
                "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 1)},
                "status": {"replicas": (obj.get("status") or {}).get("replicas", 0),
                           "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items()))}}

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        """A single object, or its one-row Table for ``kubectl get NAME``."""
        payload = await super()._serve_fetch(request)
        if request.subresource == "scale":
            return self._as_scale(payload)
        if self._wants_table(request):
            return to_table([payload], self._crd_version(request), str(payload.get("metadata", {}).get("resourceVersion")))
        return payload

    @staticmethod
    def _wants_table(request: kmock.Request) -> bool:
        return TABLE_ACCEPT in str(request.headers.get("Accept", ""))

    def _crd_version(self, request: kmock.Request) -> dict[str, Any] | None:
        crd = self.crds.get(self._key(request))
        if crd is None:
            return None
        return next((v for v in crd["spec"]["versions"] if v["name"] == request.resource.version), None)
