#!/usr/bin/env bash
# Create ./.venv and install Mammoth Pipeline into it (idempotent).
#   bash scripts/setup.sh          # runtime: extra `all` (both stages, gateway, operator, tracing)
#   bash scripts/setup.sh test     # extra `test`: `all` + test tools (pytest, openai client, KMock, linters)
# torch is pinned exactly (torch==2.13.0): a looser spec would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="all"
[ "${1:-}" = "test" ] && extras="test"
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[$extras]"
echo "setup: .venv ready (extras: $extras)"
