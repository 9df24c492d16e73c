#!/usr/bin/env bash
# The test command (README, CI): set up .venv with test extras, fetch helm/kubectl, run pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`. The default run leaves
# out the tests marked `slow` (pyproject.toml addopts); `bash scripts/test.sh -m slow` runs only
# those, `-m "slow or not slow"` everything (docs/TESTING.md). No test collected is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
bash scripts/fetch_kube_tools.sh >/dev/null
bash scripts/fetch_actionlint.sh >/dev/null
export PATH="$PWD/.cache/kube-tools/bin:$PATH"
set +e
# Two pytest-xdist workers, each test file on one of them (its module fixtures start once): about
# half the wall time of one process on the 2-core CI host (docs/TESTING.md). `-n 0` given as an
# argument runs everything in this one process.
.venv/bin/python -m pytest -n 2 --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
