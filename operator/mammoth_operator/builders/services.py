"""The Services: a headless one per stage (``N-ar``, ``N-dit``: DNS returns every ready pod and the
gateway balances gRPC client-side) and the gateway's ``N-gateway``, the pipeline's endpoint."""

from __future__ import annotations

from typing import Any

from mammoth_operator.builders.common import STAGE_PORTS, Child, child_names, labels, selector_labels
from mammoth_operator.spec import PipelineSpec, Stage

def build_stage_service(spec: PipelineSpec, stage: Stage) -> Child:
    """Headless Service of a stage: DNS returns every ready pod, the gateway balances client-side."""
    component = stage.component
    grpc_port, metrics_port = STAGE_PORTS[component]
    name = child_names(spec.name).component(component)
    return Child({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(spec.name, component)},
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(spec.name, component),
            "ports": [
                {"name": "grpc", "port": grpc_port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
                {"name": "metrics", "port": metrics_port, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    })


def build_gateway_service(spec: PipelineSpec) -> Child:
    """The pipeline's endpoint: port ``spec.gateway.service.port`` -> the gateway's HTTP port, with
    client-IP session affinity (``url`` responses are served by the replica that holds the image)."""
    gw = spec.gateway
    metadata: dict[str, Any] = {"name": child_names(spec.name).gateway, "labels": labels(spec.name, "gateway")}
    if gw.service_annotations:
        metadata["annotations"] = dict(gw.service_annotations)
    return Child({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": gw.service_type,
            # `url` images live in the memory of the gateway replica that made them: client-IP
            # affinity sends the follow-up GET to that replica (docs/API.md).
            "sessionAffinity": "ClientIP",
            "selector": selector_labels(spec.name, "gateway"),
            "ports": [{"name": "http", "port": gw.service_port, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}],
        },
    })


