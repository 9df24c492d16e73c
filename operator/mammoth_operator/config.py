"""The operator's own settings, read once at its entry point (environment of the operator pod).

==================================  ===============================================  =====================
variable                            meaning                                          default
==================================  ===============================================  =====================
``MAMMOTH_OPERATOR_IMAGE_TAG``      tag of the default component images              the package version
``MAMMOTH_OPERATOR_IMAGE_REGISTRY`` registry/owner of the default images             ``ghcr.io/mammoth-pipeline``
``MAMMOTH_OPERATOR_AR_IMAGE``       full default AR image (overrides the two above)  ``<registry>/mammoth-ar:<tag>``
``MAMMOTH_OPERATOR_DIT_IMAGE``      full default DiT image                           ``<registry>/mammoth-dit:<tag>``
``MAMMOTH_OPERATOR_GATEWAY_IMAGE``  full default gateway image                       ``<registry>/mammoth-gateway:<tag>``
``MAMMOTH_OPERATOR_PROBE_STALE``    seconds without a successful reconcile or API    ``300``
                                    call before ``/healthz`` fails
==================================  ===============================================  =====================
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from importlib import metadata

GROUP = "mammoth.dev"
VERSION = "v1alpha1"
PLURAL = "mammothpipelines"
KIND = "MammothPipeline"


def _package_version() -> str:
    try:
        return metadata.version("mammoth-pipeline")
    except metadata.PackageNotFoundError:
        return "0.1.0"


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    """Settings of one operator process.

    ``images`` maps ``ar``/``dit``/``gateway`` to the image used when a pipeline leaves ``image`` empty.
    ``probe_stale_seconds``: the liveness probe fails when no reconcile or API call succeeded for
    that long (or one run takes that long). ``request_timeout`` bounds every API call (seconds).
    ``scan_cluster``: see the field.
    Watch timeouts are in seconds:
    the server closes a watch after ``watch_server_timeout`` and the client gives up after
    ``watch_client_timeout`` (then kopf re-lists), so a silently dropped connection heals.
    """

    images: Mapping[str, str]
    probe_stale_seconds: float = 300.0
    #: kopf's dynamic scanning of namespaces and CRDs (needs cluster-wide list/watch on both). Off for
    #: an operator serving named namespaces: it has no such permission, and kopf would retry the
    #: denied listings for about a minute before serving (handlers wait for the child indexes,
    #: whose watch streams start after that scan), then serve the named namespaces anyway.
    scan_cluster: bool = True
    watch_server_timeout: float = 300.0
    watch_client_timeout: float = 330.0
    watch_connect_timeout: float = 10.0
    request_timeout: float = 30.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        """Build from ``MAMMOTH_OPERATOR_*`` variables (see the module docstring).

        Raises:
            ValueError: ``MAMMOTH_OPERATOR_PROBE_STALE`` is not a positive number.
        """
        env = os.environ if environ is None else environ
        tag = env.get("MAMMOTH_OPERATOR_IMAGE_TAG") or _package_version()
        registry = (env.get("MAMMOTH_OPERATOR_IMAGE_REGISTRY") or "ghcr.io/mammoth-pipeline").rstrip("/")
        images = {
            component: env.get(f"MAMMOTH_OPERATOR_{component.upper()}_IMAGE") or f"{registry}/mammoth-{component}:{tag}"
            for component in ("ar", "dit", "gateway")
        }
        raw = env.get("MAMMOTH_OPERATOR_PROBE_STALE") or "300"
        try:
            stale = float(raw)
        except ValueError:
            raise ValueError(f"MAMMOTH_OPERATOR_PROBE_STALE must be a number of seconds, got {raw!r}") from None
        if stale <= 0:
            raise ValueError(f"MAMMOTH_OPERATOR_PROBE_STALE must be positive, got {raw!r}")
        return cls(images=images, probe_stale_seconds=stale)
