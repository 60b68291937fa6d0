#!/usr/bin/env bash
# The README's test command: install, then run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Two workers: on 2 cores most tests wait on processes they started (servers, trainers, the API
# server) part of the time; tests/conftest.py keeps each module, and the modules sharing a costly
# session fixture, on one worker. KUBEDISTILL_TEST_WORKERS=0 runs them in this process.
exec .venv/bin/pytest -q -n "${KUBEDISTILL_TEST_WORKERS:-2}" "$@"
