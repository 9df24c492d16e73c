"""Access to the CRD file, the one source of truth of the ``MammothPipeline`` schema.

It lives in the Helm chart (``charts/mammoth-operator/crds/mammothpipelines.mammoth.dev.yaml``); tests
and docs read it from there. ``MAMMOTH_CRD_PATH`` points elsewhere (e.g. inside an image).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import yaml

CRD_FILENAME = "mammothpipelines.mammoth.dev.yaml"


def crd_path() -> pathlib.Path:
    """Path of the CRD file: ``$MAMMOTH_CRD_PATH`` or the chart's ``crds/`` in the source tree.

    Raises:
        FileNotFoundError: neither exists.
    """
    env = os.environ.get("MAMMOTH_CRD_PATH")
    candidates = [pathlib.Path(env)] if env else []
    candidates.append(pathlib.Path(__file__).resolve().parents[2] / "charts" / "mammoth-operator" / "crds" / CRD_FILENAME)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"CRD file not found (looked at {', '.join(map(str, candidates))}); set MAMMOTH_CRD_PATH")


def load_crd() -> dict[str, Any]:
    """The CustomResourceDefinition as a dict."""
    with crd_path().open() as f:
        return yaml.safe_load(f)


def openapi_schema(crd: dict[str, Any] | None = None, version: str = "v1alpha1") -> dict[str, Any]:
    """The ``openAPIV3Schema`` of one served version."""
    crd = crd or load_crd()
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"version {version} not in the CRD")
