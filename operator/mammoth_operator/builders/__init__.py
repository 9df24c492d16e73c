"""Pure functions: a parsed :class:`~mammoth_operator.spec.PipelineSpec` -> the manifests of its children.

Nothing here talks to a cluster; the reconcile passes the result through ``kopf.adopt`` (namespace,
owner reference) and :mod:`mammoth_operator.kube` (create or patch). One module per kind of child:

* ``secrets``: Secret ``N-stage-tokens`` (per-role stage tokens), unless ``roleTokensSecretRef``;
* ``config_map``: ConfigMap ``N-config`` (``pipeline.yaml``), always;
* ``deployment_stage``: Deployments ``N-ar`` and ``N-dit``, always;
* ``deployment_gateway``: Deployment ``N-gateway``, always;
* ``services``: Services ``N-ar``, ``N-dit`` (headless) and ``N-gateway``, always;
* ``disruption``: PodDisruptionBudgets ``N-ar``, ``N-dit``, ``N-gateway``, each unless disabled;
* ``autoscaling``: HorizontalPodAutoscalers ``N-ar``, ``N-dit``, when a stage enables autoscaling;
* ``network_policy``: NetworkPolicy ``N-stages`` (AR, DiT and gateway pods), unless
  ``spec.networkPolicy.enabled`` is false.

What they share (names, labels, ports, paths, the drain grace) lives in ``common``; the pod spec and
the Deployment frame in ``pods``. The ports, flags and settings keys are the ones the components
read (``mammoth_core.settings``; docs/OPERATOR.md, "Children"): AR gRPC 50051 / metrics 9091, DiT
gRPC 50052 / metrics 9092, gateway HTTP 8000; every container runs
``mammoth <component> --config /etc/mammoth/pipeline.yaml``.
"""

from __future__ import annotations

from collections.abc import Mapping

from mammoth_operator.builders.autoscaling import build_hpa, hpa_target
from mammoth_operator.builders.common import (APP_NAME, CACHE_DIR, CONFIG_PATH, GROUP, MANAGED_BY,
                                              MAX_TERMINATION_GRACE_SECONDS, ROLE_TOKENS_DIR, STAGE_PORTS, Child,
                                              ChildNames, ChildRef, backend_address, canonical_json, child_names,
                                              drain_grace_seconds, labels, selector_labels, termination_grace_seconds)
from mammoth_operator.builders.config_map import (CONFIG_HASH_ANNOTATION, build_config_map, component_settings,
                                                  config_hash, pipeline_config, render_config)
from mammoth_operator.builders.deployment_gateway import build_gateway_deployment
from mammoth_operator.builders.deployment_stage import build_stage_deployment
from mammoth_operator.builders.disruption import build_pdb
from mammoth_operator.builders.network_policy import build_network_policy
from mammoth_operator.builders.pods import checkpoint_path
from mammoth_operator.builders.secrets import TOKENS_HASH_ANNOTATION, build_stage_tokens_secret, tokens_hash
from mammoth_operator.builders.services import build_gateway_service, build_stage_service
from mammoth_operator.spec import ROLE_TOKEN_KEYS, PipelineSpec

__all__ = [
    "APP_NAME", "CACHE_DIR", "CONFIG_HASH_ANNOTATION", "CONFIG_PATH", "GROUP", "MANAGED_BY",
    "MAX_TERMINATION_GRACE_SECONDS", "ROLE_TOKENS_DIR", "STAGE_PORTS", "TOKENS_HASH_ANNOTATION", "Child",
    "ChildNames", "ChildRef", "backend_address", "build_children", "build_config_map", "build_gateway_deployment",
    "build_gateway_service", "build_hpa", "build_network_policy", "build_pdb", "build_stage_deployment",
    "build_stage_service", "build_stage_tokens_secret", "canonical_json", "checkpoint_path", "child_names",
    "component_settings", "config_hash", "drain_grace_seconds", "hpa_target", "labels", "pipeline_config",
    "render_config", "selector_labels", "termination_grace_seconds", "tokens_hash", "unwanted_children",
]


def build_children(spec: PipelineSpec, tokens: Mapping[str, str] | None = None) -> list[Child]:
    """The full desired set of children, in apply order (Secret, config and Services before the pods).

    ``tokens`` (role -> token) are the generated stage tokens: those of the existing Secret, or fresh
    ones for its creation (the reconcile always passes them when ``spec.transport.generated_role_tokens``;
    None leaves the Secret and the pods' token hash out, for callers that only inspect manifests).
    """
    names = child_names(spec.name)
    children: list[Child] = []
    stage_tokens = None
    if spec.transport.generated_role_tokens and tokens is not None:
        children.append(build_stage_tokens_secret(spec, tokens))
        stage_tokens = tokens_hash(tokens)
    children += [
        build_config_map(spec),
        build_stage_service(spec, spec.ar),
        build_stage_service(spec, spec.dit),
        build_gateway_service(spec),
        build_stage_deployment(spec, spec.ar, stage_tokens),
        build_stage_deployment(spec, spec.dit, stage_tokens),
        build_gateway_deployment(spec, stage_tokens),
    ]
    for component, disruption in (("ar", spec.ar.disruption), ("dit", spec.dit.disruption),
                                  ("gateway", spec.gateway.disruption)):
        if disruption.enabled:
            children.append(build_pdb(spec, component, names.component(component), disruption))
    children += [build_hpa(spec, stage) for stage in (spec.ar, spec.dit) if stage.autoscaling.enabled]
    if spec.network_policy:
        children.append(build_network_policy(spec))
    return children


def unwanted_children(spec: PipelineSpec) -> list[ChildRef]:
    """Optional children this spec does not want (disabled PDB/HPA/NetworkPolicy): to delete if present."""
    names = child_names(spec.name)
    wanted = {(c.kind, c.name) for c in build_children(spec, {role: "" for role in ROLE_TOKEN_KEYS})}
    optional = [ChildRef("policy/v1", "PodDisruptionBudget", names.component(c)) for c in ("ar", "dit", "gateway")]
    optional += [ChildRef("autoscaling/v2", "HorizontalPodAutoscaler", names.component(c)) for c in ("ar", "dit")]
    optional.append(ChildRef("networking.k8s.io/v1", "NetworkPolicy", names.network_policy))
    return [ref for ref in optional if (ref.kind, ref.name) not in wanted]
