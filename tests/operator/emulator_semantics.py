"""Pure pieces of API-server behaviour the emulator (``mammoth_emulator.py``) applies to stored objects.

* :func:`default_builtin`: the defaults ``kube-apiserver`` fills in for the built-in kinds the
  operator creates (apps/v1 Deployments: ``replicas`` absent or null becomes 1, the rolling-update
  strategy, history limit, progress deadline; pod templates: restart and DNS policy, scheduler,
  grace period, container termination-message fields, pull policy, probe thresholds, port
  protocols; v1 Services: type, session affinity, a cluster IP, target ports).
* :func:`to_table`: the ``meta.k8s.io/v1`` ``Table`` a server answers ``kubectl get`` with
  (``Accept: application/json;as=Table;v=v1;g=meta.k8s.io``): ``Name``, the CRD's
  ``additionalPrinterColumns`` (a JSONPath subset: ``.a.b``, ``[N]``, ``[?(@.k=="v")]``), and
  ``Age`` for built-ins.
* :func:`changed_owner_references` / :func:`new_blocking_owners`: what the
  ``OwnerReferencesPermissionEnforcement`` admission plugin checks.
"""

from __future__ import annotations

import copy
import datetime
import re
from typing import Any

TABLE_ACCEPT = "as=Table"


def _default(mapping: dict[str, Any], key: str, value: Any) -> None:
    if mapping.get(key) is None:
        mapping[key] = copy.deepcopy(value)


def _default_probe(probe: Any) -> None:
    if isinstance(probe, dict):
        for key, value in (("timeoutSeconds", 1), ("periodSeconds", 10), ("successThreshold", 1),
                           ("failureThreshold", 3)):
            _default(probe, key, value)
        if isinstance(probe.get("httpGet"), dict):
            _default(probe["httpGet"], "scheme", "HTTP")


_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"m": -1, "": 0, "k": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}


def canonical_quantity(value: Any) -> Any:
    """``resource.Quantity``'s canonical text, as the API server stores a quantity (for the plain
    forms: ``0.5`` -> ``500m``, ``1000m`` -> ``1``, ``1024Mi`` -> ``1Gi``, ``4`` -> ``4``); anything
    else as given. The binary suffixes keep a binary form, the decimal ones (and none) a decimal one."""
    import decimal

    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMGTPE]i|[mkMGTPE]?)", str(value))
    if match is None:
        return value
    number, suffix = decimal.Decimal(match.group(1)), match.group(2)
    if suffix in _BINARY:
        amount = number * (1024 ** _BINARY[suffix])
        if amount != amount.to_integral_value():
            return value
        for name, power in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
            if amount % (1024 ** power) == 0:
                return f"{int(amount // 1024 ** power)}{name}"
        return str(int(amount))
    amount = number * (decimal.Decimal(1000) ** _DECIMAL[suffix])
    for name, power in sorted(_DECIMAL.items(), key=lambda kv: -kv[1]):
        scaled = amount / (decimal.Decimal(1000) ** power)
        if scaled == scaled.to_integral_value():
            return f"{int(scaled)}{name}"
    return value


def _default_container(container: dict[str, Any]) -> None:
    for section in ("requests", "limits"):  # stored canonical (``cpu: 0.5`` is served as ``500m``)
        values = (container.get("resources") or {}).get(section)
        if isinstance(values, dict):
            for key, value in values.items():
                values[key] = canonical_quantity(value)
    _default(container, "terminationMessagePath", "/dev/termination-log")
    _default(container, "terminationMessagePolicy", "File")
    image = str(container.get("image", ""))
    _default(container, "imagePullPolicy", "Always" if image.endswith(":latest") or ":" not in image else "IfNotPresent")
    _default(container, "resources", {})
    for port in container.get("ports") or []:
        _default(port, "protocol", "TCP")
    for key in ("startupProbe", "readinessProbe", "livenessProbe"):
        _default_probe(container.get(key))


