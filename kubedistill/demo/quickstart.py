"""The CPU quickstart's models and data, made on the spot (nothing downloaded).

`prepare(dir)` trains a small teacher on two-digit addition to a high held-out greedy accuracy,
warm-starts a smaller student (`warm_start`, shared with bench/learning.py), and writes the
prompts in verl's format (accuracy and timings: docs/quickstart.md). `evaluate` measures how
close a student is to the teacher: held-out accuracy and the exact per-token reverse
KL(student || teacher) at student samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from kubedistill.demo import arith

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class ModelShape(TypedDict):
    """The tiny_config arguments that tell the teacher and the student apart."""

    num_layers: int
    intermediate_size: int


@dataclass(frozen=True)
class Supervised:
    """A supervised training schedule on the arithmetic task (arith.train_supervised's knobs)."""

    steps: int
    lr: float
    warmup: int
    decay: bool
    betas: tuple[float, float]
    seed: int
    batch_size: int = 128


TEACHER = ModelShape(num_layers=4, intermediate_size=512)
STUDENT = ModelShape(num_layers=2, intermediate_size=256)
# Cosine decay: a constant LR plateaus lower (docs/quickstart.md, "How the models are made").
TEACHER_TRAINING = Supervised(steps=700, lr=2e-3, warmup=100, decay=True, betas=(0.9, 0.98), seed=0)
# The student's warm start: far from the teacher, so distillation has something to show; from
# random weights a short job barely moves it (docs/quickstart.md). Constant LR on purpose: a
# student taken at the end of a decayed schedule loses its annealing gain as soon as any optimiser
# moves it again, a large early dip unrelated to distillation (docs/learning.md).
STUDENT_WARM_START = Supervised(steps=300, lr=1e-3, warmup=50, decay=False, betas=(0.9, 0.999), seed=1)
PROGRESS_EVERY = 100
"""Steps between progress lines while a model trains."""
MARKER = "prepared.json"


def progress_line(name: str, step: int, total: int, loss: float, accuracy: float, seconds: float) -> str:
    """One line while a model trains: the step, its loss, the accuracy so far, the time taken."""
    return f"quickstart: {name} step {step}/{total}, loss {loss:.3f}, accuracy {accuracy:.1%} ({seconds:.0f} s)"


def train(
    name: str,
    shape: ModelShape,
    cfg: Supervised,
    tok: PreTrainedTokenizerBase,
    *,
    log: Callable[[str], object] = print,
    every: int = PROGRESS_EVERY,
) -> tuple[PreTrainedModel, float]:
    """A model of `shape` trained with `cfg` from seeded random weights, logging progress every
    `every` steps; returns it with its held-out accuracy."""
    import torch
    from transformers import AutoModelForCausalLM

    from kubedistill.demo.tiny import tiny_config

    train_set, held_out = arith.split()
    probe = held_out[:200]  # enough to show the trend, cheap enough to measure every `every` steps
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(tiny_config(len(tok), **shape))
    t0 = time.time()

    def on_step(step: int, loss: float) -> None:
        # The last step's accuracy, on every held-out problem, is the caller's to report.
        if step % every == 0 and step < cfg.steps:
            model.eval()
            acc = arith.accuracy(model, tok, probe)
            model.train()
            log(progress_line(name, step, cfg.steps, loss, acc, time.time() - t0))

    arith.train_supervised(
        model,
        tok,
        train_set,
        cfg.steps,
        lr=cfg.lr,
        batch_size=cfg.batch_size,
        warmup=cfg.warmup,
        decay=cfg.decay,
        betas=cfg.betas,
        seed=cfg.seed,
        on_step=on_step,
    )
    return model, arith.accuracy(model, tok, held_out)


def warm_start(out: Path, tok: PreTrainedTokenizerBase, cfg: Supervised = STUDENT_WARM_START, **kw: Any) -> float:
    """Save the warm-started student (STUDENT shape, `cfg`) to `out`; returns its held-out accuracy."""
    model, acc = train("student warm start", STUDENT, cfg, tok, **kw)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return acc


def idle_cores(cores: int, load: float) -> int:
    """Threads for preparing or evaluating the models: the cores nothing else keeps busy (1-minute
    load average), at least one: threads beyond them spin against the other work and slow the
    training down (docs/quickstart.md, "How the models are made")."""
    return max(1, min(cores, round(cores - load)))


def use_all_cores(torch: Any) -> None:
    """Nothing of the job runs while the models are prepared or evaluated, so use every idle core
    the process may run on, whatever OMP_NUM_THREADS says (the quickstart sets it to 1 for the
    job's roles)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(idle_cores(cores, os.getloadavg()[0]))


def prepare(
    base: Path,
    *,
    teacher_steps: int = TEACHER_TRAINING.steps,
    student_steps: int = STUDENT_WARM_START.steps,
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Make `base`/{teacher,student,student-init,data}; reuse what a previous call made with the
    same schedules (a directory from an older version with another student gets a new student)."""
    import torch

    from kubedistill.demo.tiny import char_tokenizer

    base = Path(base)
    marker = base / MARKER
    wanted = {
        "teacher": dataclasses.replace(TEACHER_TRAINING, steps=teacher_steps),
        "student": dataclasses.replace(STUDENT_WARM_START, steps=student_steps),
    }
    info: dict[str, Any] = json.loads(marker.read_text()) if marker.is_file() else {}
    stale = [n for n, cfg in wanted.items() if recorded_schedule(info.get(n, {})) != schedule_json(cfg)]
    if not stale:
        return info
    use_all_cores(torch)
    tok = char_tokenizer(arith.ALPHABET)
    for name in stale:
        t0 = time.time()
        cfg = wanted[name]
        if name == "teacher":
            model, acc = train("teacher", TEACHER, cfg, tok, log=log)
            model.save_pretrained(str(base / name), safe_serialization=True)
            tok.save_pretrained(str(base / name))
        else:
            acc = warm_start(base / name, tok, cfg, log=log)
            # The untouched starting student, to measure what distillation changed.
            shutil.copytree(base / name, base / "student-init", dirs_exist_ok=True)
        info[name] = {
            "accuracy": acc,
            "steps": cfg.steps,
            "seconds": round(time.time() - t0, 1),
            "schedule": schedule_json(cfg),
        }
        log(f"quickstart: {name} trained {cfg.steps} steps in {info[name]['seconds']} s, held-out accuracy {acc:.1%}")
    train_set, held_out = arith.split()
    arith.write_jsonl(train_set, base / "data" / "train.jsonl")
    arith.write_jsonl(held_out, base / "data" / "val.jsonl")
    marker.write_text(json.dumps(info, indent=2))
    return info


def schedule_json(cfg: Supervised) -> dict[str, Any]:
    """`cfg` as prepared.json records it (JSON has no tuples)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}


def recorded_schedule(entry: dict[str, Any]) -> dict[str, Any] | None:
    """The schedule a prepared.json entry was made with. Entries written before schedules were
    recorded were all trained with the teacher's schedule, so a teacher made then is reused."""
    if "schedule" in entry:
        recorded: dict[str, Any] = entry["schedule"]
        return recorded
    if "steps" in entry:
        return schedule_json(dataclasses.replace(TEACHER_TRAINING, steps=int(entry["steps"])))
    return None


def evaluate(
    student_dir: Path, teacher_dir: Path, n_problems: int = 500, samples: int = 4, seed: int = 0
) -> dict[str, float]:
    """{'accuracy', 'reverse_kl'} of a student on held-out problems."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    use_all_cores(torch)
    tok = AutoTokenizer.from_pretrained(str(student_dir))
    student = AutoModelForCausalLM.from_pretrained(str(student_dir)).eval()
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir)).eval()
    problems = arith.split()[1][:n_problems]
    acc = sum(a.strip() == p.answer for a, p in zip(arith.greedy_answers(student, tok, problems), problems))
    torch.manual_seed(seed)
    ids = torch.tensor([tok(tok.bos_token + p.prompt, add_special_tokens=False).input_ids for p in problems])
    ids = ids.repeat_interleave(samples, 0)
    with torch.no_grad():
        seqs = student.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        s = torch.log_softmax(student(seqs).logits.float(), -1)
        t = torch.log_softmax(teacher(seqs).logits.float(), -1)
    # Positions predicting response tokens, up to and including the first <eos>.
    start = ids.shape[1] - 1
    resp = seqs[:, ids.shape[1] :]
    after_eos = (resp == tok.eos_token_id).long().cumsum(1) - (resp == tok.eos_token_id).long()
    mask = (after_eos == 0) & (resp != tok.pad_token_id)
    kl = (s.exp() * (s - t)).sum(-1)[:, start : start + resp.shape[1]]
    return {"accuracy": acc / len(problems), "reverse_kl": float((kl * mask).sum() / mask.sum())}


QUICKSTART_DIR = Path(".kubedistill/quickstart")
QUICKSTART_JOB = Path("examples/quickstart-cpu.yaml")


def summary_line(before: dict[str, float], after: dict[str, float], teacher_accuracy: float) -> str:
    """The command's last line: how much closer to the teacher distillation brought the student."""
    ratio = before["reverse_kl"] / after["reverse_kl"] if after["reverse_kl"] > 0 else float("inf")
    change = f"{ratio:.1f}× closer" if ratio >= 1 else f"{1 / ratio:.1f}× farther"
    return (
        f"student→teacher reverse KL {before['reverse_kl']:.2f} → {after['reverse_kl']:.2f} ({change}); "
        f"accuracy {before['accuracy']:.1%} → {after['accuracy']:.1%} (teacher {teacher_accuracy:.1%})"
    )


def held_out_scores(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, held-out score) of every evaluation the job reported (spec.evaluation), in order."""
    found = [(int(e["step"]), e["score"]) for line in history for e in line.get("evaluations") or []]
    return [(step, float(score)) for step, score in found if score is not None]


def with_job_accuracy(
    before: dict[str, float], after: dict[str, float], scores: list[tuple[int, float]]
) -> tuple[dict[str, float], dict[str, float]]:
    """The accuracies the job measured itself (its evaluations before step 1 and after the last
    step: the same problems and greedy answers as evaluate()) in place of evaluate()'s."""
    if not scores or scores[0][0] != 0:
        return before, after
    return {**before, "accuracy": scores[0][1]}, {**after, "accuracy": scores[-1][1]}


def quickstart(job: Path = QUICKSTART_JOB, base: Path = QUICKSTART_DIR, *, log: Callable[[str], object] = print) -> int:
    """Prepare the models and data, run the job with `kubedistill run`, compare the student before
    and after against the teacher. Run from the repository root (the job's paths are relative)."""
    from kubedistill.api.validate import load_job
    from kubedistill.runtime.entrypoints import local

    t0 = time.time()
    if not Path(job).is_file():
        log(f"kubedistill quickstart: {job} not found; run it from the kubedistill repository root")
        return 2
    spec = load_job(Path(job)).spec
    info = prepare(base, log=log)
    log(f"quickstart: models and data ready in {base} ({time.time() - t0:.0f} s)")
    ckpt = Path(spec.checkpoint.path)
    if ckpt.exists():
        shutil.rmtree(ckpt)  # a fresh run every time (otherwise it would resume the finished one)
    code = local.run(Path(job), report=base / "report.json")
    if code != 0:
        log(f"kubedistill quickstart: the job failed (exit {code}); see the logs above")
        return code
    scores = held_out_scores(json.loads((base / "report.json").read_text()).get("history") or [])
    if scores:
        steps = " → ".join(f"{score:.1%} (step {step})" for step, score in scores)
        log(f"quickstart: held-out accuracy measured by the job: {steps}")
    log("quickstart: evaluating the student before and after distillation ...")
    before, after = with_job_accuracy(
        evaluate(base / "student-init", base / "teacher"), evaluate(ckpt / "student-hf", base / "teacher"), scores
    )
    teacher_acc = float(info.get("teacher", {}).get("accuracy", float("nan")))
    result = {"before": before, "after": after, "teacher_accuracy": teacher_acc, "seconds": round(time.time() - t0, 1)}
    (base / "result.json").write_text(json.dumps(result, indent=2))
    log(f"quickstart: finished in {result['seconds']:.0f} s")
    log(summary_line(before, after, teacher_acc))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`kubedistill quickstart` (kubedistill.cli.DEMO_COMMANDS)."""
    p.add_argument("--job", default=str(QUICKSTART_JOB), help="the job to run (default %(default)s)")
    p.add_argument(
        "--dir",
        default=str(QUICKSTART_DIR),
        help="where the models and data go (must match the job's paths; default %(default)s)",
    )
    p.set_defaults(func=lambda args: quickstart(Path(args.job), Path(args.dir)))
