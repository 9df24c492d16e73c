#!/usr/bin/env bash
# Create ./.venv and install Mammoth Pipeline into it (idempotent).
#   bash scripts/setup.sh          # runtime: extra `all` (both stages, gateway, operator, tracing)
#   bash scripts/setup.sh test     # extra `test`: `all` + test tools (pytest, openai client, KMock, linters)
# torch is pinned exactly (torch==2.13.0): a looser spec would pull a multi-GB CUDA build.
#
# One pip run installs everything; it is skipped when .venv already holds this pyproject.toml's
# install with these extras (the stamp .venv/.mammoth-setup: the editable install follows code
# edits by itself). Delete the stamp to force a reinstall. Files are not byte-compiled at install
# (--no-compile: most of pip's CPU time for ~15,000 files); Python compiles what it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="all"
[ "${1:-}" = "test" ] && extras="test"
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.mammoth-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $extras"
if [ -f "$stamp" ] && { [ "$(cat "$stamp")" = "$want" ] || { [ "$extras" = "all" ] \
    && [ "$(cat "$stamp")" = "${want% *} test" ]; }; }; then
  echo "setup: .venv ready (extras: $extras; already installed)"
  exit 0
fi
rm -f "$stamp"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q --no-compile -e ".[$extras]"
echo "$want" > "$stamp"
echo "setup: .venv ready (extras: $extras)"
