"""Rendered manifests: strict Kubernetes schemas, the restricted security profile, labels, probes.

Built-in kinds are validated by `kubernetes-validate` in strict mode (unknown fields are errors)
for the oldest and newest Kubernetes the chart supports; the MammothPipeline custom resource is
validated against the CRD's own `openAPIV3Schema` with `jsonschema` (unknown fields rejected, as
the API server's strict field validation does).
"""

from __future__ import annotations

import copy
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

import chart_tools
from chart_tools import CHART_DIR, by_kind, example_values_files, load_crd, render

KUBERNETES_VERSIONS = ["1.30.0", "1.35.0"]  # Chart.yaml kubeVersion floor, and kubectl's version
VALUES_CASES = [pytest.param([], id="default")] + [
    pytest.param([path], id=path.name) for path in example_values_files()
]
RECOMMENDED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                      "app.kubernetes.io/managed-by", "helm.sh/chart",
                      "app.kubernetes.io/component", "app.kubernetes.io/part-of")


def structural_to_jsonschema(node):
    """Turn a CRD structural schema into a strict JSON schema.

    Objects with `properties` get `additionalProperties: false` unless they set
    `x-kubernetes-preserve-unknown-fields`; `nullable: true` admits null.
    """
    if isinstance(node, list):
        return [structural_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: structural_to_jsonschema(value) for key, value in node.items()
           if not key.startswith("x-kubernetes-")}
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    out.pop("nullable", None)
    return out


def validate_custom_resource(doc: dict) -> None:
    """Validate a MammothPipeline against the CRD schema (metadata left to the API server)."""
    crd = load_crd()
    assert doc["apiVersion"] == f"{crd['spec']['group']}/v1alpha1"
    assert doc["kind"] == crd["spec"]["names"]["kind"]
    schema = structural_to_jsonschema(chart_tools.crd_schema(crd))
    body = {key: value for key, value in doc.items() if key != "metadata"}
    schema = copy.deepcopy(schema)
    schema.get("properties", {}).pop("metadata", None)
    jsonschema.Draft7Validator(schema).validate(body)


_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array"}}}
_NAMESPACE_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}}
_ENDPOINT = {"type": "object", "additionalProperties": False, "required": ["port"], "properties": {
    "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
    "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"}}}
#: The fields of Prometheus Operator's ServiceMonitor/PodMonitor (monitoring.coreos.com/v1) that the
#: chart may use, with their types, and nothing else (a misspelt field fails, as with
#: kubernetes-validate's strict mode). Field names follow the Prometheus Operator API reference.
MONITOR_SCHEMAS = {
    kind: {"type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
           "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind},
                          "metadata": {"type": "object"},
                          "spec": {"type": "object", "additionalProperties": False, "required": ["selector", endpoints],
                                   "properties": {"selector": _SELECTOR, "namespaceSelector": _NAMESPACE_SELECTOR,
                                                  "jobLabel": {"type": "string"},
                                                  endpoints: {"type": "array", "minItems": 1, "items": _ENDPOINT}}}}}
    for kind, endpoints in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints"))
}


def validate_monitor(doc: dict) -> None:
    """Validate a ServiceMonitor/PodMonitor against `MONITOR_SCHEMAS`."""
    jsonschema.Draft7Validator(MONITOR_SCHEMAS[doc["kind"]]).validate(doc)


@pytest.mark.parametrize("values", VALUES_CASES)
@pytest.mark.parametrize("kube_version", KUBERNETES_VERSIONS)
def test_rendered_manifests_validate_strictly(helm, values, kube_version):
    docs = render(helm, values=values, include_crds=True)
    assert docs
    for doc in docs:
        if doc["kind"] == "MammothPipeline":
            validate_custom_resource(doc)
            continue
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            validate_monitor(doc)  # a CRD kind kubernetes-validate does not know
            continue
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {error.message} at "
                        f"{'/'.join(map(str, error.path))} (Kubernetes {kube_version})")


