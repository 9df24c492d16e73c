"""`values.schema.json` accepts the shipped values and rejects bad ones (through real `helm`)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

import chart_tools
from chart_tools import CHART_DIR, example_values_files

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())

# (--set arguments, fragment of helm's error naming the offending value)
BAD_VALUES = [
    (["logFormat=xml"], "/logFormat"),
    (["logLevel=trace"], "/logLevel"),
    (["watchNamespaces[0]=Team_A"], "/watchNamespaces/0"),
    (["watchNamespaces[0]=team-a", "watchNamespaces[1]=team-a"], "/watchNamespaces"),
    (["image.pullPolicy=Sometimes"], "/image/pullPolicy"),
    (["image.digest=md5:abc"], "/image/digest"),
    (["image.repository=Not A Repo"], "/image/repository"),
    (["image.tag=:bad"], "/image/tag"),
    (["stageImages.ar.repository="], "/stageImages/ar/repository"),
    (["livenessPort=80"], "/livenessPort"),
    (["livenessPort=notaport"], "/livenessPort"),
    (["metricsPort=80"], "/metricsPort"),
    (["monitoring.serviceMonitor.interval=soon"], "/monitoring/serviceMonitor/interval"),
    (["monitoring.dashboard.enabled=yes"], "/monitoring/dashboard/enabled"),
    (["rbac.create=maybe"], "/rbac/create"),
    (["replicaCount=2"], "replicaCount"),
    (["serviceAccount.nmae=typo"], "nmae"),
    (["podSecurityContext.runAsNonRoot=false"], "/podSecurityContext/runAsNonRoot"),
    (["securityContext.allowPrivilegeEscalation=true"], "/securityContext/allowPrivilegeEscalation"),
    (["resources.limits.memory=lots"], "/resources/limits/memory"),
    (["extraArgs[0]=operator"], "/extraArgs/0"),
    (["examplePipeline.name=Has_Caps"], "/examplePipeline/name"),
    (["extraEnv[0].value=x"], "/extraEnv/0"),
]


@pytest.mark.parametrize("set_values,where", BAD_VALUES, ids=[" ".join(c[0]) for c in BAD_VALUES])
def test_helm_rejects_bad_values(helm, set_values, where):
    proc = chart_tools.helm_template(helm, set_values=set_values, check=False)
    assert proc.returncode != 0, f"helm accepted {set_values}:\n{proc.stdout[:500]}"
    assert where in proc.stderr, proc.stderr


@pytest.mark.parametrize("path", [CHART_DIR / "values.yaml", *example_values_files()],
                         ids=lambda p: p.name)
def test_shipped_values_match_the_schema(path):
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    override = yaml.safe_load(path.read_text()) or {}

    def merge(base, extra):
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                merge(base[key], value)
            else:
                base[key] = value
        return base

    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(merge(values, override))


def test_example_pipeline_outside_watched_namespaces_is_refused(helm):
    proc = chart_tools.helm_template(
        helm, check=False,
        set_values=["watchNamespaces[0]=team-a", "examplePipeline.enabled=true",
                    "examplePipeline.namespace=team-b"])
    assert proc.returncode != 0
    assert "would never reconcile it" in proc.stderr


def test_every_schema_property_is_described():
    missing = []

    def walk(node, path):
        for key, sub in (node.get("properties") or {}).items():
            if "description" not in sub:
                missing.append(f"{path}/{key}")
            walk(sub, f"{path}/{key}")

    walk(SCHEMA, "")
    assert missing == []