def default_pod_spec(pod: dict[str, Any]) -> None:
    """The PodSpec defaults of ``k8s.io/kubernetes/pkg/apis/core/v1/defaults.go`` that show in a template."""
    for key, value in (("restartPolicy", "Always"), ("dnsPolicy", "ClusterFirst"),
                       ("schedulerName", "default-scheduler"), ("terminationGracePeriodSeconds", 30),
                       ("securityContext", {})):
        _default(pod, key, value)
    for container in (pod.get("initContainers") or []) + (pod.get("containers") or []):
        if isinstance(container, dict):
            _default_container(container)
    for volume in pod.get("volumes") or []:
        for source in ("configMap", "secret"):
            if isinstance(volume.get(source), dict):
                _default(volume[source], "defaultMode", 420)


def default_deployment(deployment: dict[str, Any]) -> None:
    """apps/v1 Deployment defaults; a null or absent ``spec.replicas`` becomes 1, as on a real server."""
    spec = deployment.setdefault("spec", {})
    _default(spec, "replicas", 1)
    _default(spec, "revisionHistoryLimit", 10)
    _default(spec, "progressDeadlineSeconds", 600)
    strategy = spec.setdefault("strategy", {})
    _default(strategy, "type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        rolling = strategy.setdefault("rollingUpdate", {})
        _default(rolling, "maxSurge", "25%")
        _default(rolling, "maxUnavailable", "25%")
    template = spec.setdefault("template", {})
    default_pod_spec(template.setdefault("spec", {}))


def default_service(service: dict[str, Any], cluster_ip: str) -> None:
    """v1 Service defaults: type ClusterIP, sessionAffinity None, an allocated clusterIP, targetPort = port."""
    spec = service.setdefault("spec", {})
    _default(spec, "type", "ClusterIP")
    _default(spec, "sessionAffinity", "None")
    _default(spec, "clusterIP", cluster_ip)
    _default(spec, "clusterIPs", [spec["clusterIP"]])
    _default(spec, "ipFamilies", ["IPv4"])
    _default(spec, "ipFamilyPolicy", "SingleStack")
    _default(spec, "internalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or []:
        _default(port, "protocol", "TCP")
        _default(port, "targetPort", port.get("port"))


def default_builtin(key: str, obj: dict[str, Any], cluster_ip: str) -> None:
    """Apply the server defaults of the built-in resource ``key`` (``group/version/plural``) in place."""
    if key == "apps/v1/deployments":
        default_deployment(obj)
    elif key == "v1/services":
        default_service(obj, cluster_ip)


# ------------------------------------------------------------------------------------------------
# Tables for kubectl get

_STEP = re.compile(r"\.([A-Za-z0-9_-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_.-]+)\s*==\s*['\"]([^'\"]*)['\"]\)\]")


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Every value ``path`` selects in ``obj`` (the subset printer columns use); [] when none."""
    values = [obj]
    pos = 0
    while pos < len(path):
        match = _STEP.match(path, pos)
        if match is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {pos}")
        pos = match.end()
        key, index, filter_key, filter_value = match.groups()
        found: list[Any] = []
        for value in values:
            if key is not None and isinstance(value, dict) and key in value:
                found.append(value[key])
            elif index is not None and isinstance(value, list) and int(index) < len(value):
                found.append(value[int(index)])
            elif filter_key is not None and isinstance(value, list):
                found.extend(v for v in value if isinstance(v, dict)
                             and str(jsonpath(v, "." + filter_key)[:1] and jsonpath(v, "." + filter_key)[0]) == filter_value)
        values = found
    return values


def human_duration(since: str, now: datetime.datetime | None = None) -> str:
    """``kubectl``'s age format (``42s``, ``5m``, ``3h``, ``2d``) of an RFC 3339 timestamp."""
    try:
        then = datetime.datetime.fromisoformat(since.replace("Z", "+00:00"))
    except (AttributeError, ValueError):
        return "<unknown>"
    seconds = int(((now or datetime.datetime.now(datetime.timezone.utc)) - then).total_seconds())
    if seconds < 120:
        return f"{max(seconds, 0)}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def _cell(column: dict[str, Any], obj: dict[str, Any]) -> Any:
    values = jsonpath(obj, column["jsonPath"])
    if not values:
        return None
    if column.get("type") == "date":
        return human_duration(values[0])
    return values[0] if len(values) == 1 else ",".join(str(v) for v in values)


def to_table(objects: list[dict[str, Any]], crd_version: dict[str, Any] | None, resource_version: str) -> dict[str, Any]:
    """A ``meta.k8s.io/v1`` Table of ``objects`` (printer columns of ``crd_version`` when a CRD's)."""
    columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name of the object", "priority": 0}]
    extra = list((crd_version or {}).get("additionalPrinterColumns") or [])
    if not extra:
        extra = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    for column in extra:
        columns.append({"name": column["name"], "type": column.get("type", "string"), "format": column.get("format", ""),
                        "description": column.get("description", ""), "priority": column.get("priority", 0)})
    rows = []
    for obj in objects:
        meta = obj.get("metadata") or {}
        rows.append({
            "cells": [meta.get("name")] + [_cell(column, obj) for column in extra],
            "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": meta},
        })
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": columns, "rows": rows}


# ------------------------------------------------------------------------------------------------
# OwnerReferencesPermissionEnforcement


def _refs(obj: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list(((obj or {}).get("metadata") or {}).get("ownerReferences") or [])


def changed_owner_references(new: dict[str, Any], old: dict[str, Any] | None) -> bool:
    """True when a write changes ``metadata.ownerReferences`` (a create sets them: always a change)."""
    if old is None:
        return bool(_refs(new))
    return _refs(new) != _refs(old)


def new_blocking_owners(new: dict[str, Any], old: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Owner references of ``new`` with ``blockOwnerDeletion: true`` that ``old`` did not already block."""
    before = {ref.get("uid") for ref in _refs(old) if ref.get("blockOwnerDeletion")}
    return [ref for ref in _refs(new) if ref.get("blockOwnerDeletion") and ref.get("uid") not in before]


_SET_TERM = re.compile(r"^\s*(!?)\s*([^\s!=,()]+)\s*(?:(=|==|!=)\s*([^\s,()]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def label_selector(text: str | None) -> Any:
    """A predicate on an object's labels for a ``labelSelector`` query (``k=v``, ``k==v``, ``k!=v``,
    ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``, comma-separated: all must hold); None for none.

    Raises:
        ValueError: a term the API server would refuse (it answers 400).
    """
    if not text:
        return None
    terms = []
    for raw in re.split(r",(?![^()]*\))", text):
        match = _SET_TERM.match(raw)
        if match is None:
            raise ValueError(f"invalid label selector term {raw!r}")
        negate, key, op, value, set_op, values = match.groups()
        terms.append((negate, key, op, value, set_op, {v.strip() for v in (values or "").split(",") if v.strip()}))

    def matches(labels: dict[str, str] | None) -> bool:
        labels = labels or {}
        for negate, key, op, value, set_op, values in terms:
            if negate:
                ok = key not in labels
            elif op in ("=", "=="):
                ok = labels.get(key) == value
            elif op == "!=":
                ok = labels.get(key) != value
            elif set_op == "in":
                ok = labels.get(key) in values
            elif set_op == "notin":
                ok = labels.get(key) not in values
            else:
                ok = key in labels
            if not ok:
                return False
        return True

    return matches


def selected(matches: Any, obj: dict[str, Any] | None) -> bool:
    """Whether ``obj`` passes the predicate from `label_selector` (every object when it is None)."""
    if obj is None:
        return False
    return matches is None or matches((obj.get("metadata") or {}).get("labels"))
