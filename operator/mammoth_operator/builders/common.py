"""What every child shares: names, labels, ports, paths inside the pods, and the drain grace.

The one home of the ``app.kubernetes.io/*`` labels (:func:`labels`, :func:`selector_labels`) and of
the children's deterministic names (:func:`child_names`). Owner references are not built here:
``kopf.adopt`` adds them (with the namespace) before the API call, and
:func:`mammoth_operator.kube.controlled_by` is the one check that an object is ours.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mammoth_operator.spec import PipelineSpec

GROUP = "mammoth.dev"
APP_NAME = "mammoth-pipeline"
MANAGED_BY = "mammoth-operator"

CONFIG_DIR = "/etc/mammoth"
CONFIG_KEY = "pipeline.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
CACHE_DIR = "/var/cache/mammoth"
MODELS_DIR = "/models"
AUTH_DIR = "/etc/mammoth/auth"
ROLE_TOKENS_DIR = "/etc/mammoth/role-tokens"
#: Per-role token files each component mounts: it presents its own role's token; a stage also
#: holds the tokens of the roles it accepts (the AR accepts the gateway; the DiT the gateway and AR).
ROLE_TOKENS_MOUNTED = {"gateway": ("gateway",), "ar": ("gateway", "ar"), "dit": ("gateway", "ar")}
API_KEYS_DIR = "/etc/mammoth/api-keys"

#: gRPC and metrics ports of each stage, and the gRPC health service name its readiness probe asks for.
STAGE_PORTS = {"ar": (50051, 9091), "dit": (50052, 9092)}
HEALTH_SERVICES = {"ar": "mammoth.v1.AR", "dit": "mammoth.v1.DiT"}
GATEWAY_PORT = 8000

#: preStop sleep: endpoints controllers and gRPC resolvers drop the pod before it stops accepting work.
PRESTOP_SLEEP_SECONDS = 5
#: Extra grace on top of the drain (process exit, flushing logs).
TERMINATION_SLACK_SECONDS = 15
#: Longest ``terminationGracePeriodSeconds``: the cluster autoscaler's default
#: ``--max-graceful-termination-sec`` (600 s); a longer grace is cut short by a scale-down anyway.
MAX_TERMINATION_GRACE_SECONDS = 600


@dataclasses.dataclass(frozen=True)
class Child:
    """One desired child object.

    ``create_only`` lists field paths written when the object is created but never patched
    afterwards (``spec.replicas`` of a Deployment whose HorizontalPodAutoscaler owns it).
    """

    manifest: dict[str, Any]
    create_only: tuple[tuple[str, ...], ...] = ()

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclasses.dataclass(frozen=True)
class ChildRef:
    """A child identified by apiVersion, kind and name (for deletions of optional children)."""

    api_version: str
    kind: str
    name: str


@dataclasses.dataclass(frozen=True)
class ChildNames:
    """The names of a pipeline's children; ``ar``/``dit``/``gateway`` name each component's
    Deployment, Service, PodDisruptionBudget and HorizontalPodAutoscaler alike."""

    config: str
    ar: str
    dit: str
    gateway: str
    network_policy: str
    stage_tokens: str

    def component(self, component: str) -> str:
        """The name of ``component``'s children (``ar``, ``dit`` or ``gateway``)."""
        return {"ar": self.ar, "dit": self.dit, "gateway": self.gateway}[component]


def child_names(name: str) -> ChildNames:
    """Deterministic child names of the pipeline ``name`` (at most 47 characters, so all stay DNS labels)."""
    return ChildNames(f"{name}-config", f"{name}-ar", f"{name}-dit", f"{name}-gateway", f"{name}-stages",
                      f"{name}-stage-tokens")


def selector_labels(name: str, component: str) -> dict[str, str]:
    """Labels that select one component's pods (Service, PDB, Deployment selectors); immutable over time."""
    return {
        "app.kubernetes.io/name": APP_NAME,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
    }


def labels(name: str, component: str) -> dict[str, str]:
    """The standard ``app.kubernetes.io/*`` set every child and pod carries."""
    return {
        **selector_labels(name, component),
        "app.kubernetes.io/part-of": APP_NAME,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def drain_grace_seconds(spec: PipelineSpec) -> int:
    """Drain grace of every pod: the longest request (``requestDefaults.requestTimeoutSeconds``), cut so
    the whole termination grace fits :data:`MAX_TERMINATION_GRACE_SECONDS` (580 s at most)."""
    longest = MAX_TERMINATION_GRACE_SECONDS - PRESTOP_SLEEP_SECONDS - TERMINATION_SLACK_SECONDS
    return min(spec.request_defaults.request_timeout_seconds, longest)


def termination_grace_seconds(spec: PipelineSpec) -> int:
    """``terminationGracePeriodSeconds``: preStop sleep + drain + slack, at most
    :data:`MAX_TERMINATION_GRACE_SECONDS`."""
    return PRESTOP_SLEEP_SECONDS + drain_grace_seconds(spec) + TERMINATION_SLACK_SECONDS


def backend_address(spec: PipelineSpec, component: str) -> str:
    """The gateway's gRPC target for a stage: DNS of its headless Service (client-side balancing)."""
    service = child_names(spec.name).component(component)
    return f"dns:///{service}.{spec.namespace}.svc:{STAGE_PORTS[component][0]}"


def canonical_json(obj: Any) -> str:
    """Stable JSON (sorted keys, no spaces): used for hashes and the last-applied annotation."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
