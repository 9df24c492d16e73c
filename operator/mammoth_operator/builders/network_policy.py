"""The NetworkPolicy ``N-stages``: ingress of the pipeline's AR, DiT and gateway pods (on by default)."""

from __future__ import annotations

from typing import Any

from mammoth_operator.builders.common import APP_NAME, GATEWAY_PORT, STAGE_PORTS, Child, child_names, labels, selector_labels
from mammoth_operator.spec import PipelineSpec

def build_network_policy(spec: PipelineSpec) -> Child:
    """Ingress of the pipeline's pods: the gateway reaches the AR and DiT gRPC ports, AR pods reach the DiT
    gRPC port, the ``networkPolicy.monitoring`` peer (if any) reaches the metrics ports, anyone reaches
    the gateway's HTTP port (the endpoint; its ``/metrics`` too); nothing else.

    One policy serves both stages because their ports differ (AR 50051/9091, DiT 50052/9092): the
    rule "AR pods -> 50052" can only ever admit traffic to DiT pods. Which RPC a caller may use is
    not a network property; the per-role stage tokens enforce it (`mammoth_core.grpc_common`).
    """
    base = {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": spec.name}
    (ar_grpc, ar_metrics), (dit_grpc, dit_metrics) = STAGE_PORTS["ar"], STAGE_PORTS["dit"]
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": selector_labels(spec.name, "gateway")}}],
         "ports": [{"protocol": "TCP", "port": ar_grpc}, {"protocol": "TCP", "port": dit_grpc}]},
        {"from": [{"podSelector": {"matchLabels": selector_labels(spec.name, "ar")}}],
         "ports": [{"protocol": "TCP", "port": dit_grpc}]},
        {"ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]},
    ]
    if spec.monitoring_peer is not None:
        ingress.append({"from": [dict(spec.monitoring_peer)],
                        "ports": [{"protocol": "TCP", "port": ar_metrics}, {"protocol": "TCP", "port": dit_metrics}]})
    return Child({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": child_names(spec.name).network_policy, "labels": labels(spec.name, "network-policy")},
        "spec": {
            "podSelector": {
                "matchLabels": base,
                "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                      "values": ["ar", "dit", "gateway"]}],
            },
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    })


