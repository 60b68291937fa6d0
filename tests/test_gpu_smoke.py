"""bench/gpu_smoke.sh cannot run here (no GPU); what can: its syntax, its refusal of bad input,
and its --dry-run, which builds the tiny models and data and writes the job it would run on the
GPU, which must pass `kubedistill validate` and ask for exactly one GPU per role (the one-GPU
sharing of `kubedistill run` then fits them on one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kubedistill.api import DistillationJob
from kubedistill.runtime.entrypoints.local import fit_gpus, local_processes

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_smoke.sh"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_script_parses_and_refuses_bad_arguments() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    bad = _run("--backend", "mpi")
    assert bad.returncode == 2 and "--backend must be nccl or gloo, got mpi" in bad.stderr
    bad = _run("--steps", "x")
    assert bad.returncode == 2 and "--steps must be a positive integer" in bad.stderr


@pytest.mark.standalone
def test_dry_run_writes_a_valid_one_gpu_job(tmp_path: Path) -> None:
    """The workdir of `bash bench/gpu_smoke.sh --dry-run --steps 3` holds a job for one GPU."""
    r = _run("--dry-run", "--workdir", str(tmp_path), "--steps", "3")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "dry run done" in out and "preflight" not in out, out[-3000:]
    raw = yaml.safe_load((tmp_path / "job.yaml").read_text())
    job = DistillationJob.model_validate(raw)
    spec = job.spec
    assert spec.trainer.total_steps == 3 and spec.student.model == str(tmp_path / "student")
    assert (tmp_path / "student" / "config.json").is_file() and (tmp_path / "teacher" / "config.json").is_file()
    assert spec.data.train == [str(tmp_path / "data" / "train.jsonl")]
    assert spec.weight_sync.backend.value == "nccl" and spec.device.value == "cuda"
    config, procs = local_processes(job, tmp_path / "config.json")
    assert sorted(p.gpus for p in procs) == [1, 1, 1]
    shared = fit_gpus(config, procs, available=1)
    assert all(p.gpus == 0.33 for p in procs) and shared.spec.rollout.inference.gpu_memory_utilization == 0.3
