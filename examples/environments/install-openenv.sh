#!/usr/bin/env bash
# Venvs of their own for OpenEnv environment servers, beside the project's: .venv/openenv-core-0.3.0
# (PyPI `openenv-core`) and .venv/openenv-0.10.0 (PyPI `openenv`, the same project's newer name;
# both install the `openenv` module, so they cannot share a venv). The tests start
# examples/environments/calculator and OpenEnv's own echo template from them.
# Not in .venv itself: openenv pulls gradio, which pins pillow<13 and would downgrade the
# runtime's pillow, plus ~30 packages (fastmcp, pandas, ...) the runtime never imports; an
# environment server is its own image anyway. Idempotent and fast when both are there.
set -euo pipefail
cd "$(dirname "$0")/../.."
uv=.venv/bin/uv
[ -x "$uv" ] || { echo "install-openenv: $uv is missing: run scripts/install.sh first" >&2; exit 1; }
python=${PYTHON:-python3}
export UV_SYSTEM_CERTS=1
for spec in openenv-core==0.3.0 openenv==0.10.0; do
  venv=".venv/${spec/==/-}"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/installed" 2>/dev/null)" = "$spec" ]; then continue; fi
  "$uv" venv -q --allow-existing -p "$python" "$venv"
  "$uv" pip install -q -p "$venv/bin/python" "$spec"
  echo "$spec" > "$venv/installed"
done
