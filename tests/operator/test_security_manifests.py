"""Security of the rendered manifests: restricted Pod Security for every pod the operator or the chart
makes, the stage NetworkPolicy's exact rules, and the per-role token Secret mounted where needed."""

from __future__ import annotations

import copy
import pathlib
import sys
from typing import Any

import pytest
import yaml

from mammoth_core.settings import ARSettings, DiTSettings, GatewaySettings, resolve_settings
from mammoth_operator import builders
from mammoth_operator.config import OperatorConfig
from mammoth_operator.spec import parse_spec

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from restricted_pss import pod_specs, violations  # noqa: E402

IMAGES = OperatorConfig.from_env({}).images
CHART_TESTS = pathlib.Path(__file__).resolve().parents[1] / "chart"


def pipeline(**spec: Any):
    base: dict[str, Any] = {"model": {"source": "builtin://tiny"}}
    base.update(spec)
    return parse_spec("p", "ns1", base, IMAGES)


def manifests(spec) -> list[dict[str, Any]]:
    return [c.manifest for c in builders.build_children(spec)]


SECURE = dict(
    transport={"roleTokensSecretRef": {"name": "stage-roles"}},
    networkPolicy={"enabled": True, "monitoring": {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}},
    gateway={"apiKeysSecretRef": {"name": "keys"}},
)


@pytest.mark.parametrize("spec", [
    pipeline(),
    pipeline(model={"source": "pvc://weights/mammoth/v1"}, **SECURE),
    pipeline(model={"source": "hf://org/repo@0123456789abcdef0123456789abcdef01234567", "hfTokenSecretRef": {"name": "hf"}}),  # init container
], ids=["builtin", "pvc-secure", "hf-init"])
def test_operator_pods_pass_the_restricted_profile(spec):
    pods = pod_specs(manifests(spec))
    assert len(pods) == 3
    for name, pod in pods:
        assert violations(pod) == [], name
        # writable paths are emptyDirs: /tmp and the cache
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for path in ("/tmp", builders.CACHE_DIR):
            assert "emptyDir" in volumes[mounts[path]], (name, path)


def test_the_checker_catches_what_the_profile_forbids():
    (_, pod), *_ = pod_specs(manifests(pipeline()))
    assert violations(pod) == []
    cases = {
        "privileged": lambda p: p["containers"][0]["securityContext"].update(privileged=True),
        "allowPrivilegeEscalation": lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
        "runAsNonRoot": lambda p: (p["securityContext"].pop("runAsNonRoot"),
                                   p["containers"][0]["securityContext"].pop("runAsNonRoot")),
        "seccompProfile": lambda p: p["securityContext"].pop("seccompProfile"),
        "capabilities.drop": lambda p: p["containers"][0]["securityContext"].update(capabilities={"drop": []}),
        "capabilities.add": lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
        "hostNetwork": lambda p: p.update(hostNetwork=True),
        "hostPort": lambda p: p["containers"][0]["ports"][0].update(hostPort=50051),
        "volume": lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "runAsUser": lambda p: p["securityContext"].update(runAsUser=0),
    }
    for what, mutate in cases.items():
        bad = copy.deepcopy(pod)
        mutate(bad)
        assert any(what.split(".")[0] in v for v in violations(bad)), what


def test_file_model_source_is_flagged_because_it_needs_hostpath():
    spec = pipeline(model={"source": "file:///mnt/mammoth"})
    flagged = {name for name, pod in pod_specs(manifests(spec)) if violations(pod)}
    assert flagged == {"Deployment/p-ar", "Deployment/p-dit"}  # documented in docs/RELIABILITY.md


def test_chart_operator_deployment_passes_the_restricted_profile():
    sys.path.insert(0, str(CHART_TESTS))
    import chart_tools

    try:
        helm = chart_tools.find_helm()
    except chart_tools.ToolMissing as exc:
        pytest.skip(str(exc))
    pods = pod_specs(chart_tools.render(helm))
    assert pods
    for name, pod in pods:
        assert violations(pod) == [], name


def test_network_policy_admits_exactly_the_designed_peers():
    spec = pipeline(**SECURE)
    (policy,) = [m for m in manifests(spec) if m["kind"] == "NetworkPolicy"]
    rules = policy["spec"]["ingress"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    summary = [(r.get("from"), sorted(p["port"] for p in r["ports"])) for r in rules]
    assert summary == [
        ([{"podSelector": {"matchLabels": builders.selector_labels("p", "gateway")}}], [50051, 50052]),
        ([{"podSelector": {"matchLabels": builders.selector_labels("p", "ar")}}], [50052]),
        (None, [8000]),  # the gateway's HTTP port: the pipeline's endpoint, from anywhere
        ([SECURE["networkPolicy"]["monitoring"]], [9091, 9092]),
    ]
    selected = policy["spec"]["podSelector"]["matchExpressions"][0]["values"]
    assert selected == ["ar", "dit", "gateway"]
    # without a monitoring selector the metrics ports admit nobody
    plain = pipeline(networkPolicy={"enabled": True})
    (policy,) = [m for m in manifests(plain) if m["kind"] == "NetworkPolicy"]
    ports = {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]}
    assert ports == {50051, 50052, 8000}


def test_invalid_monitoring_selector_is_refused():
    from mammoth_operator.spec import InvalidSpec

    with pytest.raises(InvalidSpec):
        pipeline(networkPolicy={"enabled": True, "monitoring": {}})
    with pytest.raises(InvalidSpec):
        pipeline(networkPolicy={"enabled": True, "monitoring": {"podSelector": {"app": "x"}}})


def test_role_tokens_are_mounted_where_needed_and_read_by_the_settings(tmp_path):
    spec = pipeline(**SECURE)
    ms = manifests(spec)
    config = yaml.safe_load(next(m for m in ms if m["kind"] == "ConfigMap")["data"]["pipeline.yaml"])
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    expected = {"gateway": {"gateway"}, "ar": {"gateway", "ar"}, "dit": {"gateway", "ar"}}
    classes = {"gateway": GatewaySettings, "ar": ARSettings, "dit": DiTSettings}
    for component, roles in expected.items():
        pod = next(m for m in ms if m["kind"] == "Deployment" and m["metadata"]["name"] == f"p-{component}")
        pod = pod["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "role-tokens"]
        assert volume["secret"]["secretName"] == "stage-roles"
        assert {i["path"] for i in volume["secret"]["items"]} == roles
        settings = resolve_settings(classes[component], env={}, config_file=str(tmp_path / "pipeline.yaml"))
        files = {r: getattr(settings, f"{r}_token_file") for r in ("gateway", "ar")}
        assert {r for r, f in files.items() if f} == roles, component
        for f in files.values():
            if f:
                assert f.startswith(builders.ROLE_TOKENS_DIR + "/")
