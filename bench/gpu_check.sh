#!/usr/bin/env bash
# The GPU check (docs/gpu.md): kubedistill's GPU paths on ONE borrowed GPU in under 8 minutes,
# with neither vLLM nor Ray (bench/gpu_check.py says what each part checks).
#
#   bash bench/gpu_check.sh [--out FILE] [--parts text,lora,vl] [--workdir DIR] [--wheels DIR] [--dry-run]
#
# Run from anywhere; the checkout is put on PYTHONPATH when kubedistill is not installed.
# --wheels DIR: install DIR/*.whl into a private folder first (a machine without pydantic, FastAPI
# or uvicorn, where nothing can be downloaded: carry them as wheels). --dry-run: tiny shapes on the
# CPU (what CI runs). Exit code 0 = every part passed; the JSON report goes to --out.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
WHEELS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) args+=("$1"); shift ;;
    esac
done
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ -n "$WHEELS" ]; then
    site="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# This checkout, installed or not (kubedistill/__init__.py adds its operator/ and runtime/ to the
# package), also for the parts' processes, which start from bench/.
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py ${args[@]+"${args[@]}"}
