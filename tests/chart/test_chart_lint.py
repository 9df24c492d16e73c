"""`helm lint` and `helm template` on the default values and on every example values file."""

from __future__ import annotations

import re

import pytest
import yaml

import chart_tools
from chart_tools import CHART_DIR, example_values_files, run

VALUES_CASES = [pytest.param([], id="default")] + [
    pytest.param([path], id=path.name) for path in example_values_files()
]


def test_there_are_example_values_files():
    names = {path.name for path in example_values_files()}
    assert {"namespaced-values.yaml", "example-pipeline-values.yaml"} <= names


@pytest.mark.parametrize("values", VALUES_CASES)
def test_helm_lint_strict_passes(helm, values):
    cmd = [helm, "lint", "--strict", CHART_DIR, "--namespace", chart_tools.RELEASE_NAMESPACE]
    for path in values:
        cmd += ["--values", path]
    proc = run(cmd, check=True)
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
    # --strict turns warnings into failures; make sure nothing but the icon hint is reported.
    reported = [line for line in proc.stdout.splitlines() if re.match(r"\[(WARNING|ERROR)\]", line)]
    assert reported == []


@pytest.mark.parametrize("values", VALUES_CASES)
def test_helm_template_renders_the_operator(helm, values):
    docs = chart_tools.render(helm, values=values)
    kinds = [doc["kind"] for doc in docs]
    assert kinds.count("Deployment") == 1
    for doc in docs:
        assert doc["metadata"]["name"], doc
        # namespaced objects are put where they belong explicitly (kubectl apply -f keeps them there)
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"):
            assert doc["metadata"].get("namespace"), f"{doc['kind']} {doc['metadata']['name']} has no namespace"


def test_helm_template_is_deterministic(helm):
    first = chart_tools.helm_template(helm, include_crds=True).stdout
    second = chart_tools.helm_template(helm, include_crds=True).stdout
    assert first == second


def test_every_values_key_is_documented_by_a_comment_starting_with_its_name():
    """Helm best practice: each value has a comment above it that begins with the key's name."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    undocumented = []
    for index, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):", line)
        if not match:
            continue
        # the comment block right above the key; its first line must start with the key's name
        top = index
        while top > 0 and lines[top - 1].strip().startswith("#"):
            top -= 1
        first = lines[top].strip() if top < index else ""
        if not re.match(rf"#\s*{match.group(2)}\b", first):
            undocumented.append(f"line {index + 1}: {match.group(2)}")
    assert undocumented == []


def test_values_keys_are_camel_case():
    def keys(node, path=""):
        if isinstance(node, dict):
            for key, value in node.items():
                yield f"{path}.{key}".lstrip("."), key
                # free-form maps (labels, annotations, selectors) hold user keys, not value names
                if key not in ("commonLabels", "podLabels", "podAnnotations", "annotations", "nodeSelector",
                               "labels"):
                    yield from keys(value, f"{path}.{key}")

    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    bad = [path for path, key in keys(values) if not re.fullmatch(r"[a-z][a-zA-Z0-9]*", key)]
    assert bad == []


def test_notes_tell_what_to_apply_next(helm):
    proc = run([helm, "install", chart_tools.RELEASE_NAME, CHART_DIR, "--dry-run=client",
                "--namespace", chart_tools.RELEASE_NAMESPACE], check=True)
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "kubectl apply" in notes and "examples/mammothpipeline-cpu.yaml" in notes
    assert "/v1/images/generations" in notes
    assert "helm uninstall" in notes and "keeps the MammothPipeline" in notes
