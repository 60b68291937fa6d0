#!/usr/bin/env bash
# The README's test command: install, then the test suite in named stages, in two lanes at once
# (the main lane's tests mostly wait on the role processes they start, so the other lane has a core):
#   main        pytest -m "not standalone": every other test, whole `kubedistill run` jobs last
#               (tests/conftest.py); its output on the terminal as it runs.
#   beside it, one stage after the other:
#   models      python tests/fixture_files.py smollm2 k1pg_models: SmolLM2 converted from GGUF,
#               the learning regression's models (.pytest_cache, kept for later runs), made before
#               main's tests ask for them;
#   standalone  pytest -m standalone, a second pytest process: slow checks that need nothing from
#               the session (mypy, the GPU check's and smoke's dry runs, the VL twin job);
#   images      python tests/fixture_files.py node_images: the CPU images the real node runs
#               (scripts/build-images.sh), which main asks for near its end; skipped where the
#               real-node tier will not run (no KUBEBUILDER_ASSETS, not root).
# Every stage's output is kept in build/test-logs/STAGE.log. At the end each stage says how it
# went (the failed tests by name, a fixture that could not be made with its log); the command
# fails if any stage failed. A test whose files a stage failed to make fails too, naming the
# stage's log; run alone (`pytest tests/test_models.py`) a test makes its files itself.
# With arguments: one pytest process with them, every test it selects (standalone ones too), e.g.
#   bash scripts/test.sh tests/test_api.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
bash scripts/install.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/pytest -q "$@"
fi

logs=build/test-logs
rm -rf "$logs"
mkdir -p "$logs"
# The run's id: fixture files a stage made (or failed to make) in this run are taken as they are.
KUBEDISTILL_TEST_RUN="$(date +%s)-$$"
export KUBEDISTILL_TEST_RUN

stage() { # stage NAME COMMAND...: COMMAND's output in $logs/NAME.log, "EXIT SECONDS" in $logs/NAME.status
  local name=$1 start=$SECONDS code=0
  shift
  "$@" >"$logs/$name.log" 2>&1 || code=$?
  echo "$code $((SECONDS - start))" >"$logs/$name.status"
}

echo "test.sh: stage main (below) and beside it models, standalone, images (logs in $logs/)"
set -m # the lane beside main runs in a process group of its own, stopped with this script
(
  stage models .venv/bin/python tests/fixture_files.py smollm2 k1pg_models
  stage standalone .venv/bin/pytest -q -p no:cacheprovider -m standalone
  stage images .venv/bin/python tests/fixture_files.py node_images
) &
beside=$!
set +m
trap 'kill -- -$beside 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM

start=$SECONDS main=0
.venv/bin/pytest -q -m "not standalone" 2>&1 | tee "$logs/main.log" || main=$?
echo "$main $((SECONDS - start))" >"$logs/main.status"
wait "$beside" || true
trap - EXIT INT TERM

failed=()
report() { # report NAME WHAT: the stage's result line, and what to read when it failed
  local name=$1 what=$2 code=1 seconds=?
  [ -f "$logs/$name.status" ] && read -r code seconds <"$logs/$name.status"
  local result=passed
  [ "$code" = 0 ] || { result="FAILED (exit $code)"; failed+=("$name"); }
  echo
  echo "== stage $name ($what): $result in ${seconds} s; log $logs/$name.log"
  case "$name" in
    models | images) cat "$logs/$name.log" 2>/dev/null ;;
    *)
      if [ "$code" = 0 ]; then
        tail -n 1 "$logs/$name.log"
      else # the failures (the standalone stage's are on no terminal yet), the failed tests by name
        [ "$name" = main ] || sed -n '/^=* \(FAILURES\|ERRORS\) =*$/,/short test summary info/{/short test summary info/!p}' "$logs/$name.log" | tail -n 300
        sed -n '/short test summary info/,$p' "$logs/$name.log" | grep -v '^SKIPPED' || tail -n 20 "$logs/$name.log"
      fi
      ;;
  esac
}
report models "fixture files, beside main"
report standalone "pytest -m standalone, beside main"
report images "fixture files, beside main"
report main 'pytest -m "not standalone"'
echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "test.sh: FAILED: ${failed[*]} (in $((SECONDS - t0)) s with the installation)"
  exit 1
fi
echo "test.sh: every stage passed (in $((SECONDS - t0)) s with the installation)"
