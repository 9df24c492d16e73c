"""The CRD's single source, and what `helm uninstall` leaves behind (shown on rendered output).

Helm installs files under `crds/` before the templates, never templates them, never upgrades
them and never deletes them (https://helm.sh/docs/chart_best_practices/custom_resource_definitions/).
So uninstalling the release keeps the MammothPipeline CRD, and with it every pipeline; the only
pipeline the chart itself can render (the optional example) carries `helm.sh/resource-policy:
keep`, which makes `helm uninstall` skip it. Pipelines' children are owned by their pipeline
(owner references set by the operator), not by anything of the release, so nothing cascades.
"""

from __future__ import annotations

import importlib

import pytest

import chart_tools
from chart_tools import CHART_DIR, CRD_FILE, REPO_ROOT, by_kind, load_crd, render, run


def test_crd_lives_only_in_crds_and_renders_byte_identical(helm):
    """`helm show crds` prints exactly the file; templates never emit a CRD."""
    shown = run([helm, "show", "crds", CHART_DIR], check=True).stdout
    assert shown.removeprefix("---\n").strip() == CRD_FILE.read_text().strip()
    templates_only = render(helm, set_values=["examplePipeline.enabled=true"])
    assert by_kind(templates_only, "CustomResourceDefinition") == []
    with_crds = render(helm, include_crds=True)
    [crd] = by_kind(with_crds, "CustomResourceDefinition")
    assert crd == load_crd()


def test_there_is_one_crd_source_in_the_repository():
    """No second copy of the MammothPipeline CRD anywhere in the tracked tree."""
    copies = []
    tracked = run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], check=True)
    for name in tracked.stdout.splitlines():
        path = REPO_ROOT / name
        if path.suffix not in (".yaml", ".yml", ".json") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if "CustomResourceDefinition" in text and "mammothpipelines.mammoth.dev" in text:
            copies.append(name)
    assert copies == [str(CRD_FILE.relative_to(REPO_ROOT))]


def test_operator_package_reads_the_chart_crd():
    """The operator's CRD loader (used by its tests and the emulator) returns the chart's file."""
    try:
        crd_module = importlib.import_module("mammoth_operator.crd")
    except ImportError as error:
        pytest.fail(f"mammoth_operator.crd is missing (owned by the operator): {error}")
    loaders = [getattr(crd_module, name) for name in ("load_crd", "crd_manifest", "load")
               if callable(getattr(crd_module, name, None))]
    assert loaders, "mammoth_operator.crd exposes no loader (load_crd/crd_manifest/load)"
    assert loaders[0]() == load_crd()


def test_uninstall_keeps_the_crd_and_pipelines(helm):
    """Everything Helm would delete on uninstall is listed; no CRD and no pipeline is among it."""
    docs = render(helm, values=[chart_tools.CI_VALUES_DIR / "example-pipeline-values.yaml"])
    deleted_on_uninstall = [
        (doc["kind"], doc["metadata"]["name"]) for doc in docs
        if (doc["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") != "keep"
    ]
    kinds = {kind for kind, _ in deleted_on_uninstall}
    assert kinds == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
                     "Service", "ConfigMap"}  # the operator's metrics Service, the Grafana dashboard
    [pipeline] = by_kind(docs, "MammothPipeline")
    assert pipeline["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # no hooks: nothing runs at uninstall time that could delete pipelines or the CRD
    for doc in docs:
        assert "helm.sh/hook" not in (doc["metadata"].get("annotations") or {})
    assert not (CHART_DIR / "templates" / "tests").exists()
    for template in (CHART_DIR / "templates").glob("*.yaml"):
        assert "CustomResourceDefinition" not in template.read_text(), template
