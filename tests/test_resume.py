"""Nothing lost across a trainer crash: run a oneStepOff job through `kubedistill run`, SIGKILL the
trainer process right after a checkpoint, run the job again, and check from the per-step history
that training resumed at the checkpoint (step, weight version) and that no prompt was skipped or
trained twice beyond the groups still generating or buffered when the job ended."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from e2e_jobs import job_yaml, kubedistill_run, run_env
from kubedistill.runtime.driver.staleness import StalenessPolicy

STEPS, EVERY, N = 10, 3, 2


def _trainer_pid(config: Path) -> int | None:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "role" in args and "trainer" in args and str(config) in args:
            return int(d.name)
    return None


def test_sigkill_after_checkpoint_then_resume(tiny_models, tmp_path: Path) -> None:
    job = job_yaml(tmp_path, tiny_models, name="e2e-resume", mode="oneStepOff", steps=STEPS, every=EVERY, n=N)
    workdir = tmp_path / "run"
    ckpt = tmp_path / "ckpt" / f"step-{EVERY:08d}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubedistill.cli", "run", str(job), "--workdir", str(workdir), "--no-progress"],
        cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 240
    killed = False
    while time.monotonic() < deadline and proc.poll() is None:
        if (ckpt / "meta.json").is_file():
            pid = _trainer_pid(workdir / "config.json")
            assert pid is not None, "trainer process not found"
            os.kill(pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=120)
    assert killed, f"no checkpoint at step {EVERY} before the job ended:\n{out[-3000:]}"
    assert proc.returncode != 0, out[-3000:]
    first = [json.loads(line) for line in (workdir / "history.jsonl").read_text().splitlines() if line.strip()]
    shutil.copy(workdir / "history.jsonl", tmp_path / "history-1.jsonl")
    assert [h["step"] for h in first][:EVERY] == list(range(1, EVERY + 1))
    meta = json.loads((ckpt / "meta.json").read_text())

    code, report, out = kubedistill_run(job, workdir)
    assert code == 0, out[-3000:]
    second = report["history"]
    # resumed at the checkpoint: its step and weight version
    assert [h["step"] for h in second] == list(range(EVERY + 1, STEPS + 1))
    assert second[0]["trainerVersion"] == meta["weight_version"] == first[EVERY - 1]["weightVersion"]

    trained = [g for h in first[:EVERY] for g in h["groups"]] + [g for h in second for g in h["groups"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(trained) == STEPS * 4 // N
    # uids are handed out in order: any gap is a group still generating/buffered at the end
    from kubedistill.api.validate import load_job

    policy = StalenessPolicy.from_spec(load_job(job).spec)
    missing = set(range(max(trained) + 1)) - set(trained)
    assert len(missing) <= policy.max_required // N, f"prompts skipped: {sorted(missing)}"
