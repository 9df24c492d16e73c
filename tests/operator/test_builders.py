"""Pure builders: spec -> manifests, checked without a cluster (and against the Kubernetes schemas)."""

from __future__ import annotations

import math
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mammoth_operator import builders, kube
from mammoth_operator.builders import Child
from mammoth_operator.config import OperatorConfig
from mammoth_operator.spec import PipelineSpec, parse_spec

IMAGES = OperatorConfig.from_env({}).images
K8S_VERSION = "1.35"


def pipeline(name: str = "p", **spec: Any) -> PipelineSpec:
    base: dict[str, Any] = {"model": {"source": "builtin://tiny"}}
    base.update(spec)
    return parse_spec(name, "ns1", base, IMAGES)


VARIANTS = {
    "builtin": pipeline(),
    "pvc": pipeline(model={"source": "pvc://weights/mammoth/v1"}),
    "file": pipeline(model={"source": "file:///mnt/mammoth"}),
    "hf": pipeline(model={"source": "hf://bytedance/MammothModa2@0123456789abcdef0123456789abcdef01234567", "hfTokenSecretRef": {"name": "hf"},
                          "cache": {"claimName": "hf-cache"}}),
    "everything": pipeline(
        ar={"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}, "gpus": 2,
            "resources": {"requests": {"cpu": 4, "memory": "32Gi"}}, "nodeSelector": {"gpu": "h200"},
            "env": [{"name": "POD_IP", "value": "override"}, {"name": "X", "value": "1"}], "args": ["--foo"]},
        dit={"autoscaling": {"enabled": True, "metric": {"type": "External", "name": "dit_slots", "targetAverageValue": 2}},
             "podDisruptionBudget": {"enabled": False}},
        gateway={"service": {"type": "LoadBalancer", "port": 8080}, "apiKeysSecretRef": {"name": "keys"}},
        transport={"authTokenSecretRef": {"name": "stage-token", "key": "t"}},
        networkPolicy={"enabled": True}, serviceAccountName="mammoth", imagePullSecrets=[{"name": "ghcr"}],
    ),
}


def by_kind(children: list[Child]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c.kind, c.name): c.manifest for c in children}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_children_validate_against_kubernetes_schemas(variant):
    for child in builders.build_children(VARIANTS[variant]):
        manifest = dict(child.manifest, metadata=dict(child.manifest["metadata"], namespace="ns1"))
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_selectors_match_pod_labels(variant):
    children = by_kind(builders.build_children(VARIANTS[variant]))
    pods = {m["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: m["spec"]["template"]["metadata"]["labels"]
            for (kind, _), m in children.items() if kind == "Deployment"}
    assert set(pods) == {"ar", "dit", "gateway"}

    def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
        ok = all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())
        for expr in selector.get("matchExpressions") or []:
            assert expr["operator"] == "In"
            ok = ok and labels.get(expr["key"]) in expr["values"]
        return ok

    for (kind, name), manifest in children.items():
        component = manifest["metadata"]["labels"]["app.kubernetes.io/component"]
        if kind == "Service":
            selected = {c for c, labels in pods.items() if all(labels.get(k) == v for k, v in manifest["spec"]["selector"].items())}
            assert selected == {component}, name
        elif kind in ("PodDisruptionBudget", "Deployment"):
            selector = manifest["spec"]["selector"]
            assert {c for c, labels in pods.items() if matches(selector, labels)} == {component}, name
        elif kind == "NetworkPolicy":
            assert {c for c, labels in pods.items() if matches(manifest["spec"]["podSelector"], labels)} == {
                "ar", "dit", "gateway"}
            # gRPC from the gateway (both stages) and from AR pods (the DiT's port only)
            peers = [manifest["spec"]["ingress"][i]["from"][0]["podSelector"] for i in (0, 1)]
            assert [{c for c, labels in pods.items() if matches(p, labels)} for p in peers] == [{"gateway"}, {"ar"}]


def test_both_stages_get_the_same_transport_limits():
    spec = pipeline(transport={"chunkRows": 128, "maxMessageBytes": 8388608})
    children = by_kind(builders.build_children(spec))
    config = yaml.safe_load(children[("ConfigMap", "p-config")]["data"]["pipeline.yaml"])
    assert config["chunk_rows"] == 128 and config["max_message_bytes"] == 8388608
    for section in ("ar", "dit", "gateway"):
        assert "chunk_rows" not in config[section] and "max_message_bytes" not in config[section]
    hashes = {}
    for name in ("p-ar", "p-dit", "p-gateway"):
        pod = children[("Deployment", name)]["spec"]["template"]
        container = pod["spec"]["containers"][0]
        assert container["args"][1:3] == ["--config", builders.CONFIG_PATH]
        assert {"name": "config", "mountPath": "/etc/mammoth", "readOnly": True} in container["volumeMounts"]
        assert {"name": "config", "configMap": {"name": "p-config"}} in pod["spec"]["volumes"]
        hashes[name[2:]] = pod["metadata"]["annotations"][builders.CONFIG_HASH_ANNOTATION]
    assert hashes == {c: builders.config_hash(spec, c) for c in ("ar", "dit", "gateway")}
    other = pipeline(transport={"chunkRows": 64, "maxMessageBytes": 8388608})
    # chunk_rows is read by both stages, not by the gateway: exactly the stages roll
    assert {c for c in hashes if builders.config_hash(other, c) != hashes[c]} == {"ar", "dit"}


