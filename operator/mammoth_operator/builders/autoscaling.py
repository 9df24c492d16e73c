"""The HorizontalPodAutoscalers ``N-ar`` and ``N-dit`` (autoscaling/v2, when a stage enables it)."""

from __future__ import annotations

import math

from mammoth_operator.builders.common import Child, child_names, labels, selector_labels
from mammoth_operator.spec import PipelineSpec, Stage

def hpa_target(stage: Stage) -> int | str:
    """Target average of the load metric per pod: the spec's, else 75 % of the stage's capacity (>= 1)."""
    if stage.autoscaling.target_average_value is not None:
        return stage.autoscaling.target_average_value
    return max(1, math.floor(0.75 * stage.capacity))


def build_hpa(spec: PipelineSpec, stage: Stage) -> Child:
    """HorizontalPodAutoscaler (autoscaling/v2) on the stage's own load metric.

    ``Pods`` metrics come from ``custom.metrics.k8s.io`` (e.g. prometheus-adapter exposing the stage's
    ``/metrics`` gauge per pod); ``External`` metrics from ``external.metrics.k8s.io``, selected by the
    pipeline's labels. Scale-down is slow (5 minutes stabilisation, one pod per 2 minutes): a GPU pod
    takes minutes to load the model again.
    """
    component = stage.component
    name = child_names(spec.name).component(component)
    target = {"type": "AverageValue", "averageValue": str(hpa_target(stage))}
    a = stage.autoscaling
    if a.metric_type == "Pods":
        metric = {"type": "Pods", "pods": {"metric": {"name": a.metric_name}, "target": target}}
    else:
        metric = {"type": "External", "external": {
            "metric": {"name": a.metric_name, "selector": {"matchLabels": selector_labels(spec.name, component)}},
            "target": target,
        }}
    return Child({
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": labels(spec.name, component)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [metric],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
                "scaleDown": {"stabilizationWindowSeconds": 300, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]},
            },
        },
    })


