"""The release workflow: actionlint-clean, builds the four images the chart refers to, checks the
tag against the chart, and publishes the chart."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

import chart_tools
from chart_tools import CHART_DIR, DOCKERFILES, REPO_ROOT, WORKFLOW_FILE, run


@pytest.fixture(scope="module")
def workflow() -> dict:
    # PyYAML reads the key `on` as True (YAML 1.1); put it back.
    data = yaml.safe_load(WORKFLOW_FILE.read_text())
    if True in data:
        data["on"] = data.pop(True)
    return data


def test_actionlint_passes(actionlint):
    proc = run([*actionlint, WORKFLOW_FILE])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_really_checks(actionlint, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
                   "      - run: echo ${{ github.no_such_property }}\n")
    proc = run([*actionlint, bad])
    assert proc.returncode != 0 and "no_such_property" in proc.stdout


def test_runs_on_version_tags_only(workflow):
    assert set(workflow["on"]) == {"push"}
    assert set(workflow["on"]["push"]) == {"tags"}
    assert all(tag.startswith("v") for tag in workflow["on"]["push"]["tags"])


def test_builds_and_pushes_the_four_images_the_chart_refers_to(workflow):
    job = workflow["jobs"]["images"]
    components = job["strategy"]["matrix"]["component"]
    assert sorted(components) == sorted(DOCKERFILES)
    [build] = [s for s in job["steps"] if str(s.get("uses", "")).startswith("docker/build-push-action@")]
    assert build["with"]["push"] is True
    assert build["with"]["file"] == "Dockerfile.${{ matrix.component }}"
    assert build["with"]["tags"] == "${{ env.IMAGE_PREFIX }}${{ matrix.component }}:${{ needs.version.outputs.version }}"
    prefix = workflow["env"]["IMAGE_PREFIX"]
    assert prefix == chart_tools.IMAGE_PREFIX
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    pushed = {f"{prefix}{component}" for component in components}
    referenced = {values["image"]["repository"]} | {
        values["stageImages"][stage]["repository"] for stage in ("ar", "dit", "gateway")}
    assert referenced == pushed
    assert values["image"]["tag"] == "" and all(
        values["stageImages"][s]["tag"] == "" for s in ("ar", "dit", "gateway")), \
        "default tags must fall back to appVersion, the tag the workflow pushes"
    assert job["permissions"]["packages"] == "write"


def _version_script(workflow) -> str:
    [step] = [s for s in workflow["jobs"]["version"]["steps"] if s.get("id") == "version"]
    return step["run"]


@pytest.mark.parametrize("tag,ok", [("v0.1.0", True), ("v9.9.9", False)])
def test_the_tag_must_equal_the_chart_version(workflow, tmp_path, tag, ok):
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    if ok:
        tag = f"v{chart['version']}"
    output = tmp_path / "github_output"
    output.touch()
    env = dict(os.environ, GITHUB_REF_NAME=tag, GITHUB_OUTPUT=str(output),
               CHART_DIR=workflow["env"]["CHART_DIR"])
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", _version_script(workflow)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert output.read_text().strip() == f"version={chart['appVersion']}"
        assert chart["version"] == chart["appVersion"]
    else:
        assert proc.returncode != 0 and "does not match Chart.yaml" in proc.stdout


def test_packages_and_pushes_the_chart(workflow):
    job = workflow["jobs"]["chart"]
    assert set(job["needs"]) == {"version", "images"}, "chart only after its images exist"
    commands = "\n".join(s.get("run", "") for s in job["steps"])
    assert 'helm package "$CHART_DIR"' in commands and "helm push" in commands
    assert workflow["env"]["CHART_DIR"] == str(CHART_DIR.relative_to(REPO_ROOT))
    helm_version = run([chart_tools.find_helm(), "version", "--short"]).stdout.strip() \
        if chart_tools.KUBE_TOOLS_BIN.joinpath("helm").exists() else None
    if helm_version:
        assert helm_version.startswith(workflow["env"]["HELM_VERSION"])
