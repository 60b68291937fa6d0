"""The tool-use task of the learning benchmark (`bench/learning.py --task tools`): on-policy
distillation with multi-turn traces against the calculator environment, against single-turn OPD
on the same problems, through the real runtime (`kubedistill run`: rollout, teacher, trainer and,
for the multi-turn runs, the environment server as separate local processes).

* task and models (bench/tools_task.py, cached under .kubedistill/bench/tools): `347*28=`,
  three-digit times two-digit products; a teacher trained only on full tool traces (call the
  calculator, read its result, give it as the answer); a student warm-started on mostly direct
  answers, which it cannot compute, and a small share of tool traces: the format, not the habit;
* multi-turn runs: spec.environments = examples/environments/calculator served by OpenEnv
  (openenv-core 0.3, examples/environments/install-openenv.sh), spec.rollout.multiTurn (3 turns,
  64 trace tokens); each sample is a trace, the teacher scores the whole trace, the loss is on
  the student's turns only;
* single-turn runs: the same job without environments: a call gets no result, the response ends
  at the student's <eos>;
* both: the quickstart's recipe (fullyAsync, forwardKLTopK, top-16, 64 samples per step, lr 1e-3,
  no importance weights), the same steps and rollout seeds;
* measured by the job itself (spec.evaluation): greedy held-out accuracy, the final turn's exact
  match (traces in the multi-turn runs, one response in the single-turn ones), before step 1 and
  every --every steps; after the run, the final student's share of traces that call the tool
  (in process, bench/tools_task.py).

The last line is the multi-turn runs' held-out accuracy gain from the warm start (mean over
--seeds) and its lead over single-turn OPD at the same steps.

    .venv/bin/python bench/learning.py --task tools            # 3 seeds x (multi-turn, single-turn)
    .venv/bin/python bench/learning.py --task tools --quick    # fewer steps and problems

Run it from the repository root: a process started in bench/ imports bench/operator.py as the
standard library's `operator` (the environment server, and the roles `kubedistill run` forks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import tools_task
from _common import API_VERSION, REPO, JobFailed, fmt, mean, run_manifest, table

from kubedistill.demo.quickstart import held_out_scores

VARIANTS = ("multi-turn", "single-turn")
LOSS, TOP_K = "forwardKLTopK", 16
DEFAULTS = {"steps": (40, 20), "every": (10, 5), "problems": (300, 200), "seeds": 3, "lr": 1.0e-3}
"""Tool-task defaults (full, quick) for the options left at bench/learning.py's arithmetic defaults."""
CACHE, WORKDIR = REPO / ".kubedistill/bench/tools", REPO / ".kubedistill/bench/learning-tools"
GAIN_POINTS = 20.0
"""The issue's criterion: the multi-turn runs gain at least this many points and beat single-turn."""
MAX_SESSIONS = 1024
"""The calculator server's max_concurrent_envs (CALC_MAX_SESSIONS)."""
ASYNC = {
    "stalenessThreshold": 1.0,
    "triggerParameterSyncStep": 1,
    "partialRollout": True,
    "partialRolloutStrategy": "inflight",
}


