"""End to end through `kubedistill run` (real role processes; multirank through Ray): one small
job per mode on the hf engine, one fullyAsync + partialRollout job on a vLLM-CPU rollout
server (its teacher on hf: one vLLM start less; vLLM teachers run end to end in
tests/test_e2e_vl.py), and one fullyAsync job of multi-turn traces against an OpenEnv environment
server (a process of its own, from OpenEnv's venv). The jobs run concurrently (one fixture) to keep the wall time down;
each test then checks one job's report, history and exported student."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from typing import Any

import pytest
import torch

from e2e_jobs import job_yaml, kubedistill_run, write_prompts
from kubedistill.runtime.driver.staleness import StalenessPolicy
from openenv_server import openenv_python

# An environment on OpenEnv's own API: each turn is answered with "=<turn number>" (characters the
# tiny models' tokenizer has), the third ends the episode with reward 1.
COUNTER_ENV = """
from openenv.core.env_server import Action, Environment, Observation, State, create_app


class Turn(Action):
    message: str


class Count(Observation):
    text: str = ""


class Counter(Environment[Turn, Count, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id, step_count=0)
        return Count(text="")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        done = self._state.step_count >= 3
        return Count(text=f"={self._state.step_count}", done=done, reward=1.0 if done else 0.0)

    @property
    def state(self):
        return self._state


app = create_app(Counter, Turn, Count, env_name="counter", max_concurrent_envs=64)
"""


def agentic(base) -> dict[str, Any]:
    """The multi-turn job's environment (the counter, run by `kubedistill run` from OpenEnv's venv)
    and held-out evaluation (traces too)."""
    env_dir = base / "env"
    env_dir.mkdir(parents=True, exist_ok=True)
    (env_dir / "counter.py").write_text(COUNTER_ENV)
    python = str(openenv_python("openenv==0.10.0"))
    return {
        "environments": [
            {
                "name": "counter",
                "command": [python, "-m", "uvicorn", "counter:app", "--host", "127.0.0.1", "--port", "$(PORT)"],
                "observationKey": "text",
                "timeoutSeconds": 120,
                "overrides": {"env": [{"name": "PYTHONPATH", "value": str(env_dir)}]},
            }
        ],
        "rollout": {"multiTurn": {"maxTurns": 4, "maxTraceTokens": 24}},
        "data": {"val": [str(write_prompts(base / "data" / "val.jsonl", count=8, seed=1))]},
        "evaluation": {"everySteps": 3, "prompts": 4, "maxTokens": 4},
    }


FULLY_ASYNC = {"stalenessThreshold": 0.5, "triggerParameterSyncStep": 2, "partialRollout": True}
# Shaped so a generation is running at every sync, whatever the machine's speed: the rollout
# engine takes one sequence at a time (maxNumSeqs 1), so generation is the bottleneck and always
# busy (greedy responses of the random student rarely end before maxTokens), and weights sync after
# every step, so each sync aborts a running generation that resumes from its prefix under the new
# weights.
RESUMING = {
    "stalenessThreshold": 1.0,
    "triggerParameterSyncStep": 1,
    "partialRollout": True,
    "partialRolloutStrategy": "resume",
}
JOBS: dict[str, dict[str, Any]] = {
    "sync": dict(mode="sync", steps=3),
    # k1 + policy gradient on one-step-stale samples: the off-policy statistics in the history.
    "onestepoff": dict(mode="oneStepOff", steps=4, loss="k1", policy_gradient=True),
    # reverseKLTopK: the rollout's top-k ids ride along each sample, across resumes, and the
    # teacher scores them (an hf teacher behind a vLLM rollout server below; a vLLM teacher's
    # gather: tests/test_servers_vllm.py).
    "fullyasync": dict(
        mode="fullyAsync",
        steps=4,
        max_tokens=64,
        max_model_len=128,
        temperature=0.0,
        asyncspec=RESUMING,
        max_num_seqs=1,
        loss="reverseKLTopK",
        delta="auto",  # delta syncs, off by default, end to end: a keep, then deltas (or full)
    ),
    "vllm": dict(
        mode="fullyAsync",
        steps=4,
        engine="vllm",
        teacher_engine="hf",
        max_tokens=6,
        asyncspec=FULLY_ASYNC,
        loss="reverseKLTopK",
    ),
    # trainer.replicas 2: two gloo CPU ranks (FSDP), rank 0 drives, syncs and checkpoints
    "multirank": dict(mode="sync", steps=2, every=2, trainer_replicas=2),
    # multi-turn traces: turns of 4 tokens, each answered by the environment (extra: agentic())
    "agentic": dict(
        mode="fullyAsync",
        steps=3,
        max_tokens=4,
        asyncspec={"stalenessThreshold": 1.0, "partialRollout": True},
        loss="forwardKLTopK",
    ),
}
# One job through a local Ray (`--launcher ray`, what `--address` uses on a cluster); the others
# as plain child processes, the default on one machine.
LAUNCHER = {"multirank": "ray"}


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict[str, dict[str, Any]]:
    base = tmp_path_factory.mktemp("e2e")

    def one(name: str) -> dict[str, Any]:
        d = base / name
        extra = agentic(d) if name == "agentic" else None
        job = job_yaml(d, tiny_models, name=f"e2e-{name}", extra=extra, **JOBS[name])
        code, report, out = kubedistill_run(job, d / "run", timeout=420, launcher=LAUNCHER.get(name, "processes"))
        return {"code": code, "report": report, "out": out, "dir": d, "job": job}

    # Started one after the other (the next once the previous has its processes up): on a busy
    # 2-core machine, five jobs importing torch at the same instant slow each other's start. The
    # Ray job first: Ray gives its raylet a fixed 30 s to register, which a loaded machine missed.
    with cf.ThreadPoolExecutor(len(JOBS)) as pool:
        futures = {}
        for name in ("multirank", "vllm", "agentic", "sync", "onestepoff", "fullyasync"):
            futures[name] = pool.submit(one, name)
            logs = base / name / "run" / "logs"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not futures[name].done() and not any(logs.glob("*.log")):
                time.sleep(0.5)
        return {name: f.result() for name, f in futures.items()}


def _check_common(r: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    assert r["code"] == 0, r["out"][-3000:]
    assert r["report"]["result"] == "succeeded"
    hist = r["report"]["history"]
    assert [h["step"] for h in hist] == list(range(1, steps + 1))
    for h in hist:
        for key in (
            "time",
            "weightVersion",
            "samplesPerSecond",
            "klStudentTeacher",
            "stalenessMean",
            "trainerIdleRatio",
            "lossTotal",
            "lossDistill",
            "groups",
        ):
            assert h[key] is not None, key
        assert 0.0 <= h["trainerIdleRatio"] <= 1.0
    assert len({h["runId"] for h in hist}) == 1  # one driver process wrote every line
    assert r["report"]["status"]["step"] == steps  # the final status: the last history line
    ckpt = r["dir"] / "ckpt"
    assert (ckpt / f"step-{steps:08d}" / "meta.json").is_file()
    # every group is trained once
    groups = [g for h in hist for g in h["groups"]]
    assert len(groups) == len(set(groups))
    return hist


def _exported_differs(r: dict[str, Any], tiny_models) -> None:
    from transformers import AutoModelForCausalLM

    out = AutoModelForCausalLM.from_pretrained(str(r["dir"] / "ckpt" / "student-hf"))
    init = AutoModelForCausalLM.from_pretrained(str(tiny_models["student"]))
    a, b = dict(out.named_parameters()), dict(init.named_parameters())
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a), "the exported student equals its initial weights"


def test_sync_mode(runs, tiny_models) -> None:
    hist = _check_common(runs["sync"], 3)
    # generate -> train -> sync: each batch is generated by the weights of the previous step,
    # so the rollout server served every new version as soon as it was synced.
    for h in hist:
        assert h["stalenessMax"] == 0
        assert h["trainerVersion"] == h["step"] - 1
        assert h["rolloutVersions"] == ([h["step"]] if h["step"] < 3 else None)
    assert hist[-1]["weightVersion"] == 2
    _exported_differs(runs["sync"], tiny_models)


def test_one_step_off_mode(runs) -> None:
    hist = _check_common(runs["onestepoff"], 4)
    assert [h["trainerVersion"] for h in hist] == [0, 1, 2, 3]
    assert all(h["stalenessMax"] <= 1 for h in hist)
    assert hist[0]["stalenessMax"] == 0
    # batch k+1 was generated while batch k trained, under the older weights
    assert any(h["stalenessMax"] == 1 for h in hist[1:])
    # The off-policy statistics of the k1 + policy-gradient loss: at step 1 every sample is at
    # lag 0, where the trainer's log-probs equal the hf engine's; later the lag histogram shows
    # the stale ones and their importance weights.
    assert hist[0]["lagHistogram"] == {"0": 4}
    first = hist[0]["offPolicy"]
    assert first["logprobDiffLag0AbsMax"] < 1e-4 and first["isWeightMean"] == pytest.approx(1.0, abs=1e-4)
    assert abs(first["advantageMean"]) < 1e-4  # the batch-mean baseline centres the advantages
    stale = [h for h in hist[1:] if "1" in h["lagHistogram"]]
    assert stale and all(0.0 < h["offPolicy"]["isWeightMean"] <= 2.0 for h in stale)


def _spec(r):
    from kubedistill.api.validate import load_job

    return load_job(r["job"]).spec


def test_fully_async_mode_resumes_partial_rollouts(runs) -> None:
    r = runs["fullyasync"]
    hist = _check_common(r, 4)
    policy = StalenessPolicy.from_spec(_spec(r))
    assert all(h["stalenessMax"] <= policy.max_lag for h in hist)
    # triggerParameterSyncStep 1: a sync after every step but the last
    assert [h["synced"] for h in hist] == [True, True, True, False]
    assert [h["rolloutVersions"] for h in hist] == [[1], [2], [3], None]
    assert hist[-1]["weightVersion"] == 3
    # Generations in flight at a sync were aborted and resumed (samples_total{state="resumed"}),
    # and resumed samples were trained with tokens from more than one weight version.
    assert hist[-1]["samplesTotal"]["resumed"] > 0, hist[-1]["samplesTotal"]
    ranges = [rng for h in hist for rng in h["resumedVersionRanges"]]
    assert sum(h["resumedSamples"] for h in hist) >= len(ranges) > 0
    assert any(hi > lo for lo, hi in ranges), ranges
    assert all(hi - lo <= policy.max_lag for lo, hi in ranges)
    _check_sync_record(hist, delta=True)


def _check_sync_record(hist: list[dict[str, Any]], delta: bool) -> None:
    """Each synced step's line says how its sync travelled and what it sent: with weightSync.delta
    auto the first sync is a full one that starts the delta chain (keep); by default (never)
    every sync is a plain full one."""
    syncs = [h for h in hist if h["synced"]]
    first = "keep" if delta else "full"
    assert syncs and syncs[0]["syncPlan"] == first and syncs[0]["syncDensity"] == 1.0, syncs[0]
    plans = ("keep", "delta", "full") if delta else ("full",)
    assert all(h["syncPlan"] in plans for h in syncs), [h["syncPlan"] for h in syncs]
    assert all(h["syncBytes"] > 0 and 0.0 < h["syncDensity"] <= 1.0 for h in syncs)
    assert not any("syncPlan" in h for h in hist if not h["synced"])


def test_fully_async_partial_rollout_on_vllm(runs, tiny_models) -> None:
    r = runs["vllm"]
    hist = _check_common(r, 4)
    policy = StalenessPolicy.from_spec(_spec(r))
    assert all(h["stalenessMax"] <= policy.max_lag for h in hist)
    assert hist[-1]["weightVersion"] == 1
    assert hist[1]["rolloutVersions"] == [1]
    assert hist[-1]["trainerVersion"] == 1
    _check_time_budget(hist)
    _check_sync_record(hist, delta=False)
    _exported_differs(r, tiny_models)


def _check_time_budget(hist: list[dict[str, Any]]) -> None:
    """The real trainer, sender and vLLM servers fill each step's phases, and they add up to the
    step's wall time (docs/design.md#step-time-budget)."""
    previous = 0.0
    for h in hist:
        phases = h["phases"]
        assert all(v >= 0 for v in phases.values()), phases
        assert sum(phases.values()) == pytest.approx(h["time"] - previous, rel=0.05, abs=0.005), phases
        previous = h["time"]
        assert phases["train_compute"] > 0
        synced = [phases[p] for p in ("sync_pause", "sync_transfer", "sync_load", "sync_resume")]
        assert all(v > 0 for v in synced) if h["synced"] else not any(synced), phases


