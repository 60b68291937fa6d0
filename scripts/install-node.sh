#!/usr/bin/env bash
# What the real-node test tier (tests/real_node.py) runs beside the kubelet of ../shared/k8s:
# containerd and runc (the container runtime), the CNI plugins (pod network), dnsmasq (cluster
# DNS), iptables (the `kubernetes` Service's DNAT) and iproute2, all Debian packages (the images
# those pods run come from scripts/build-images.sh, which installs its own tools). Idempotent: nothing is installed when every program is there. Needs root (or sudo)
# and apt-get; elsewhere it says what is missing and exits 1.
set -euo pipefail
need=()
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
have containerd || need+=(containerd)
have runc || need+=(runc)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
have dnsmasq || need+=(dnsmasq-base)
have iptables || need+=(iptables)
have ip || need+=(iproute2)
[ ${#need[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-node: missing ${need[*]} and no apt-get: install them by hand" >&2
  exit 1
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The package's service is not started where no init system runs; the tests start their own.
have containerd && have runc && have dnsmasq