def tools_manifest(
    name: str, variant: str, cache: Path, ckpt: Path, *, steps: int, every: int, problems: int, lr: float, seed: int
) -> dict[str, Any]:
    """One run's DistillationJob: the quickstart's CPU recipe on the tool task, with the calculator
    environment and multiTurn for the multi-turn variant."""
    inference = {"engine": "hf", "maxModelLen": 96, "dtype": "float32"}
    rollout: dict[str, Any] = {
        "replicas": 1,
        "inference": dict(inference),
        "sampling": {"samplesPerPrompt": 1, "temperature": 1.0, "maxTokens": tools_task.TURN_TOKENS, "seed": seed},
        "overrides": {"cpuThreads": 1},
    }
    spec: dict[str, Any] = {
        "mode": "fullyAsync",
        "device": "cpu",
        "student": {"model": str(cache / "student")},
        "teachers": [
            {
                "name": "calc",
                "model": str(cache / "teacher"),
                "inference": dict(inference),
                "overrides": {"cpuThreads": 1},
            }
        ],
        "rollout": rollout,
        "trainer": {
            "replicas": 1,
            "miniBatchSize": 64,
            "totalSteps": steps,
            "mixedPrecision": "float32",
            "optim": {"lr": lr, "warmupSteps": 5, "schedule": "cosine", "gradClip": 1.0},
            "overrides": {"cpuThreads": 1},
        },
        "algorithm": {
            "distillation": {"lossMode": LOSS, "topK": TOP_K},
            "offPolicy": {"importance": {"mode": "none"}},
        },
        "async": dict(ASYNC),
        "data": {
            "train": [str(cache / "data/train.jsonl")],
            "val": [str(cache / "data/val.jsonl")],
            "maxPromptLength": 16,
            "seed": 0,
        },
        "evaluation": {"everySteps": every, "prompts": problems, "maxTokens": tools_task.TURN_TOKENS},
        "checkpoint": {"path": str(ckpt), "everySteps": steps, "keep": 1, "resume": "never"},
        "weightSync": {"bucketMB": 16},
    }
    if variant == "multi-turn":
        spec["environments"] = [
            {
                "name": "calc",
                # The server as a script: its folder, not the working directory, heads sys.path
                # (`-m uvicorn` run from bench/ would import bench/operator.py as `operator`).
                "command": [
                    str(tools_task.OPENENV_PYTHON),
                    str(tools_task.CALC_SERVER / "server.py"),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "$(PORT)",
                ],
                "timeoutSeconds": 30,
                # Sessions the server holds at once (its default 256): the held-out evaluation's
                # traces all open at once beside training's; one over the limit is refused.
                "overrides": {"env": [{"name": "CALC_MAX_SESSIONS", "value": str(MAX_SESSIONS)}]},
            }
        ]
        rollout["multiTurn"] = {"maxTurns": tools_task.MAX_TURNS, "maxTraceTokens": tools_task.TRACE_TOKENS}
    return {"apiVersion": API_VERSION, "kind": "DistillationJob", "metadata": {"name": name}, "spec": spec}


