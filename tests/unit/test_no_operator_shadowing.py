"""The kopf package must never shadow the standard library's ``operator`` module (DESIGN.md)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_stdlib_operator_importable_from_repository_root():
    # -S: site start-up would import the real `operator` before the root is searched, hiding the bug.
    result = subprocess.run([sys.executable, "-S", "-c", "import operator; operator.itemgetter"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_no_operator_package_marker():
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert (ROOT / "operator" / "mammoth_operator" / "__init__.py").exists()
