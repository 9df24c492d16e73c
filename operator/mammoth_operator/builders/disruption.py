"""The PodDisruptionBudgets ``N-ar``, ``N-dit``, ``N-gateway`` (each unless disabled in the spec)."""

from __future__ import annotations

from mammoth_operator.builders.common import Child, labels, selector_labels
from mammoth_operator.spec import Disruption, PipelineSpec

def build_pdb(spec: PipelineSpec, component: str, name: str, disruption: Disruption) -> Child:
    """The PodDisruptionBudget of one component (``maxUnavailable`` from the spec)."""
    return Child({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": labels(spec.name, component)},
        "spec": {
            "maxUnavailable": disruption.max_unavailable,
            "selector": {"matchLabels": selector_labels(spec.name, component)},
        },
    })