def test_two_trainer_ranks(runs, tiny_models) -> None:
    r = runs["multirank"]
    hist = _check_common(r, 2)
    assert r["report"]["launcher"] == "ray" and runs["sync"]["report"]["launcher"] == "processes"
    assert [h["synced"] for h in hist] == [True, False]
    assert hist[0]["rolloutVersions"] == [1]  # rank 0 broadcast the gathered full weights
    assert (r["dir"] / "run" / "logs" / "trainer-1.log").is_file()
    step = r["dir"] / "ckpt" / "step-00000002"
    meta = json.loads((step / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["weight_version"] == 1
    # The checkpoint holds full (unsharded) state: a single-rank trainer resumes from it, with the
    # weights the two ranks exported.
    from transformers import AutoModelForCausalLM

    from kubedistill.runtime.trainer import Trainer

    spec = _spec(r)
    spec.trainer.replicas = 1
    trainer = Trainer(spec)
    resumed = trainer.resume()
    assert resumed is not None and (resumed.step, resumed.weight_version) == (2, 1)
    exported = dict(AutoModelForCausalLM.from_pretrained(str(r["dir"] / "ckpt" / "student-hf")).named_parameters())
    loaded = {n: t.detach().clone() for n, t in trainer.named_full_weights()}
    assert loaded.keys() <= exported.keys()
    for name, t in loaded.items():
        assert torch.equal(t.cpu(), exported[name].detach()), name
    _exported_differs(r, tiny_models)


def test_fully_async_multi_turn_traces_against_an_environment(runs) -> None:
    r = runs["agentic"]
    hist = _check_common(r, 3)
    # Every trace ran its three turns (the environment ends the episode at the third step) with
    # the environment's two observations in between, which carry no loss; its reward is the
    # environment's.
    for h in hist:
        assert h["turnsMean"] == 3 and h["envErrors"] == 0, h
        assert 0.0 < h["lossTokenShare"] < 1.0
        assert h["rewardMean"] == 1.0
    assert (r["dir"] / "run" / "logs" / "env-counter-0.log").is_file(), sorted(
        p.name for p in (r["dir"] / "run" / "logs").iterdir()
    )
    # Held-out evaluation ran traces too (its score is the environment's reward), and counted the
    # student's own tokens only: at most 3 turns of 4.
    evaluation = r["report"]["status"]["evaluation"]
    assert evaluation["step"] == 3 and evaluation["sources"]["arith"]["score"] == 1.0
    assert 3 <= evaluation["sources"]["arith"]["responseLength"] <= 12
