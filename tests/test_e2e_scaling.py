"""A running `kubedistill run` job scales its rollout servers 1 -> 2 -> 1 by an edit of its job
file (what `kubectl scale` is to the operator): the new server joins the weight-sync group at a
sync and takes requests; the removed one is drained (its requests in flight aborted and resumed
on the other server) before its process is stopped; the trainer never restarts, and no sample is
lost or trained twice."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from e2e_jobs import job_yaml, run_env
from kubedistill.runtime.driver.history import read_history

STEPS = 160  # room for the scale events: the second server had joined and left by step 106 on 2 loaded cores
MINI_BATCH = 4
# Generation is the bottleneck (one sequence at a time per engine, greedy answers that run to
# maxTokens), so every sync and every drain meets requests in flight, and a second server helps.
ASYNC = {"stalenessThreshold": 1.0, "triggerParameterSyncStep": 1, "partialRollout": True}


def _set_replicas(job: Path, n: int) -> None:
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["rollout"]["replicas"] = n
    job.write_text(yaml.safe_dump(doc, sort_keys=False))


def _wait(what: str, proc: subprocess.Popen[str], cond: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, f"the job ended while waiting for {what}"
        time.sleep(0.25)
    raise AssertionError(f"no {what} within {timeout:.0f} s")


def test_rollout_servers_scale_up_and_down_in_a_running_job(tiny_models, tmp_path: Path) -> None:
    job = job_yaml(
        tmp_path,
        tiny_models,
        name="scaling",
        mode="fullyAsync",
        steps=STEPS,
        mini_batch=MINI_BATCH,
        max_tokens=24,
        max_model_len=64,
        temperature=0.0,
        asyncspec=ASYNC,
        max_num_seqs=1,
        every=1000,
    )
    run, report = tmp_path / "run", tmp_path / "report.json"
    argv = [sys.executable, "-m", "kubedistill.cli", "run", str(job), "--workdir", str(run), "--report", str(report)]
    proc = subprocess.Popen(
        [*argv, "--no-progress"],
        cwd=tmp_path,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    history = run / "history.jsonl"
    try:
        _wait("step 3", proc, lambda: len(read_history(history)) >= 3, 240)
        first = json.loads((run / "config.json").read_text())["endpoints"]["rollout"]
        assert len(first) == 1
        _set_replicas(job, 2)
        second = _wait(
            "a second rollout server in the config",
            proc,
            lambda: [
                u for u in json.loads((run / "config.json").read_text())["endpoints"]["rollout"] if u not in first
            ],
            30,
        )[0]

        def served_by_second() -> dict[str, Any] | None:
            hist = read_history(history)
            return next((h for h in hist if h.get("rolloutRequests", {}).get(second, 0) >= 4), None)

        joined = _wait("requests answered by the second server", proc, served_by_second, 180)
        assert joined["rolloutServers"] == [*first, second]
        _set_replicas(job, 1)
        # The trainer lets it go once drained; `kubedistill run` stops its process then.
        left = _wait(
            "the second server to leave the trainer's servers",
            proc,
            lambda: next(
                (h for h in read_history(history) if h["step"] > joined["step"] and h["rolloutServers"] == first), None
            ),
            120,
        )
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    rep = json.loads(report.read_text())
    hist = rep["history"]

    # One trainer process throughout: steps 1..STEPS once, every group trained once.
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
    assert len({h["runId"] for h in hist}) == 1 and rep["restarts"] == []
    groups = [g for h in hist for g in h["groups"]]
    assert len(groups) == len(set(groups))
    assert hist[-1]["samplesTotal"]["consumed"] == STEPS * MINI_BATCH

    # The launcher's side: 1 -> 2, 2 -> 1, and rollout-1 stopped only after the trainer drained it.
    assert [e["replicas"] for e in rep["rolloutScaling"] if "replicas" in e] == [[1, 2], [2, 1]]
    assert [(e["stopped"], e["drained"]) for e in rep["rolloutScaling"] if "stopped" in e] == [("rollout-1", True)]

    # The second server answered requests while it was in, and none after it left.
    counts = [h["rolloutRequests"].get(second, 0) for h in hist]
    at_leave = left["rolloutRequests"].get(second, 0)
    assert at_leave >= 4 and counts[-1] == at_leave
    assert all(h["rolloutServers"] == first for h in hist if h["step"] >= left["step"])
    log = (run / "logs" / "trainer-0.log").read_text()
    assert f"rollout server {second} drained" in log, log[-3000:]
    assert "joined at weight version" in log