def test_stage_pods_probes_grace_and_rollout():
    spec = pipeline(ar={"startupTimeoutSeconds": 901, "rollout": {"maxSurge": 0, "maxUnavailable": 1}},
                    requestDefaults={"requestTimeoutSeconds": 900})
    ar = by_kind(builders.build_children(spec))[("Deployment", "p-ar")]
    pod = ar["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["startupProbe"]["grpc"] == {"port": 50051, "service": "mammoth.v1.AR"}
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 901
    assert container["startupProbe"]["failureThreshold"] == math.ceil(901 / 10)
    assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": "mammoth.v1.AR"}
    assert "tcpSocket" in container["livenessProbe"]
    # the grace fits the cluster autoscaler's 600 s; the drain gets what is left of it
    assert pod["terminationGracePeriodSeconds"] == builders.MAX_TERMINATION_GRACE_SECONDS == 600
    assert pod["automountServiceAccountToken"] is False
    assert ar["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    config = yaml.safe_load(by_kind(builders.build_children(spec))[("ConfigMap", "p-config")]["data"]["pipeline.yaml"])
    assert config["drain_grace_seconds"] == 600 - 5 - 15
    dit = by_kind(builders.build_children(spec))[("Deployment", "p-dit")]
    assert dit["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["service"] == "mammoth.v1.DiT"


@pytest.mark.parametrize("variant,checkpoint,volume", [
    ("builtin", "builtin://tiny", None),
    ("pvc", "/models/mammoth/v1", {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}),
    ("file", "/models", {"name": "model", "hostPath": {"path": "/mnt/mammoth", "type": "Directory"}}),
    ("hf", "/models/hf/bytedance--MammothModa2/0123456789abcdef0123456789abcdef01234567", {"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache"}}),
])
def test_model_sources(variant, checkpoint, volume):
    children = by_kind(builders.build_children(VARIANTS[variant]))
    for name in ("p-ar", "p-dit"):
        pod = children[("Deployment", name)]["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert args[args.index("--checkpoint") + 1] == checkpoint
        volumes = [v for v in pod["volumes"] if v["name"] == "model"]
        assert volumes == ([volume] if volume else [])
        if variant == "hf":
            (init,) = pod["initContainers"]
            assert init["args"] == ["download-model", "hf://bytedance/MammothModa2@0123456789abcdef0123456789abcdef01234567", checkpoint]
            assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in init["env"]
        else:
            assert "initContainers" not in pod


def test_hf_without_cache_claim_uses_sized_emptydir():
    spec = pipeline(model={"source": "hf://org/repo@v1", "cache": {"sizeLimit": "80Gi"}})
    pod = by_kind(builders.build_children(spec))[("Deployment", "p-ar")]["spec"]["template"]["spec"]
    assert {"name": "model", "emptyDir": {"sizeLimit": "80Gi"}} in pod["volumes"]


def test_autoscaling_children():
    children = builders.build_children(VARIANTS["everything"])
    kinds = by_kind(children)
    ar_hpa = kinds[("HorizontalPodAutoscaler", "p-ar")]
    assert ar_hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "mammoth_ar_running_sequences"}, "target": {"type": "AverageValue", "averageValue": "6"}}}]
    assert (ar_hpa["spec"]["minReplicas"], ar_hpa["spec"]["maxReplicas"]) == (2, 6)
    dit_hpa = kinds[("HorizontalPodAutoscaler", "p-dit")]
    assert dit_hpa["spec"]["metrics"][0]["type"] == "External"
    assert dit_hpa["spec"]["metrics"][0]["external"]["target"]["averageValue"] == "2"
    ar_child = next(c for c in children if (c.kind, c.name) == ("Deployment", "p-ar"))
    assert ar_child.create_only == (("spec", "replicas"),)
    assert ar_child.manifest["spec"]["replicas"] == 2  # created at minReplicas, then owned by the HPA
    assert ("PodDisruptionBudget", "p-dit") not in kinds
    unwanted = builders.unwanted_children(VARIANTS["everything"])
    assert [(r.kind, r.name) for r in unwanted] == [("PodDisruptionBudget", "p-dit")]
    assert {(r.kind, r.name) for r in builders.unwanted_children(VARIANTS["builtin"])} == {
        ("HorizontalPodAutoscaler", "p-ar"), ("HorizontalPodAutoscaler", "p-dit")}  # NetworkPolicy: on by default


