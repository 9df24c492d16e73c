"""The operator's reconcile metrics: counted and timed per handler run, by result, served over HTTP."""

from __future__ import annotations

import httpx
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from emulator_harness import PIPELINES, condition, example_pipeline, wait_for


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_reconciles_are_counted_and_timed_by_result(api, running_operator, emulator):
    before = {r: sample("mammoth_operator_reconciles_total", handler="reconcile", result=r)
              for r in ("success", "invalid")}
    status_before = sample("mammoth_operator_reconciles_total", handler="observe_child", result="success")

    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    wait_for(lambda: (api.pipeline("tiny") or {}).get("status", {}).get("observedGeneration") == 1,
             what="tiny applied")
    wait_for(lambda: sample("mammoth_operator_reconciles_total", handler="reconcile", result="success")
             == before["success"] + 1, what="one successful reconcile counted")

    emulator.admission = False  # let an invalid spec through, as an older CRD would
    bad = example_pipeline(transport={"chunkRows": 4096, "maxMessageBytes": 1048576})
    bad["metadata"]["name"] = "broken"
    assert api.create(PIPELINES, bad).status_code in (200, 201)
    wait_for(lambda: (condition(api.pipeline("broken"), "Degraded") or {}).get("reason") == "InvalidSpec",
             what="broken is Degraded")
    wait_for(lambda: sample("mammoth_operator_reconciles_total", handler="reconcile", result="invalid")
             == before["invalid"] + 1, what="the invalid spec counted")
    wait_for(lambda: sample("mammoth_operator_reconciles_total", handler="observe_child", result="success")
             > status_before, what="child observations counted")

    for handler in ("reconcile", "observe_child"):
        for result in ("success", "invalid", "retry", "error"):
            count = sample("mammoth_operator_reconcile_duration_seconds_count", handler=handler, result=result)
            assert count == sample("mammoth_operator_reconciles_total", handler=handler, result=result)
    assert sample("mammoth_operator_reconcile_duration_seconds_sum", handler="reconcile", result="success") > 0


def test_metrics_endpoint_serves_the_operator_metrics():
    from mammoth_operator.metrics import start_metrics_server, timed

    timed("reconcile")  # declares the series
    port = start_metrics_server(0, "127.0.0.1")
    assert port > 0
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"mammoth_operator_reconciles", "mammoth_operator_reconcile_duration_seconds"} <= names
    assert start_metrics_server(-1) == -1
