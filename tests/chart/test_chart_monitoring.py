"""The chart's monitoring: the Grafana dashboard ConfigMap, the ServiceMonitor/PodMonitor, the
operator's metrics port.

The dashboard may only query metrics the code exposes: the names come from the ``/metrics`` of a
running local pipeline (gateway, AR, DiT) and from the operator's own registry.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client import REGISTRY, generate_latest

import chart_tools
from chart_tools import CHART_DIR, by_kind, render

DASHBOARD_FILE = CHART_DIR / "dashboards" / "mammoth-pipeline.json"
_METRIC = re.compile(r"\b(mammoth_[a-z0-9_]+)")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
             "summary": ("_sum", "_count", "")}


def exposed_names(exposition: str) -> set[str]:
    """Every series name a Prometheus text exposition can produce, including labelled families
    that have no series yet (their ``# TYPE`` line names them)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            if kind == "counter":  # prometheus_client names a counter's family with or without _total
                name = name.removesuffix("_total")
            names |= {name + suffix for suffix in _SUFFIXES.get(kind, ("",))}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def dashboard_queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_dashboard_is_valid_and_covers_the_promised_panels():
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    names = {m for expr in dashboard_queries(dashboard) for m in _METRIC.findall(expr)}
    for promised in ("mammoth_gateway_requests_total", "mammoth_gateway_request_duration_seconds_bucket",
                     "mammoth_gateway_stage_duration_seconds_sum", "mammoth_ar_generated_tokens_total",
                     "mammoth_gateway_queue_depth", "mammoth_dit_slots_in_use",
                     "mammoth_transport_bytes_total", "mammoth_transport_chunks_total",
                     "mammoth_transport_pageable_fallback_total", "mammoth_gateway_cancellations_total",
                     "mammoth_operator_reconciles_total"):
        assert promised in names, promised
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_dashboard_queries_only_metrics_the_code_exposes(pipeline):
    from mammoth_operator import metrics as operator_metrics

    operator_metrics.timed("reconcile")  # the operator's handlers register their label sets
    exposed = {n for n in exposed_names(generate_latest(REGISTRY).decode())
               if n.startswith("mammoth_operator_")}
    for component in ("gateway", "ar", "dit"):
        exposed |= exposed_names(httpx.get(pipeline.metrics_url(component), timeout=10).text)
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    queried = {m for expr in dashboard_queries(dashboard) for m in _METRIC.findall(expr)}
    assert queried - exposed == set()
    assert "mammoth_dit_slots_in_use" in exposed and "made_up_total" not in exposed  # sanity


def test_dashboard_config_map_is_found_by_grafanas_sidecar(rendered_default, helm):
    [config_map] = [d for d in by_kind(rendered_default, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["mammoth-pipeline.json"]) == json.loads(DASHBOARD_FILE.read_text())
    moved = render(helm, values=[chart_tools.CI_VALUES_DIR / "monitoring-values.yaml"])
    [config_map] = [d for d in by_kind(moved, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Mammoth"}
    off = render(helm, set_values=["monitoring.dashboard.enabled=false"])
    assert not [d for d in by_kind(off, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]


def _operator_container(docs):
    [deployment] = by_kind(docs, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_operator_metrics_port_is_wired_to_the_flag_the_port_and_the_service(rendered_default, helm):
    container = _operator_container(rendered_default)
    [flag] = [a for a in container["args"] if a.startswith("--metrics-port=")]
    [port] = [p for p in container["ports"] if p["name"] == "metrics"]
    assert int(flag.split("=", 1)[1]) == port["containerPort"]
    [service] = by_kind(rendered_default, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    [deployment] = by_kind(rendered_default, "Deployment")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert by_kind(rendered_default, "ServiceMonitor") == by_kind(rendered_default, "PodMonitor") == []
    off = render(helm, set_values=["metricsPort=0", "monitoring.serviceMonitor.enabled=true"])
    container = _operator_container(off)
    assert not any(a.startswith("--metrics-port") for a in container["args"])
    assert not any(p["name"] == "metrics" for p in container["ports"])
    assert by_kind(off, "Service") == [] and by_kind(off, "ServiceMonitor") == []
    assert len(by_kind(off, "PodMonitor")) == 1


def test_service_monitor_and_pod_monitor_render_when_enabled(helm):
    from mammoth_operator.builders import labels

    docs = render(helm, values=[chart_tools.CI_VALUES_DIR / "monitoring-values.yaml"])
    [monitor] = by_kind(docs, "ServiceMonitor")
    [service] = by_kind(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [service["spec"]["ports"][0]["name"]]
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
    [pods] = by_kind(docs, "PodMonitor")
    # the labels the operator puts on every pipeline pod, whatever its component
    for component in ("ar", "dit", "gateway"):
        assert pods["spec"]["selector"]["matchLabels"].items() <= labels("any", component).items()
    assert pods["spec"]["namespaceSelector"] == {"any": True}
    assert {e["port"] for e in pods["spec"]["podMetricsEndpoints"]} == {"metrics", "http"}
    scoped = render(helm, values=[chart_tools.CI_VALUES_DIR / "monitoring-values.yaml",
                                  chart_tools.CI_VALUES_DIR / "namespaced-values.yaml"])
    [pods] = by_kind(scoped, "PodMonitor")
    assert pods["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_monitor_schema_rejects_a_misspelt_field(helm):
    """The strict check `test_chart_manifests.validate_monitor` applies to monitors can fail."""
    import jsonschema
    from test_chart_manifests import validate_monitor

    docs = render(helm, values=[chart_tools.CI_VALUES_DIR / "monitoring-values.yaml"])
    [monitor] = by_kind(docs, "ServiceMonitor")
    validate_monitor(monitor)
    monitor["spec"]["endpoints"][0]["intervall"] = "5s"
    with pytest.raises(jsonschema.ValidationError):
        validate_monitor(monitor)
