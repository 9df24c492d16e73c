"""The committed gRPC stubs are exactly what `scripts/gen_proto.py` generates from `proto/`."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_committed_stubs_are_fresh():
    result = subprocess.run(
        [sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_top_level_operator_package_shadows_stdlib():
    result = subprocess.run(
        [sys.executable, "-S", "-c", "import operator; operator.itemgetter"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert not (ROOT / "operator" / "__init__.py").exists()
