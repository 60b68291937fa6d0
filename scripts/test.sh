#!/usr/bin/env bash
# The README's test command: install, then run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/pytest -q "$@"
