"""The MammothPipeline Kubernetes operator (kopf + the official kubernetes client).

Public entry point: :func:`run` (the ``mammoth operator`` command calls it). Modules:
:mod:`~mammoth_operator.spec` (typed spec, defaults, validation), :mod:`~mammoth_operator.builders`
(spec -> child manifests, pure), :mod:`~mammoth_operator.kube` (create-or-patch),
:mod:`~mammoth_operator.status` (conditions), :mod:`~mammoth_operator.handlers` (kopf),
:mod:`~mammoth_operator.config` (operator settings), :mod:`~mammoth_operator.crd` (the CRD file).
"""

from __future__ import annotations

import dataclasses
import logging

__all__ = ["run"]

logger = logging.getLogger(__name__)


def run(namespaces: list[str] | None, all_namespaces: bool, liveness: str | None, metrics_port: int = -1) -> None:
    """Run the operator until SIGTERM/SIGINT.

    Args:
        namespaces: namespaces (or kopf patterns such as ``team-*``) to serve; ignored when
            ``all_namespaces``. Neither given means all namespaces.
        all_namespaces: serve the whole cluster.
        liveness: kopf liveness endpoint URL, e.g. ``http://0.0.0.0:8080/healthz``; None disables it.
        metrics_port: Prometheus ``/metrics`` port (reconcile counts and durations,
            :mod:`~mammoth_operator.metrics`); -1 disables it.

    Settings come from ``MAMMOTH_OPERATOR_*`` environment variables (:mod:`mammoth_operator.config`);
    credentials from the pod's service account, else the kubeconfig.

    Raises:
        ValueError: a ``MAMMOTH_OPERATOR_*`` variable has an invalid value.
    """
    import kopf

    from mammoth_operator.config import OperatorConfig
    from mammoth_operator.handlers import register
    from mammoth_operator.metrics import start_metrics_server

    clusterwide = all_namespaces or not namespaces
    patterns = any(c in ns for ns in namespaces or [] for c in "*?[!")
    config = dataclasses.replace(OperatorConfig.from_env(), scan_cluster=clusterwide or patterns)
    start_metrics_server(metrics_port)
    registry = register(kopf.OperatorRegistry(), config)
    if not all_namespaces and not namespaces:
        logger.info("No namespace given: serving all namespaces.")
    kopf.configure(verbose=False)
    kopf.run(
        registry=registry,
        standalone=True,
        clusterwide=clusterwide,
        namespaces=[] if clusterwide else list(namespaces or []),
        liveness_endpoint=liveness,
    )
