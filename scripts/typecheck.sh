#!/usr/bin/env bash
# mypy over the tree as it installs: pyproject's package-dir maps operator/ and runtime/ to
# kubedistill.operator and kubedistill.runtime, which mypy cannot do, so it checks a view with
# those folders linked under kubedistill/ (kept in .venv so mypy's cache stays warm). Extra args
# go to mypy.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
view="$root/.venv/typecheck-view"
mkdir -p "$view/kubedistill"
for f in "$root"/kubedistill/*; do ln -sfn "$f" "$view/kubedistill/$(basename "$f")"; done
ln -sfn "$root/operator" "$view/kubedistill/operator"
ln -sfn "$root/runtime" "$view/kubedistill/runtime"
cd "$view"
exec "$python" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.venv/mypy-cache" -p kubedistill "$@"
