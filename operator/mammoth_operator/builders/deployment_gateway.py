"""The gateway Deployment ``N-gateway``."""

from __future__ import annotations

from typing import Any

from mammoth_operator.builders.common import (CONFIG_PATH, GATEWAY_PORT, PRESTOP_SLEEP_SECONDS, Child, backend_address,
                                              child_names)
from mammoth_operator.builders.pods import (container_env, container_resources, container_security, deployment,
                                            pod_spec, pod_volumes)
from mammoth_operator.spec import Gateway, PipelineSpec

def build_gateway_deployment(spec: PipelineSpec, stage_tokens: str | None = None) -> Child:
    """The gateway Deployment (``/readyz`` is ready only once it reaches >= 1 AR and >= 1 DiT)."""
    gw: Gateway = spec.gateway
    placement = gw.placement
    volumes, mounts = pod_volumes(spec, "gateway")
    container: dict[str, Any] = {
        "name": "gateway",
        "image": placement.image,
        "imagePullPolicy": placement.image_pull_policy,
        "command": ["mammoth"],
        "args": ["gateway", "--config", CONFIG_PATH,
                 "--ar", backend_address(spec, "ar"), "--dit", backend_address(spec, "dit"), *placement.args],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "env": container_env(placement),
        "startupProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 2, "failureThreshold": 60},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 6},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }
    container["resources"] = container_resources(placement, 0, "gateway")
    pod = pod_spec(spec, "gateway", placement, container, [], volumes)
    manifest = deployment(spec, "gateway", child_names(spec.name).gateway, gw.replicas, gw.rollout,
                           placement, pod, progress_deadline=600, stage_tokens=stage_tokens)
    return Child(manifest)