def test_strict_validation_catches_a_misspelt_field():
    """The validator used above really rejects unknown fields (so the test above can fail)."""
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replica": 1, "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}},
                                 "spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[-1], strict=True)
    pipeline = yaml.safe_load(chart_tools.EXAMPLE_PIPELINE.read_text())
    pipeline["spec"]["ar"]["gpu"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(pipeline)


def test_example_pipeline_file_matches_the_crd():
    validate_custom_resource(yaml.safe_load(chart_tools.EXAMPLE_PIPELINE.read_text()))


@pytest.mark.parametrize("values", VALUES_CASES)
def test_every_object_carries_the_recommended_labels(helm, values):
    for doc in render(helm, values=values):
        labels = doc["metadata"].get("labels", {})
        missing = [label for label in RECOMMENDED_LABELS if label not in labels]
        assert missing == [], f"{doc['kind']}/{doc['metadata']['name']} lacks {missing}"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def _deployment(docs):
    [deployment] = by_kind(docs, "Deployment")
    return deployment


@pytest.mark.parametrize("values", VALUES_CASES)
def test_operator_pod_meets_the_restricted_pod_security_standard(helm, values):
    """The checks of the 'restricted' Pod Security Standard that a manifest alone can decide."""
    pod = _deployment(render(helm, values=values))["spec"]["template"]["spec"]
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost")
    assert pod["securityContext"].get("runAsUser", 1) != 0
    for volume in pod.get("volumes", []):
        assert set(volume) - {"name"} <= {"emptyDir", "configMap", "secret", "projected",
                                          "downwardAPI", "persistentVolumeClaim", "ephemeral"}
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert not context.get("capabilities", {}).get("add")
        assert context.get("privileged") in (None, False)
        assert context["readOnlyRootFilesystem"] is True
        assert not any(port.get("hostPort") for port in container.get("ports", []))
        assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]["cpu"]


def test_operator_runs_alone_with_a_kopf_liveness_probe(rendered_default):
    deployment = _deployment(rendered_default)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert "command" not in container, "the image's ENTRYPOINT (`mammoth`) must run"
    args = container["args"]
    assert args[0] == "operator"
    [liveness] = [a for a in args if a.startswith("--liveness=")]
    match = re.fullmatch(r"--liveness=http://0\.0\.0\.0:(\d+)(/healthz)", liveness)
    assert match, liveness
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == match.group(2)
    [port] = [p for p in container["ports"] if p["name"] == probe["port"]]
    assert port["containerPort"] == int(match.group(1))
    # the wildcard takes the pod IP's family (`mammoth_operator.liveness_endpoint`): the kubelet probes that IP
    pod_ip = [e for e in container["env"] if e["name"] == "POD_IP"]
    assert pod_ip == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}], container["env"]


def test_cluster_wide_mode_watches_all_namespaces(rendered_default):
    [container] = _deployment(rendered_default)["spec"]["template"]["spec"]["containers"]
    assert "--all-namespaces" in container["args"]
    assert not any(a.startswith("--namespace") for a in container["args"])
    assert by_kind(rendered_default, "Role") == [] and by_kind(rendered_default, "RoleBinding") == []
    [role] = by_kind(rendered_default, "ClusterRole")
    [binding] = by_kind(rendered_default, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    [account] = by_kind(rendered_default, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": chart_tools.RELEASE_NAMESPACE}]
    assert _deployment(rendered_default)["spec"]["template"]["spec"]["serviceAccountName"] == \
        account["metadata"]["name"]


def test_namespace_mode_grants_nothing_cluster_wide(helm):
    docs = render(helm, set_values=["watchNamespaces[0]=team-a", "watchNamespaces[1]=team-b"])
    assert by_kind(docs, "ClusterRole") == [] and by_kind(docs, "ClusterRoleBinding") == []
    roles = by_kind(docs, "Role")
    bindings = by_kind(docs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == chart_tools.RELEASE_NAMESPACE
    [container] = _deployment(docs)["spec"]["template"]["spec"]["containers"]
    assert [a for a in container["args"] if a.startswith("--namespace")] == \
        ["--namespace=team-a", "--namespace=team-b"]
    assert "--all-namespaces" not in container["args"]


def test_rbac_create_false_renders_no_rbac(helm):
    docs = render(helm, set_values=["rbac.create=false", "serviceAccount.create=false",
                                    "serviceAccount.name=admin-made"])
    # the operator and its monitoring objects (metrics Service, dashboard ConfigMap), no identity or RBAC
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "ConfigMap"}
    assert _deployment(docs)["spec"]["template"]["spec"]["serviceAccountName"] == "admin-made"


def test_default_images_are_the_ones_the_release_workflow_pushes(rendered_default):
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    tag = chart["appVersion"]
    [container] = _deployment(rendered_default)["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{chart_tools.IMAGE_PREFIX}operator:{tag}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    for stage in ("ar", "dit", "gateway"):
        assert env[f"MAMMOTH_OPERATOR_{stage.upper()}_IMAGE"] == f"{chart_tools.IMAGE_PREFIX}{stage}:{tag}"


def test_image_digest_wins_over_tag(helm):
    digest = "sha256:" + "ab" * 32
    docs = render(helm, set_values=[f"image.digest={digest}", "image.tag=9.9.9"])
    [container] = _deployment(docs)["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{chart_tools.IMAGE_PREFIX}operator@{digest}"
