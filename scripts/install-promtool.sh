#!/usr/bin/env bash
# Make `promtool` available (the chart's tests parse every PromQL query and alert rule with it).
# Debian's `prometheus` package ships it. Idempotent: nothing happens when promtool is on PATH.
set -euo pipefail
command -v promtool >/dev/null 2>&1 && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-promtool: promtool not found and no apt-get; install Prometheus' promtool by hand" >&2
  exit 1
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
# --no-install-recommends: only promtool is needed, not the exporters and the web UI assets.
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package starts a Prometheus service where an init system runs; tests start their own.
command -v promtool >/dev/null
