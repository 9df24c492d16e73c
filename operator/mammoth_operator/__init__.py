"""The MammothPipeline Kubernetes operator (kopf + the official kubernetes client).

Public entry point: :func:`run` (the ``mammoth operator`` command calls it). Modules:
:mod:`~mammoth_operator.spec` (typed spec, defaults, validation), :mod:`~mammoth_operator.builders`
(spec -> child manifests, pure), :mod:`~mammoth_operator.kube` (create-or-patch),
:mod:`~mammoth_operator.status` (conditions), :mod:`~mammoth_operator.handlers` (kopf),
:mod:`~mammoth_operator.config` (operator settings), :mod:`~mammoth_operator.crd` (the CRD file).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import urllib.parse

__all__ = ["liveness_endpoint", "run"]

logger = logging.getLogger(__name__)


#: Hosts of a liveness URL that mean "every interface" (of one family, as kopf binds one host).
_WILDCARDS = {"0.0.0.0": 4, "::": 6}


def liveness_endpoint(url: str | None, pod_ip: str | None) -> str | None:
    """The liveness URL kopf binds: ``url`` with a wildcard host (``0.0.0.0`` or ``[::]``) turned to
    the wildcard of ``pod_ip``'s family (the chart sets ``POD_IP`` from ``status.podIP``, the address
    the kubelet probes). kopf listens on one host, and ``0.0.0.0`` takes IPv4 only: on an IPv6 cluster
    every probe failed and the kubelet restarted a healthy operator. Any other URL, no ``pod_ip``, or one
    that is not an IP address, returns ``url`` as given.
    """
    if not url or not pod_ip:
        return url
    parts = urllib.parse.urlsplit(url)
    try:
        family = ipaddress.ip_address(pod_ip.strip()).version
    except ValueError:
        return url
    if parts.hostname not in _WILDCARDS or _WILDCARDS[parts.hostname] == family:
        return url
    host = "[::]" if family == 6 else "0.0.0.0"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def run(namespaces: list[str] | None, all_namespaces: bool, liveness: str | None, metrics_port: int = -1) -> None:
    """Run the operator until SIGTERM/SIGINT.

    Args:
        namespaces: namespaces (or kopf patterns such as ``team-*``) to serve; ignored when
            ``all_namespaces``. Neither given means all namespaces.
        all_namespaces: serve the whole cluster.
        liveness: kopf liveness endpoint URL, e.g. ``http://0.0.0.0:8080/healthz``; None disables it.
            A wildcard host takes the family of ``$POD_IP`` (`liveness_endpoint`).
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
        liveness_endpoint=liveness_endpoint(liveness, os.environ.get("POD_IP")),
    )