def run_points(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per held-out evaluation the job reported: step, time, accuracy, and the step's
    train KL, turns per trace and the student's share of the response tokens."""
    by_step = {int(h["step"]): h for h in history}
    points = []
    for step, score in held_out_scores(history):
        h = by_step.get(step, {})
        points.append(
            {
                "step": step,
                "time": float(h.get("time", 0.0)),
                "accuracy": score,
                "trainKL": h.get("klStudentTeacher"),
                "turns": h.get("turnsMean"),
                "ownShare": h.get("lossTokenShare"),
            }
        )
    return points


def main_tools(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    """bench/learning.py --task tools; options left at their arithmetic defaults take DEFAULTS."""

    def given(option: str) -> bool:
        return getattr(args, option) != ap.get_default(option)

    quick = 1 if args.quick else 0
    steps = args.steps or DEFAULTS["steps"][quick]
    every = args.every or DEFAULTS["every"][quick]
    problems = args.problems or DEFAULTS["problems"][quick]
    seeds = int(DEFAULTS["seeds"]) if args.seeds is None else args.seeds
    if seeds < 1:
        ap.error(f"--seeds: must be at least 1, got {seeds}")
    lr = args.lr or float(DEFAULTS["lr"])
    for option in ("lora", "modes", "losses", "engine"):
        if given(option):
            ap.error(f"--{option}: not an option of the tool task (fullyAsync, {LOSS}, hf engine)")
    if not tools_task.OPENENV_PYTHON.is_file():
        ap.error(f"{tools_task.OPENENV_PYTHON} is missing: run examples/environments/install-openenv.sh")
    cache = Path(args.cache) if given("cache") else CACHE
    work = Path(args.workdir) if given("workdir") else WORKDIR

    t0 = time.time()
    info = tools_task.prepare_tools(cache, log=print)
    t, s = info["teacher"], info["student"]
    print(
        f"models: teacher {t['accuracy']:.1%} held-out accuracy (tool share {t['toolShare']:.0%}); warm-started "
        f"student {s['accuracy']:.1%} (tool share {s['toolShare']:.1%}, {s['toolPathAccuracy']:.1%} when it calls "
        f"the tool) (prepared in {time.time() - t0:.0f} s or cached)"
    )
    runs: list[dict[str, Any]] = []
    failures = []
    for seed in range(seeds):
        for variant in VARIANTS:
            name = f"learn-tools-{variant.split('-')[0]}-s{seed}"
            saved = work / f"{name}.result.json"
            if args.render_only:
                if saved.is_file():
                    runs.append(json.loads(saved.read_text()))
                continue
            ckpt = work / name / "ckpt"
            shutil.rmtree(ckpt, ignore_errors=True)
            manifest = tools_manifest(
                name, variant, cache, ckpt, steps=steps, every=every, problems=problems, lr=lr, seed=seed
            )
            load = os.getloadavg()[0]
            print(
                f"run {variant} / seed {seed}: {steps} steps x 64 samples, lr {lr:g} (load {load:.1f}) ...", flush=True
            )
            try:
                report = run_manifest(manifest, work)
            except JobFailed as exc:
                print(f"  FAILED: {exc}")
                failures.append(f"{variant}/seed {seed}")
                continue
            hist = report["history"]
            run: dict[str, Any] = {"variant": variant, "seed": seed, "lr": lr, "seconds": hist[-1]["time"]}
            run["load"] = [round(load, 1), round(os.getloadavg()[0], 1)]
            run["points"] = run_points(hist)
            run["envErrors"] = sum(int(h.get("envErrors") or 0) for h in hist)
            final = tools_task.evaluate_dir(ckpt / "student-hf", problems=200)
            run["finalToolShare"] = final["toolShare"]
            print(
                f"  done: {len(hist)} steps in {hist[-1]['time']:.0f} s, held-out accuracy "
                + " → ".join(f"{p['accuracy']:.1%}" for p in run["points"])
                + f"; final student calls the tool in {final['toolShare']:.0%} of 200 greedy traces",
                flush=True,
            )
            saved.write_text(json.dumps(run))
            runs.append(run)

    headers = ["step", "time s", "held-out accuracy", "train KL", "turns/trace", "student tokens"]
    for run in runs:
        rows = [
            [p["step"], fmt(p["time"], ".0f"), fmt(p["accuracy"], ".1%"), fmt(p["trainKL"], ".4f"),
             fmt(p["turns"], ".2f"), fmt(p["ownShare"], ".0%")]
            for p in run["points"]
        ]  # fmt: skip
        print(
            f"\n{run['variant']} / seed {run['seed']} ({run['seconds']:.0f} s, load {run['load'][0]}-{run['load'][1]}, "
            f"env errors {run['envErrors']}, final tool share {run['finalToolShare']:.0%})"
        )
        print(table(headers, rows))
    if failures:
        print(f"FAILED runs: {', '.join(failures)}")
    if not runs:
        print("tool task: no run finished")
        return 1

    print()
    summary = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        if not mine:
            continue
        begin = [r["points"][0]["accuracy"] for r in mine]
        end = [r["points"][-1]["accuracy"] for r in mine]
        gains = [(e - b) * 100 for b, e in zip(begin, end)]
        summary[variant] = {"begin": mean(begin), "end": mean(end), "gain": mean(gains)}
        spread = f" ± {statistics.stdev(end) * 100:.1f}" if len(end) > 1 else ""
        per_seed = ", ".join(f"{b:.1%} → {e:.1%}" for b, e in zip(begin, end))
        print(
            f"{variant}: held-out accuracy {mean(begin):.1%} → {mean(end):.1%}{spread} ({mean(gains):+.1f} points; "
            f"seeds: {per_seed}; final tool share {mean(r['finalToolShare'] for r in mine):.0%})"
        )
    multi, single = summary.get("multi-turn"), summary.get("single-turn")
    if multi is None:
        print("tool task: no multi-turn run finished")
        return 1
    lead = "" if single is None else f", {(multi['end'] - single['end']) * 100:+.1f} points over single-turn OPD"
    met = multi["gain"] >= GAIN_POINTS and (single is None or multi["end"] > single["end"])
    n = len([r for r in runs if r["variant"] == "multi-turn"])
    print(
        f"criterion (+{GAIN_POINTS:.0f} points or more from the warm start, above single-turn OPD at equal steps): "
        f"{'met' if met else 'NOT met'}"
    )
    print(
        f"tool use (multi-turn OPD with the calculator) held-out accuracy gain: {multi['gain']:+.1f} points "
        f"({multi['begin']:.1%} → {multi['end']:.1%}, mean of {n} seed{'s' if n > 1 else ''}, {steps} steps){lead}"
    )
    return 0 if not failures else 1