def test_user_env_overrides_and_extra_args():
    container = by_kind(builders.build_children(VARIANTS["everything"]))[("Deployment", "p-ar")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"] == {"name": "POD_IP", "value": "override"}
    assert [e["name"] for e in container["env"]].count("POD_IP") == 1
    assert container["args"][-1] == "--foo"
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "2"}


def test_gateway_backends_are_headless_service_dns():
    children = by_kind(builders.build_children(VARIANTS["builtin"]))
    args = children[("Deployment", "p-gateway")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--ar") + 1] == "dns:///p-ar.ns1.svc:50051"
    assert args[args.index("--dit") + 1] == "dns:///p-dit.ns1.svc:50052"
    assert children[("Service", "p-ar")]["spec"]["clusterIP"] == "None"
    assert children[("Service", "p-dit")]["spec"]["clusterIP"] == "None"
    # the AR may push only to the pods behind the same DiT Service the gateway dials
    assert builders.pipeline_config(VARIANTS["builtin"])["ar"]["dit_allow_list"] == ["dns:///p-dit.ns1.svc:50052"]


# -- the create-or-patch diff ---------------------------------------------------------------------


def test_merge_patch_ignores_server_defaults_and_removes_dropped_fields():
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "x"}]}, "selector": {"a": "b"}}}
    observed = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "x", "terminationMessagePath": "/dev"}]},
                         "selector": {"a": "b"}, "revisionHistoryLimit": 10, "nodeSelector": {"gpu": "1"}}}
    last = {"spec": {"replicas": 2, "nodeSelector": {"gpu": "1"}}}
    assert kube.merge_patch(last, desired, observed) == {"spec": {"nodeSelector": None}}
    assert kube.merge_patch({}, desired, observed) == {}
    changed = {"spec": {"replicas": 3, "template": {"containers": [{"name": "a", "image": "y"}]}, "selector": {"a": "b"}}}
    assert kube.merge_patch({}, changed, observed) == {
        "spec": {"replicas": 3, "template": {"containers": [{"name": "a", "image": "y"}]}}}


def test_covers_quantities_and_types():
    assert kube.covers("1", "1") and kube.covers(1, "1") and kube.covers("4", 4)
    assert not kube.covers(True, 1) and not kube.covers(0, False)
    assert kube.covers([{"a": 1, "b": 2}], [{"a": 1}])
    assert not kube.covers([{"a": 1}, {"a": 2}], [{"a": 1}])


def test_gateway_service_uses_client_ip_affinity_for_url_images():
    """`url` images live in one gateway replica's memory: the Service must keep a client on it."""
    import pathlib

    import yaml

    from mammoth_operator.builders import build_gateway_service
    from mammoth_operator.config import OperatorConfig
    from mammoth_operator.spec import parse_spec

    example = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "mammothpipeline.yaml").read_text())
    spec = parse_spec("demo", "default", example["spec"], OperatorConfig.from_env().images)
    service = build_gateway_service(spec).manifest
    assert service["spec"]["sessionAffinity"] == "ClientIP"


def test_every_key_the_operator_writes_is_read_by_a_component(tmp_path):
    """The ConfigMap's pipeline.yaml has no key the settings ignore (and so no hash over dead keys)."""
    from mammoth_core.config_keys import unknown_config_keys

    for variant, spec in VARIANTS.items():
        path = tmp_path / f"{variant}.yaml"
        path.write_text(builders.render_config(spec))
        assert unknown_config_keys(path) == [], variant


def test_ar_weights_dtype_reaches_the_ar_settings(tmp_path):
    """``spec.ar.weightsDtype: fp8`` lands in the AR's section of the config file the AR container
    reads (``mammoth ar --config``), and the AR settings built from that file say fp8; the default is auto."""
    from mammoth_core.settings import ARSettings, resolve_settings
    from mammoth_operator.spec import InvalidSpec

    path = tmp_path / "pipeline.yaml"
    for value in ("fp8", "fp8-w8a8"):
        path.write_text(builders.render_config(pipeline(ar={"weightsDtype": value})))
        assert resolve_settings(ARSettings, config_file=str(path), env={}).weights_dtype == value
    assert builders.component_settings(VARIANTS["builtin"], "ar")["weights_dtype"] == "auto"
    with pytest.raises(InvalidSpec, match="weightsDtype"):
        pipeline(ar={"weightsDtype": "int4"})
