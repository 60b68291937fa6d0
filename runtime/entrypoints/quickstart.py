"""The CPU quickstart's models and data, made on the spot (nothing downloaded).

`prepare(dir)` trains a small teacher on two-digit addition to a high held-out greedy accuracy,
makes a smaller random-weight student, and writes the prompts in verl's format (accuracy and
timings: docs/quickstart.md). `evaluate` measures how close a student is to the teacher:
held-out accuracy and the exact per-token reverse KL(student || teacher) at student samples.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

from kubedistill.runtime.tasks import arith


class ModelShape(TypedDict):
    """The tiny_config arguments that tell the teacher and the student apart."""

    num_layers: int
    intermediate_size: int


TEACHER = ModelShape(num_layers=4, intermediate_size=512)
STUDENT = ModelShape(num_layers=2, intermediate_size=256)
TEACHER_STEPS = 700
# The student starts from random weights: everything it learns comes from on-policy distillation.
# A supervised warm start makes a short run look worse first: forward KL from a half-trained
# student dips before it recovers (docs/quickstart.md, docs/learning.md).
STUDENT_WARMUP_STEPS = 0
MARKER = "prepared.json"


def use_all_cores(torch: Any) -> None:
    """Nothing else runs while the models are prepared or evaluated, so use every core the process
    may run on, whatever OMP_NUM_THREADS says (the quickstart sets it to 1 for the job's roles)."""
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def prepare(
    base: Path,
    *,
    teacher_steps: int = TEACHER_STEPS,
    student_steps: int = STUDENT_WARMUP_STEPS,
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Make `base`/{teacher,student,student-init,data}; reuse them when already complete."""
    import torch
    from transformers import AutoModelForCausalLM

    from kubedistill.runtime.models.tiny import char_tokenizer, tiny_config

    base = Path(base)
    marker = base / MARKER
    if marker.is_file():
        prepared: dict[str, Any] = json.loads(marker.read_text())
        return prepared
    use_all_cores(torch)
    tok = char_tokenizer(arith.ALPHABET)
    train, held_out = arith.split()
    info: dict[str, Any] = {}
    for name, shape, steps, seed in (("teacher", TEACHER, teacher_steps, 0), ("student", STUDENT, student_steps, 1)):
        t0 = time.time()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(len(tok), **shape))
        arith.train_supervised(model, tok, train, steps, seed=seed)
        acc = arith.accuracy(model, tok, held_out)
        out = base / name
        model.save_pretrained(str(out), safe_serialization=True)
        tok.save_pretrained(str(out))
        info[name] = {"accuracy": acc, "steps": steps, "seconds": round(time.time() - t0, 1)}
        log(f"quickstart: {name} trained {steps} steps in {info[name]['seconds']} s, held-out accuracy {acc:.1%}")
    # The untouched starting student, to measure what distillation changed.
    shutil.copytree(base / "student", base / "student-init", dirs_exist_ok=True)
    arith.write_jsonl(train, base / "data" / "train.jsonl")
    arith.write_jsonl(held_out, base / "data" / "val.jsonl")
    marker.write_text(json.dumps(info, indent=2))
    return info


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
    log("quickstart: evaluating the student before and after distillation ...")
    before = evaluate(base / "student-init", base / "teacher")
    after = evaluate(ckpt / "student-hf", base / "teacher")
    teacher_acc = float(info.get("teacher", {}).get("accuracy", float("nan")))
    result = {"before": before, "after": after, "teacher_accuracy": teacher_acc, "seconds": round(time.time() - t0, 1)}
    (base / "result.json").write_text(json.dumps(result, indent=2))
    log(f"quickstart: finished in {result['seconds']:.0f} s")
    log(summary_line(before, after, teacher_acc))
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("quickstart", help="CPU demo: make a teacher and a student, distill on-policy, show the gain")
    p.add_argument("--job", default=str(QUICKSTART_JOB), help="the job to run (default %(default)s)")
    p.add_argument(
        "--dir",
        default=str(QUICKSTART_DIR),
        help="where the models and data go (must match the job's paths; default %(default)s)",
    )
    p.set_defaults(func=lambda args: quickstart(Path(args.job), Path(args.dir)))
