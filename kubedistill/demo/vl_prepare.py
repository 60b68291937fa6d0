"""The models and data of the vision-language CPU twin (examples/multi-teacher-vl-cpu.yaml), made
on the spot (nothing downloaded) and cached.

`prepare_vl(dir)` writes, under `dir` (the example's `.kubedistill/multi-teacher-vl`):

- `teacher-vision`: a tiny Qwen3-VL (kubedistill/demo/tiny_vl.py) trained on the dots task
  (kubedistill/demo/dots.py);
- `teacher-text`: a tiny causal LM (kubedistill/demo/tiny.py, the quickstart teacher's shape) with
  the tiny VL tokenizer (student and teachers share one tokenizer), trained on two-digit addition
  (kubedistill/demo/arith.py);
- `student` and `student-init` (the same warm start; the job trains from `student`, and
  `student-init` stays untouched to measure what distillation changed): a tiny Qwen3-VL whose
  vision tower is the vision teacher's (a pretrained vision encoder, as a real VL student such
  as Qwen3-VL-2B has) and whose language side is warm-started on arithmetic only, at a constant
  learning rate: decent on arithmetic, and it has never been asked about a picture (see VLRecipe);
- `data/train.parquet`: image rows (verl's format) and arithmetic text rows in one file, and
  `data/val.parquet` the same from held-out problems.

Each part is rebuilt only when its recipe changed (`prepared.json` records them). `QUICK` is a
few seconds' variant for tests: barely trained models and small data files, the same layout.
`evaluate_vl` measures a student's greedy held-out accuracy on both tasks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubedistill.demo import arith, dots, quickstart

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast, ProcessorMixin

VL_DIR = Path(".kubedistill/multi-teacher-vl")
VL_JOB = Path("examples/multi-teacher-vl-cpu.yaml")
MARKER = "prepared.json"
PARTS = ("teacher-vision", "teacher-text", "student", "data")


@dataclass(frozen=True)
class VLRecipe:
    """How each part is made. The defaults are the measured recipe (docs/design.md, "Vision-language
    students"; bench/learning.py --task vl)."""

    vision_teacher_steps: int = 600
    """dots.train_supervised steps (batch 32, lr 3e-3, cosine)."""
    vision_teacher_seed: int = 0
    text_teacher: quickstart.Supervised = dataclasses.replace(quickstart.TEACHER_TRAINING, steps=500)
    """The quickstart teacher's shape and schedule, in fewer steps: enough with this tokenizer."""
    student_steps: int = 600
    """Arithmetic steps of the student's warm start (batch 128, constant lr after warm-up)."""
    student_lr: float = 1e-3
    student_seed: int = 1
    student_dots_steps: int = 0
    """Dots steps (batch 32) after the arithmetic ones: with 0 the student never saw the task."""
    student_vision_from_teacher: bool = True
    """Start the student's vision tower (`model.visual.*`) from the trained vision teacher's. A
    random tower has to learn to see dots first, for hundreds of supervised steps; a pretrained
    tower leaves the student only the task to learn, as for a real VL student."""
    train_rows: int = 4000
    """Rows of each task in data/train.parquet (the mixed file holds twice as many)."""
    val_rows: int = 400
    """Held-out rows of each task in data/val.parquet."""
    eval_problems: int = 400
    """Held-out problems per task behind the accuracies prepared.json records."""

    def part(self, name: str) -> dict[str, Any]:
        """The recipe fields that make part `name` (what prepared.json compares)."""
        if name == "teacher-vision":
            return {"steps": self.vision_teacher_steps, "seed": self.vision_teacher_seed}
        if name == "teacher-text":
            return quickstart.schedule_json(self.text_teacher)
        if name == "student":
            return {
                "steps": self.student_steps,
                "lr": self.student_lr,
                "seed": self.student_seed,
                "dots_steps": self.student_dots_steps,
                # The vision teacher's recipe: a new vision teacher means a new student tower.
                "vision_from": self.part("teacher-vision") if self.student_vision_from_teacher else None,
            }
        if name == "data":
            return {"train_rows": self.train_rows, "val_rows": self.val_rows}
        raise ValueError(f"unknown part {name!r}; parts: {', '.join(PARTS)}")


FULL = VLRecipe()
QUICK = VLRecipe(
    vision_teacher_steps=10,
    text_teacher=dataclasses.replace(quickstart.TEACHER_TRAINING, steps=10, warmup=5),
    student_steps=10,
    train_rows=32,
    val_rows=16,
    eval_problems=16,
)
"""Tests: the same files in a few seconds, the models barely trained."""
TEXT_TEACHER_SHAPE = quickstart.TEACHER
VISION_BATCH, VISION_LR = 32, 3e-3
STUDENT_BATCH, DOTS_BATCH = 128, 32
PROGRESS_EVERY = 100
VISION_PREFIX = "model.visual."
STUDENT_SHAPE = {"num_kv_heads": 2}
"""Two KV heads: with tiny_vl's default one the warm start learns arithmetic far slower."""


def progress(log: Callable[[str], object], name: str, step: int, total: int, loss: float, t0: float) -> None:
    if step % PROGRESS_EVERY == 0 and step < total:
        log(f"vl-prepare: {name} step {step}/{total}, loss {loss:.3f} ({time.time() - t0:.0f} s)")


def save_vl(model: PreTrainedModel, tok: PreTrainedTokenizerFast, out: Path) -> None:
    """A trained tiny Qwen3-VL with its generation config, tokenizer and processor."""
    from transformers import GenerationConfig

    from kubedistill.demo.tiny_vl import vl_processor

    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    vl_processor(tok).save_pretrained(str(out))


def new_vl(tok: PreTrainedTokenizerFast, seed: int, **shape: Any) -> PreTrainedModel:
    """A seeded random tiny Qwen3-VL (tiny_vl's default shape but for `shape`, float32)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from kubedistill.demo.tiny_vl import tiny_vl_config

    torch.manual_seed(seed)
    model: PreTrainedModel = Qwen3VLForConditionalGeneration._from_config(
        tiny_vl_config(tok, **shape), dtype=torch.float32
    )
    return model


def train_vision_teacher(
    tok: PreTrainedTokenizerFast, processor: ProcessorMixin, recipe: VLRecipe, log: Callable[[str], object]
) -> PreTrainedModel:
    model = new_vl(tok, recipe.vision_teacher_seed)
    train_set, _ = dots.split()
    t0 = time.time()
    steps = recipe.vision_teacher_steps
    dots.train_supervised(
        model,
        processor,
        train_set,
        steps,
        lr=VISION_LR,
        batch_size=VISION_BATCH,
        warmup=min(20, steps),
        seed=recipe.vision_teacher_seed,
        on_step=lambda s, loss: progress(log, "vision teacher", s, steps, loss, t0),
    )
    return model


def warm_start_student(
    tok: PreTrainedTokenizerFast,
    processor: ProcessorMixin,
    recipe: VLRecipe,
    log: Callable[[str], object],
    vision_from: Path | None = None,
) -> PreTrainedModel:
    """The student's vision tower from the VL model at `vision_from` (when given), then supervised
    steps on arithmetic (text through the VL model: the tower gets no gradient), then
    `student_dots_steps` on dots; AdamW at a constant lr after 50 warm-up steps. No decay on
    purpose: a student taken at the end of a decayed schedule loses its annealing gain as soon as
    distillation moves it (docs/learning.md), which would show up as a fall in text accuracy
    unrelated to the images."""
    import random

    import torch
    from transformers import AutoModelForImageTextToText

    model = new_vl(tok, recipe.student_seed, **STUDENT_SHAPE)
    if vision_from is not None:
        source = AutoModelForImageTextToText.from_pretrained(str(vision_from), dtype=torch.float32)
        tower = {k: v for k, v in source.state_dict().items() if k.startswith(VISION_PREFIX)}
        result = model.load_state_dict(tower, strict=False)
        if not tower or result.unexpected_keys:
            raise RuntimeError(
                f"{vision_from}: its vision tower does not fit the student ({result.unexpected_keys[:3]})"
            )
    a_train, _ = arith.split()
    d_train, _ = dots.split()
    rng, d_rng = random.Random(recipe.student_seed), random.Random(recipe.student_seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.student_lr, betas=(0.9, 0.999), weight_decay=0.0)
    total = recipe.student_steps + recipe.student_dots_steps
    t0 = time.time()
    model.train()
    for step in range(1, total + 1):
        for group in opt.param_groups:
            group["lr"] = recipe.student_lr * min(1.0, step / 50)
        if step <= recipe.student_steps:
            ids, labels = arith.encode(tok, rng.sample(a_train, STUDENT_BATCH))
            loss = model(input_ids=ids, labels=labels).loss
        else:
            loss = model(**dots.encode(processor, d_rng.sample(d_train, DOTS_BATCH))).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        progress(log, "student warm start", step, total, float(loss.detach()), t0)
    model.eval()
    return model


def write_data(base: Path, recipe: VLRecipe) -> None:
    a_train, a_held = arith.split()
    d_train, d_held = dots.split()
    dots.write_mixed(base / "data" / "train.parquet", a_train[: recipe.train_rows], d_train[: recipe.train_rows])
    dots.write_mixed(base / "data" / "val.parquet", a_held[: recipe.val_rows], d_held[: recipe.val_rows])


def prepare_vl(base: Path = VL_DIR, *, recipe: VLRecipe = FULL, log: Callable[[str], object] = print) -> dict[str, Any]:
    """Make `base`/{teacher-vision, teacher-text, student, student-init, data}; reuse each part a
    previous call made with the same recipe. Returns prepared.json: per part its recipe, the
    seconds it took and (models) the held-out accuracies."""
    import torch

    from kubedistill.demo.tiny_vl import vl_processor, vl_tokenizer

    base = Path(base)
    marker = base / MARKER
    info: dict[str, Any] = json.loads(marker.read_text()) if marker.is_file() else {}
    stale = [p for p in PARTS if info.get(p, {}).get("recipe") != recipe.part(p) or not (base / p).exists()]
    if not stale:
        return info
    quickstart.use_all_cores(torch)
    tok = vl_tokenizer()
    processor = vl_processor(tok)
    for name in stale:
        t0 = time.time()
        entry: dict[str, Any] = {"recipe": recipe.part(name)}
        if name == "teacher-vision":
            model = train_vision_teacher(tok, processor, recipe, log)
            save_vl(model, tok, base / name)
            entry["accuracy"] = {"dots": dots.accuracy(model, processor, dots.split()[1][: recipe.eval_problems])}
        elif name == "teacher-text":
            model, _ = quickstart.train(
                "text teacher",
                TEXT_TEACHER_SHAPE,
                recipe.text_teacher,
                tok,
                log=lambda line: log(line.replace("quickstart:", "vl-prepare:", 1)),
            )
            model.save_pretrained(str(base / name), safe_serialization=True)
            tok.save_pretrained(str(base / name))
            entry["accuracy"] = {"arith": arith.accuracy(model, tok, arith.split()[1][: recipe.eval_problems])}
        elif name == "student":
            vision_from = base / "teacher-vision" if recipe.student_vision_from_teacher else None
            model = warm_start_student(tok, processor, recipe, log, vision_from)
            save_vl(model, tok, base / name)
            # The untouched starting student, to measure what distillation changed.
            shutil.copytree(base / name, base / "student-init", dirs_exist_ok=True)
            entry["accuracy"] = accuracies(model, processor, recipe.eval_problems)
        else:
            write_data(base, recipe)
        entry["seconds"] = round(time.time() - t0, 1)
        info[name] = entry
        accuracy = ", ".join(f"{task} {acc:.1%}" for task, acc in entry.get("accuracy", {}).items())
        log(
            f"vl-prepare: {name} made in {entry['seconds']} s" + (f", held-out accuracy {accuracy}" if accuracy else "")
        )
    marker.write_text(json.dumps(info, indent=2))
    return info


def accuracies(model: PreTrainedModel, processor: ProcessorMixin, n_problems: int) -> dict[str, float]:
    """Greedy held-out accuracy of a VL model on the image task and on the text task."""
    return {
        "dots": dots.accuracy(model, processor, dots.split()[1][:n_problems]),
        "arith": arith.accuracy(model, processor.tokenizer, arith.split()[1][:n_problems]),
    }


def evaluate_vl(student_dir: Path, n_problems: int = 400) -> dict[str, float]:
    """{'dots', 'arith'}: a VL student's greedy accuracy on `n_problems` held-out problems of each
    task (the dots held-out set has 400)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    quickstart.use_all_cores(torch)
    processor = AutoProcessor.from_pretrained(str(student_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(student_dir), dtype=torch.float32).eval()
    return accuracies(model, processor, n_problems)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`kubedistill prepare-vl` (kubedistill.cli.DEMO_COMMANDS)."""
    p.add_argument("--dir", default=str(VL_DIR), help="where they go (must match the job's paths; default %(default)s)")
    p.add_argument("--quick", action="store_true", help="barely trained models and small data (seconds; for tests)")

    def run(args: argparse.Namespace) -> int:
        t0 = time.time()
        prepare_vl(Path(args.dir), recipe=QUICK if args.quick else FULL)
        print(
            f"vl-prepare: models and data ready in {args.dir} ({time.time() - t0:.0f} s); now: kubedistill run {VL_JOB}"
        )
        return 0

    p.set_defaults(func=run)
