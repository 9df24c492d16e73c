"""The operator's package stays light: importing it (as the operator image does) loads no torch."""

from __future__ import annotations

import subprocess
import sys


def test_operator_imports_no_torch():
    code = ("import sys, mammoth_operator.handlers, mammoth_operator.builders, mammoth_operator.reconcile; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc', 'safetensors')); "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
