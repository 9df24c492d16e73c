"""Decode the Kubernetes protobuf request bodies the real clients send to the emulator.

``client-go``'s typed clients (Helm's release storage, ``kubectl create namespace``) write core
kinds as ``application/vnd.kubernetes.protobuf``: the ``k8s\\0`` magic, then a ``runtime.Unknown``
(``typeMeta``, ``raw``). KMock 0.8 parses JSON only, so :func:`install` turns those bodies into the
JSON object a real server would have decoded. Answers stay JSON (the clients accept it). Only the
kinds and fields those clients send are mapped: Secret, ConfigMap, Namespace, DeleteOptions and
the common ``ObjectMeta`` fields.
"""

from __future__ import annotations

import base64
from typing import Any

from kmock._internal import rendering

MAGIC = b"k8s\x00"


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(data: bytes) -> list[tuple[int, Any]]:
    """(field number, value) pairs of one protobuf message: ints for varints, bytes for the rest."""
    out: list[tuple[int, Any]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((number, value))
    return out


def _map(entries: list[bytes], binary: bool = False) -> dict[str, str]:
    result = {}
    for entry in entries:
        parts = dict(fields(entry))
        value = parts.get(2, b"")
        result[parts.get(1, b"").decode()] = base64.b64encode(value).decode() if binary else value.decode()
    return result


def object_meta(data: bytes) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    grouped: dict[int, list[Any]] = {}
    for number, value in fields(data):
        grouped.setdefault(number, []).append(value)
    for number, key in ((1, "name"), (2, "generateName"), (3, "namespace"), (5, "uid"), (6, "resourceVersion")):
        if grouped.get(number) and grouped[number][-1]:
            meta[key] = grouped[number][-1].decode()
    for number, key in ((11, "labels"), (12, "annotations")):
        if grouped.get(number):
            meta[key] = _map(grouped[number])
    if grouped.get(14):
        meta["finalizers"] = [v.decode() for v in grouped[14]]
    return meta


def decode(body: bytes) -> dict[str, Any]:
    """The JSON form of one protobuf-encoded Kubernetes object (kinds listed in the module docstring).

    Raises:
        ValueError: not a Kubernetes protobuf body, or a kind this decoder does not map.
    """
    if not body.startswith(MAGIC):
        raise ValueError("not a Kubernetes protobuf body")
    unknown = dict(fields(body[len(MAGIC):]))
    type_meta = dict(fields(unknown.get(1, b"")))
    api_version, kind = type_meta.get(1, b"").decode(), type_meta.get(2, b"").decode()
    raw = fields(unknown.get(2, b""))
    grouped: dict[int, list[Any]] = {}
    for number, value in raw:
        grouped.setdefault(number, []).append(value)
    obj: dict[str, Any] = {"apiVersion": api_version or "v1", "kind": kind}
    if kind == "DeleteOptions":
        if grouped.get(4):
            obj["propagationPolicy"] = grouped[4][-1].decode()
        if grouped.get(3):
            obj["orphanDependents"] = bool(grouped[3][-1])
        return obj
    if kind not in ("Secret", "ConfigMap", "Namespace"):
        raise ValueError(f"protobuf bodies of kind {kind!r} are not mapped by the emulator")
    obj["metadata"] = object_meta(grouped.get(1, [b""])[-1])
    if kind == "Secret":
        if grouped.get(2):
            obj["data"] = _map(grouped[2], binary=True)
        if grouped.get(3):
            obj["type"] = grouped[3][-1].decode()
        if grouped.get(5):
            obj["immutable"] = bool(grouped[5][-1])
    elif kind == "ConfigMap" and grouped.get(2):
        obj["data"] = _map(grouped[2])
    return obj


class _JSONView:
    """A raw aiohttp request whose body reads as the JSON of its decoded protobuf."""

    def __init__(self, raw: Any, data: dict[str, Any]) -> None:
        self._raw = raw
        self._data = data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    async def text(self) -> str:
        return ""

    async def json(self) -> dict[str, Any]:
        return self._data


def install() -> None:
    """Make KMock's request parser decode protobuf bodies (idempotent)."""
    if getattr(rendering.Request, "_mammoth_protobuf", False):
        return
    original = rendering.Request._parse.__func__

    async def _parse(cls: Any, raw_request: Any, *, id: int = 0) -> Any:
        if "protobuf" in str(raw_request.headers.get("Content-Type", "")):
            body = await raw_request.read()
            if body:
                raw_request = _JSONView(raw_request, decode(body))
        return await original(cls, raw_request, id=id)

    rendering.Request._parse = classmethod(_parse)
    rendering.Request._mammoth_protobuf = True
