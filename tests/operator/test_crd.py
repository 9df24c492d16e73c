"""The CRD file: structure, defaults, status schema, and every CEL rule (accepted and rejected specs).

The CEL rules run with ``cel-python`` (:mod:`mammoth_operator.validation`, the code both the emulator's
admission and the operator's re-check use); every case also goes through the operator's own parse
(:func:`mammoth_operator.spec.parse_spec`), which must agree.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from emulator_harness import CRD_FILE, EXAMPLE_FILE, load_yaml
from mammoth_operator.validation import cel_violations, validate_custom_resource
from mammoth_operator import builders, status
from mammoth_operator.config import OperatorConfig
from mammoth_operator.crd import load_crd, openapi_schema
from mammoth_operator.spec import InvalidSpec, parse_spec

IMAGES = OperatorConfig.from_env({}).images


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return load_yaml(CRD_FILE)


def _walk(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_crd_identity_and_printer_columns(crd):
    assert crd["metadata"]["name"] == "mammothpipelines.mammoth.dev"
    assert crd["spec"]["group"] == "mammoth.dev"
    assert crd["spec"]["names"]["kind"] == "MammothPipeline"
    assert "mmp" in crd["spec"]["names"]["shortNames"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "AR", "DiT", "Endpoint", "Age"]
    assert load_crd() == crd  # the operator package reads the same file


def test_schema_is_structural_and_documented(crd):
    schema = openapi_schema(crd)
    for path, node in _walk(schema):
        if path.startswith((".metadata",)) or path.endswith("{}"):
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if path.count(".") <= 4 and not path.endswith("[]") and path not in ("", ".apiVersion", ".kind"):
            assert node.get("description"), f"{path} has no description"
        if node.get("type") == "object":
            assert ("properties" in node or "additionalProperties" in node
                    or node.get("x-kubernetes-preserve-unknown-fields")), f"{path} is an object without a schema"


def _crd_default(schema: dict[str, Any], dotted: str) -> Any:
    node = schema["properties"]["spec"]
    for part in dotted.split("."):
        node = node["properties"][part]
    return node["default"]


# (CRD path under spec, the parsed value of an empty spec): the operator takes every default from the CRD.
PARSED_DEFAULTS = [
    ("ar.replicas", lambda s: s.ar.replicas), ("dit.gpus", lambda s: s.dit.gpus),
    ("ar.startupTimeoutSeconds", lambda s: s.ar.startup_timeout_seconds),
    ("ar.rollout.maxSurge", lambda s: s.ar.rollout.max_surge),
    ("dit.rollout.maxUnavailable", lambda s: s.dit.rollout.max_unavailable),
    ("gateway.rollout.maxSurge", lambda s: s.gateway.rollout.max_surge),
    ("gateway.rollout.maxUnavailable", lambda s: s.gateway.rollout.max_unavailable),
    ("ar.podDisruptionBudget.enabled", lambda s: s.ar.disruption.enabled),
    ("gateway.podDisruptionBudget.maxUnavailable", lambda s: s.gateway.disruption.max_unavailable),
    ("ar.autoscaling.enabled", lambda s: s.ar.autoscaling.enabled),
    ("dit.autoscaling.minReplicas", lambda s: s.dit.autoscaling.min_replicas),
    ("ar.autoscaling.maxReplicas", lambda s: s.ar.autoscaling.max_replicas),
    ("ar.autoscaling.metric.type", lambda s: s.ar.autoscaling.metric_type),
    ("ar.autoscaling.metric.name", lambda s: s.ar.autoscaling.metric_name),
    ("dit.autoscaling.metric.name", lambda s: s.dit.autoscaling.metric_name),
    ("ar.maxRunningSequences", lambda s: s.ar.capacity), ("dit.slots", lambda s: s.dit.capacity),
    ("ar.imagePullPolicy", lambda s: s.ar.placement.image_pull_policy),
    ("gateway.replicas", lambda s: s.gateway.replicas),
    ("gateway.service.type", lambda s: s.gateway.service_type),
    ("gateway.service.port", lambda s: s.gateway.service_port),
    ("gateway.queueSize", lambda s: s.gateway.queue_size),
    ("model.cache.sizeLimit", lambda s: s.model.cache_size_limit),
    ("transport.chunkRows", lambda s: s.transport.chunk_rows),
    ("transport.maxMessageBytes", lambda s: s.transport.max_message_bytes),
    ("requestDefaults.steps", lambda s: s.request_defaults.steps),
    ("requestDefaults.guidanceScale", lambda s: s.request_defaults.guidance_scale),
    ("requestDefaults.cfgRange", lambda s: list(s.request_defaults.cfg_range)),
    ("requestDefaults.maxPixels", lambda s: s.request_defaults.max_pixels),
    ("requestDefaults.minPixels", lambda s: s.request_defaults.min_pixels),
    ("requestDefaults.maxPromptChars", lambda s: s.request_defaults.max_prompt_chars),
    ("requestDefaults.requestTimeoutSeconds", lambda s: s.request_defaults.request_timeout_seconds),
    ("requestDefaults.arGrid", lambda s: s.request_defaults.ar_grid),
    ("requestDefaults.arDecoding", lambda s: s.request_defaults.ar_decoding),
    ("requestDefaults.jacobiWindow", lambda s: s.request_defaults.jacobi_window),
    ("runtime.device", lambda s: s.device), ("runtime.dtype", lambda s: s.dtype),
    ("logging.format", lambda s: s.log_format), ("logging.level", lambda s: s.log_level),
    ("networkPolicy.enabled", lambda s: s.network_policy), ("ar.weightsDtype", lambda s: s.ar.weights_dtype),
]


@pytest.mark.parametrize("crd_path,parsed", PARSED_DEFAULTS, ids=[p for p, _ in PARSED_DEFAULTS])
def test_an_empty_spec_parses_to_the_crd_defaults(crd, crd_path, parsed):
    spec = parse_spec("tiny", "default", {"model": {"source": "builtin://tiny"}}, IMAGES)
    assert parsed(spec) == _crd_default(openapi_schema(crd), crd_path)


def test_status_schema_declares_every_field_the_operator_writes(crd):
    deployment = {"metadata": {"generation": 2}, "spec": {"replicas": 2},
                  "status": {"observedGeneration": 2, "replicas": 2, "readyReplicas": 1, "availableReplicas": 1,
                             "updatedReplicas": 2}}
    service = {"metadata": {"name": "x-gateway", "namespace": "default"}, "spec": {"ports": [{"port": 80}]}}
    observed = status.Observed({"ar": deployment, "dit": deployment, "gateway": deployment}, service, frozenset({"ar"}))
    computed = status.compute_status(2, 2, observed, status.Problem("ApplyFailed", "boom"))
    computed["conditions"] = status.merge_conditions(None, computed["conditions"], status.now_iso())
    computed["observedGeneration"] = 2
    computed["kopf"] = {"progress": {"reconcile": {"retries": 1}}}
    body = {"apiVersion": "mammoth.dev/v1alpha1", "kind": "MammothPipeline", "metadata": {"name": "x"},
            "spec": {"model": {"source": "builtin://tiny"}}, "status": computed}
    final, pruned, violations = validate_custom_resource(crd, body)
    assert pruned == [] and violations == []
    assert final["status"] == computed


def test_example_resource_validates(crd):
    body = load_yaml(EXAMPLE_FILE)
    final, pruned, violations = validate_custom_resource(crd, body)
    assert pruned == [] and violations == []
    parse_spec(body["metadata"]["name"], "default", final["spec"], IMAGES)


def test_unknown_fields_are_pruned(crd):
    body = load_yaml(EXAMPLE_FILE)
    body["spec"]["ar"]["colour"] = "blue"
    _, pruned, _ = validate_custom_resource(crd, body)
    assert pruned == [".spec.ar.colour".lstrip(".")]


def _body(name: str = "tiny", **spec: Any) -> dict[str, Any]:
    base = {"model": {"source": "builtin://tiny"}}
    base.update(copy.deepcopy(spec))
    return {"apiVersion": "mammoth.dev/v1alpha1", "kind": "MammothPipeline", "metadata": {"name": name}, "spec": base}


# (rule id, accepted body, rejected body): one pair per CEL rule of the CRD.
CEL_CASES = [
    ("name-length", _body("a" * 47), _body("a" * 48)),
    ("model-scheme-pvc", _body(model={"source": "pvc://models/mammoth/v1"}), _body(model={"source": "pvc://Models/x"})),
    ("model-scheme-file", _body(model={"source": "file:///mnt/models/mammoth"}), _body(model={"source": "file://relative"})),
    ("model-scheme-hf", _body(model={"source": "hf://bytedance/MammothModa2@v1.0"}),
     _body(model={"source": "s3://bucket/model"})),
    ("model-scheme-builtin", _body(model={"source": "builtin://tiny"}), _body(model={"source": "builtin://huge"})),
    ("hf-revision", _body(model={"source": "hf://org/repo@v2"}), _body(model={"source": "hf://org/repo"})),
    ("hf-revision-not-a-branch", _body(model={"source": "hf://org/repo@" + "0a" * 20}),
     _body(model={"source": "hf://org/repo@main"})),
    ("ar-pdb-not-zero", _body(ar={"podDisruptionBudget": {"maxUnavailable": "50%"}}),
     _body(ar={"podDisruptionBudget": {"maxUnavailable": 0}})),
    ("dit-pdb-not-zero", _body(dit={"podDisruptionBudget": {"maxUnavailable": 2}}),
     _body(dit={"podDisruptionBudget": {"maxUnavailable": "0%"}})),
    ("gateway-pdb-not-zero", _body(gateway={"podDisruptionBudget": {"enabled": False, "maxUnavailable": 1}}),
     _body(gateway={"podDisruptionBudget": {"maxUnavailable": "0"}})),
    ("ar-rollout", _body(ar={"rollout": {"maxSurge": 0, "maxUnavailable": "25%"}}),
     _body(ar={"rollout": {"maxSurge": 0, "maxUnavailable": 0}})),
    ("dit-rollout", _body(dit={"rollout": {"maxSurge": 1, "maxUnavailable": 0}}),
     _body(dit={"rollout": {"maxSurge": "0%", "maxUnavailable": 0}})),
    ("gateway-rollout", _body(gateway={"rollout": {"maxSurge": "25%", "maxUnavailable": "0%"}}),
     _body(gateway={"rollout": {"maxSurge": "0%", "maxUnavailable": "0%"}})),
    ("ar-autoscaling-bounds", _body(ar={"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 2}}),
     _body(ar={"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}})),
    ("dit-autoscaling-bounds", _body(dit={"autoscaling": {"minReplicas": 1, "maxReplicas": 8}}),
     _body(dit={"autoscaling": {"minReplicas": 9, "maxReplicas": 8}})),
    ("chunk-fits-message", _body(transport={"chunkRows": 4096, "maxMessageBytes": 67108864}),
     _body(transport={"chunkRows": 4096, "maxMessageBytes": 67108863})),
    ("image-size-limits", _body(requestDefaults={"minPixels": 1048576, "maxPixels": 1048576}),
     _body(requestDefaults={"minPixels": 1048577, "maxPixels": 1048576})),
    ("cfg-range", _body(requestDefaults={"cfgRange": [0, 0.5]}), _body(requestDefaults={"cfgRange": [0.6, 0.5]})),
    ("ar-w8a8-one-gpu", _body(ar={"weightsDtype": "fp8-w8a8"}),
     _body(ar={"weightsDtype": "fp8-w8a8", "tensorParallelSize": 2})),
    ("monitoring-peer", _body(networkPolicy={"enabled": True, "monitoring": {"podSelector": {"matchLabels": {"a": "b"}}}}),
     _body(networkPolicy={"enabled": True, "monitoring": {}})),
]


def test_every_cel_rule_has_a_case(crd):
    rules = [r["rule"] for _, node in _walk(openapi_schema(crd)) for r in node.get("x-kubernetes-validations") or []]
    # Rules on shared sub-schemas (rollout, autoscaling, source) appear once per use; the cases above
    # cover each use: 1 name + 3 model + 3 rollout + 3 podDisruptionBudget + 2 autoscaling + 1 ar
    # weights/tensor parallel + 1 transport + 2 requestDefaults + 1 networkPolicy.monitoring.
    assert len(rules) == 17


@pytest.mark.parametrize("case,accepted,rejected", CEL_CASES, ids=[c[0] for c in CEL_CASES])
def test_cel_rule_accepts_and_rejects(crd, case, accepted, rejected):
    good, _, violations = validate_custom_resource(crd, accepted)
    assert violations == [], violations
    _, _, violations = validate_custom_resource(crd, rejected)
    assert violations, f"{case}: the rejected spec passed"
    assert any("Invalid value" in v for v in violations) or case.startswith("model-scheme"), violations
    # The operator's own re-check agrees on both.
    parse_spec(accepted["metadata"]["name"], "default", good["spec"], IMAGES)
    with pytest.raises(InvalidSpec):
        parse_spec(rejected["metadata"]["name"], "default", rejected["spec"], IMAGES)


def test_cel_rule_messages_name_the_field(crd):
    schema = openapi_schema(crd)
    found = cel_violations(schema, _body(transport={"chunkRows": 4096, "maxMessageBytes": 1048576}))
    assert found == ["spec.transport.chunkRows: Invalid value: a chunk (chunkRows rows of up to 4096 float32 values) "
                     "must fit in maxMessageBytes"]


def test_children_names_fit_dns_labels():
    names = builders.child_names("a" * 47)
    assert max(len(n) for n in vars(names).values()) <= 63


@pytest.mark.parametrize("crd_path,values", [
    ("ar.weightsDtype", "AR_WEIGHTS_DTYPES"), ("dit.parallel", "DIT_PARALLEL_MODES"),
])
def test_enumerated_fields_take_exactly_the_settings_values(crd, crd_path, values):
    """The CRD's enum for a field the stages read is the settings' one list of values, in its order: a
    value the stage accepts but the API server refuses (or the reverse) cannot be applied by anyone."""
    from mammoth_core import settings

    node = openapi_schema(crd)["properties"]["spec"]
    for part in crd_path.split("."):
        node = node["properties"][part]
    assert node["enum"] == list(getattr(settings, values))
