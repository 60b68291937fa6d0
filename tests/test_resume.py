"""Nothing lost across a trainer crash: run a oneStepOff job through `kubedistill run`, SIGKILL the
trainer process right after a checkpoint; the launcher restarts the trainer gang (as the operator
does) while the rollout and teacher servers keep running. Check from the per-step history that
training resumed at the checkpoint (step, weight version), that the new trainer re-formed the
weight-sync group with the same rollout server (new epoch) and its syncs reached it, and that no
prompt was skipped or trained twice beyond the groups still generating or buffered at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from e2e_jobs import job_yaml, run_env
from kubedistill.runtime.driver.staleness import StalenessPolicy

STEPS, EVERY, N = 10, 3, 2


def _trainer_pid(config: Path) -> int | None:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().replace(b"\0", b" ").split()  # as ps: a forked role's is one string
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "role" in args and "trainer" in args and str(config) in args:
            return int(d.name)
    return None


def _get(url: str) -> dict:
    try:
        return httpx.get(url, timeout=5).json()
    except httpx.HTTPError:
        return {}


def test_sigkill_after_checkpoint_then_gang_restart_resumes(tiny_models, tmp_path: Path) -> None:
    job = job_yaml(tmp_path, tiny_models, name="e2e-resume", mode="oneStepOff", steps=STEPS, every=EVERY, n=N)
    _kill_trainer_after_checkpoint_and_check_resume(job, tmp_path)


def test_lora_student_fully_async_on_vllm_resumes_after_sigkill(tiny_models, tmp_path: Path) -> None:
    """The same on a vLLM-CPU rollout server with a LoRA student in fullyAsync with partial
    rollouts: only the adapters are checkpointed and synced (merged into the rollout engine's base
    on receipt). The teacher, which sees no weights, is on the hf engine (one vLLM start less)."""
    job = job_yaml(
        tmp_path,
        tiny_models,
        name="e2e-lora-resume",
        mode="fullyAsync",
        engine="vllm",
        teacher_engine="hf",
        steps=STEPS,
        every=EVERY,
        n=N,
        lr=1e-2,
        asyncspec={"partialRollout": True},
        lora={"rank": 8, "alpha": 16},
    )
    report = _kill_trainer_after_checkpoint_and_check_resume(job, tmp_path)
    import torch

    state = torch.load(tmp_path / "ckpt" / f"step-{STEPS:08d}" / "trainer.pt", weights_only=False)
    assert state["model"] and all(".lora_" in k for k in state["model"]), "checkpoint holds more than adapters"
    # Tokens sampled by the version the trainer holds: the rollout engine's merged weights give
    # the trainer's (PEFT, unmerged) log-probs.
    lag0 = [h["offPolicy"] for h in report["history"] if h["offPolicy"].get("lag0Tokens")]
    assert lag0 and max(o["logprobDiffLag0AbsMax"] for o in lag0) < 1e-4, lag0
    _export_generates_in_vllm(tmp_path / "ckpt" / "student-hf")


VLLM_GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=2, seed=0)
params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}], params)[0].outputs[0]
lps = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
print(json.dumps({"ids": list(out.token_ids), "logprobs": lps}))
"""


def _export_generates_in_vllm(export: Path) -> None:
    """The LoRA job's export (merged: a plain HF model) loads and generates in vLLM, with the
    log-probs transformers gives the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    assert not any("lora" in f.name for f in export.iterdir())  # merged, not an adapter folder
    prompt = [1, 5, 6, 7, 8]
    r = subprocess.run(
        [sys.executable, "-c", VLLM_GENERATE, str(export), json.dumps(prompt)],
        env={**run_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    ids = torch.tensor([prompt + got["ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    want = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(got["ids"])]
    assert len(got["ids"]) == 6 and max(abs(a - b) for a, b in zip(got["logprobs"], want)) < 1e-4, (got, want)


def _kill_trainer_after_checkpoint_and_check_resume(job: Path, tmp_path: Path) -> dict:
    workdir = tmp_path / "run"
    report_path = workdir / "report.json"
    ckpt = tmp_path / "ckpt" / f"step-{EVERY:08d}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kubedistill.cli",
            "run",
            str(job),
            "--workdir",
            str(workdir),
            "--no-progress",
            "--report",
            str(report_path),
        ],
        cwd=tmp_path,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    killed_pid, trainer_pid, looked, epochs, meta = None, None, 0.0, [], {}
    while time.monotonic() < deadline and proc.poll() is None:
        if trainer_pid is None and time.monotonic() - looked > 0.2:
            # Found while it trains, so that the kill follows the checkpoint at once: a tiny
            # job's steps take milliseconds, and a search of /proc then may let it checkpoint again.
            looked, trainer_pid = time.monotonic(), _trainer_pid(workdir / "config.json")
        if killed_pid is None and (ckpt / "meta.json").is_file():
            assert trainer_pid is not None, "trainer process not found"
            os.kill(trainer_pid, signal.SIGKILL)
            killed_pid = trainer_pid
            meta = json.loads((ckpt / "meta.json").read_text())  # later checkpoints retire it
            rollout = json.loads((workdir / "config.json").read_text())["endpoints"]["rollout"][0]
            epochs.append(_get(rollout + "/weights/group").get("epoch"))  # the new gang's group comes later
        elif killed_pid is not None:
            group = _get(rollout + "/weights/group")
            if group.get("state") == "ready" and group.get("epoch") not in epochs:
                epochs.append(group["epoch"])
                break
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=240)
    assert killed_pid is not None, f"no checkpoint at step {EVERY} before the job ended:\n{out[-3000:]}"
    assert proc.returncode == 0, out[-3000:]
    report = json.loads(report_path.read_text())
    assert report["result"] == "succeeded"
    # one gang restart, caused by the killed trainer; the same rollout server joined a new group
    assert [(r["process"], r["exitCode"]) for r in report["restarts"]] == [("trainer-0", -signal.SIGKILL)]
    assert len(epochs) == 2 and None not in epochs and epochs[0] != epochs[1], epochs
    cut = report["restarts"][0]["historyLines"]
    first, second = report["history"][:cut], report["history"][cut:]
    assert [h["step"] for h in first][:EVERY] == list(range(1, EVERY + 1))
    # resumed at the checkpoint: its step and weight version
    assert [h["step"] for h in second] == list(range(EVERY + 1, STEPS + 1))
    assert second[0]["trainerVersion"] == meta["weight_version"] == first[EVERY - 1]["weightVersion"]
    # the restarted trainer's syncs reached the rollout server that kept running
    for h in second[:-1]:
        assert h["synced"] and h["rolloutVersions"] == [h["weightVersion"]], h

    trained = [g for h in first[:EVERY] for g in h["groups"]] + [g for h in second for g in h["groups"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(trained) == STEPS * 4 // N
    # uids are handed out in order: any gap is a group still generating/buffered at the end
    from kubedistill.api.validate import load_job

    policy = StalenessPolicy.from_spec(load_job(job).spec)
    missing = set(range(max(trained) + 1)) - set(trained)
    assert len(missing) <= policy.max_required // N, f"prompts skipped: {sorted(missing)}"
    return report
