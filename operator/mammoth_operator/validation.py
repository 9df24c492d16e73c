"""The CRD's own admission rules, run in Python: structural pruning and defaulting, the
``openAPIV3Schema`` (``jsonschema``) and the ``x-kubernetes-validations`` CEL rules (``cel-python``).

One implementation serves two callers, so they cannot drift: the operator re-checks every spec with
it (:func:`validate_spec`: an object that got past admission, from an older CRD or a server without
CEL, becomes ``Degraded/InvalidSpec``), and the test emulator (``tests/operator/mammoth_emulator.py``)
admits custom resources with it as a real API server would. The CRD file is the one source of the
rules (:mod:`mammoth_operator.crd`).

Violations are strings ``<field path>: <message>`` (``spec.transport.chunkRows: Invalid value: …``
for a CEL rule, the rule's ``fieldPath`` appended; ``spec.ar.replicas: 65 is greater than …`` for the
schema), the shape the API server uses in a 422 answer's causes.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from typing import Any

import celpy
import celpy.adapter
import jsonschema

from mammoth_operator import crd
from mammoth_operator.config import GROUP, KIND, VERSION


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Fill the ``default`` of every absent property, recursively (as the API server does); returns
    ``value`` (dicts are filled in place)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key, sub in props.items():
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in props:
                    value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def prune(schema: Mapping[str, Any], value: Any, path: str, pruned: list[str], root: bool = False) -> Any:
    """``value`` without the fields the structural schema does not declare (unless it preserves unknown
    fields); appends each dropped field's path to ``pruned``. ``root`` keeps apiVersion/kind/metadata."""
    if isinstance(value, dict) and schema.get("type") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return value
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        result = {}
        for key, sub in value.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                result[key] = sub
            elif key in props:
                result[key] = prune(props[key], sub, f"{path}.{key}", pruned)
            elif isinstance(extra, dict):
                result[key] = prune(extra, sub, f"{path}.{key}", pruned)
            elif extra is True:
                result[key] = sub
            else:
                pruned.append(f"{path}.{key}".lstrip("."))
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(schema["items"], v, f"{path}[{i}]", pruned) for i, v in enumerate(value)]
    return value


def _to_cel(schema: Mapping[str, Any], value: Any) -> Any:
    """JSON -> CEL values, with ``number`` fields as doubles (as Kubernetes types them)."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return celpy.celtypes.MapType({
            celpy.celtypes.StringType(k): _to_cel(props.get(k, extra), v) for k, v in value.items()})
    if isinstance(value, list):
        return celpy.celtypes.ListType([_to_cel(schema.get("items") or {}, v) for v in value])
    if schema.get("type") == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return celpy.celtypes.DoubleType(float(value))
    return celpy.adapter.json_to_cel(value)


@functools.lru_cache(maxsize=None)
def _cel_program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def evaluate_rule(rule: str, self_value: Any, schema: Mapping[str, Any]) -> bool:
    """Evaluate one ``x-kubernetes-validations`` rule with ``self`` bound; an evaluation error fails it."""
    try:
        result = _cel_program(rule).evaluate({"self": _to_cel(schema, self_value)})
    except celpy.CELEvalError:
        return False
    if isinstance(result, celpy.CELEvalError):
        return False
    return bool(result)


def cel_violations(schema: Mapping[str, Any], value: Any, path: str = "") -> list[str]:
    """Every failing CEL rule under ``schema`` for ``value``, as ``path: Invalid value: message`` strings."""
    found: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        if not evaluate_rule(rule["rule"], value, schema):
            field = path + rule.get("fieldPath", "")
            found.append(f"{field.lstrip('.') or '<root>'}: Invalid value: {rule.get('message') or rule['rule']}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value and isinstance(sub, dict):
                found.extend(cel_violations(sub, value[key], f"{path}.{key}"))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found.extend(cel_violations(schema["items"], item, f"{path}[{i}]"))
    return found


def schema_violations(schema: Mapping[str, Any], value: Any) -> list[str]:
    """jsonschema errors of ``value`` against an OpenAPI v3 structural schema (x-kubernetes-* ignored)."""
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))]


def validate_custom_resource(definition: Mapping[str, Any], obj: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """Admit a custom resource as the API server does: (pruned and defaulted object, pruned field
    paths, violations of the schema and the CEL rules) for ``obj`` and its CRD ``definition``.

    Raises:
        StopIteration: the CRD serves no version named by ``obj``'s ``apiVersion``.
    """
    version = str(obj.get("apiVersion", "")).split("/")[-1]
    schema = next(v["schema"]["openAPIV3Schema"] for v in definition["spec"]["versions"] if v["name"] == version)
    pruned: list[str] = []
    result = prune(schema, copy.deepcopy(dict(obj)), "", pruned, root=True)
    result = apply_defaults(schema, result)
    violations = schema_violations(schema, result) + cel_violations(schema, result)
    return result, pruned, violations


@functools.lru_cache(maxsize=1)
def _definition() -> dict[str, Any]:
    return crd.load_crd()


def validate_spec(name: str, spec: Any) -> tuple[dict[str, Any], list[str]]:
    """The ``spec`` of a ``MammothPipeline`` named ``name``, pruned and defaulted, and its violations of
    the CRD (empty: the spec is valid). The CRD file is read once per process, and the answers for the
    last 64 distinct (name, spec) pairs are kept: ``cel-python`` takes about 5 ms a rule, and every
    child event re-validates the same spec.

    A field the CRD does not declare is a violation (``<path>: unknown field``), as under the API
    server's ``fieldValidation=Strict`` (kubectl's default): a stored object has none unless it got
    past admission, and pruning it silently could widen what it asks for (an unknown key under a
    label selector would leave an empty selector, which selects every pod).
    """
    final, violations = _validate(name, json.dumps(spec, sort_keys=True, default=dict))
    return copy.deepcopy(final), list(violations)


@functools.lru_cache(maxsize=64)
def _validate(name: str, spec_json: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name},
            "spec": json.loads(spec_json)}
    final, pruned, violations = validate_custom_resource(_definition(), body)
    return final.get("spec"), tuple(f"{path}: unknown field" for path in pruned) + tuple(violations)
