"""The AR and DiT Deployments ``N-ar`` and ``N-dit``: one builder, since the two differ only by their
:class:`~mammoth_operator.spec.Stage` (ports, health service, capacity, GPUs, autoscaling)."""

from __future__ import annotations

import math
from typing import Any

from mammoth_operator.builders.common import (CONFIG_PATH, HEALTH_SERVICES, PRESTOP_SLEEP_SECONDS, STAGE_PORTS, Child,
                                              child_names)
from mammoth_operator.builders.pods import (STARTUP_PROBE_PERIOD_SECONDS, checkpoint_path, container_env,
                                            container_resources, container_security, deployment,
                                            download_init_container, pod_spec, pod_volumes)
from mammoth_operator.spec import PipelineSpec, Stage

def build_stage_deployment(spec: PipelineSpec, stage: Stage, stage_tokens: str | None = None) -> Child:
    """The AR or DiT Deployment.

    Probes: a gRPC startup probe on the stage's health service tolerates ``startupTimeoutSeconds``
    of model loading; the gRPC readiness probe passes only while the stage is SERVING; liveness is a
    TCP check, so a draining stage (NOT_SERVING, port still open) is not killed mid-drain.
    With autoscaling on, ``spec.replicas`` is create-only: the HPA owns it afterwards.
    ``stage_tokens`` is :func:`tokens_hash` of the generated token Secret (None: a user's Secret).
    """
    component = stage.component
    grpc_port, metrics_port = STAGE_PORTS[component]
    volumes, mounts = pod_volumes(spec, component)
    placement = stage.placement
    container: dict[str, Any] = {
        "name": component,
        "image": placement.image,
        "imagePullPolicy": placement.image_pull_policy,
        "command": ["mammoth"],
        "args": [component, "--config", CONFIG_PATH, "--checkpoint", checkpoint_path(spec), *placement.args],
        "ports": [
            {"name": "grpc", "containerPort": grpc_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"},
        ],
        "env": container_env(placement),
        "startupProbe": {
            "grpc": {"port": grpc_port, "service": HEALTH_SERVICES[component]},
            "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(stage.startup_timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS),
        },
        "readinessProbe": {
            "grpc": {"port": grpc_port, "service": HEALTH_SERVICES[component]},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "tcpSocket": {"port": "grpc"},
            "periodSeconds": 20,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }
    container["resources"] = container_resources(placement, stage.gpus, component, stage.ranks)
    init = [download_init_container(spec, stage)] if spec.model.source.scheme == "hf" else []
    pod = pod_spec(spec, component, placement, container, init, volumes)
    name = child_names(spec.name).component(component)
    autoscaled = stage.autoscaling.enabled
    replicas = stage.autoscaling.min_replicas if autoscaled else stage.replicas
    manifest = deployment(spec, component, name, replicas, stage.rollout, placement, pod,
                           progress_deadline=stage.startup_timeout_seconds + 600, stage_tokens=stage_tokens)
    return Child(manifest, create_only=(("spec", "replicas"),) if autoscaled else ())


