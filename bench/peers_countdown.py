"""Workload 2 of bench/peers.py: counting down, a task with long-tailed response lengths.

Prompt `37x03=`, answer `37.03,36.02,35.01,34.00` then <eos>: count down from the first number,
for as many more steps as the second says, each item the number and the steps left. Each token
follows from the prompt or the item before it (copy, decrement with borrow, stop after `.00`), so
a ~1 M-parameter teacher learns it on CPU in minutes. (A first version, `37>34=` → `37,36,35,34`,
had to compare every number with the prompt's to stop, and its teacher had not learnt to in 500
steps; the counter makes stopping local.) The answer's length is 6 × (steps + 1) − 1
characters: 5 to 203 tokens (steps up to 33). Steps are drawn
log-uniformly, so most answers are a few tokens long and a few per batch run to hundreds: a
lock-step batch waits for its longest answer, which is what overlapping generation with training
and partial rollouts are for.

Char-level vocabulary (kubedistill/demo/tiny.py's char_tokenizer, 4 special + 13 tokens); the
prompts and the teacher's training reuse the arithmetic task's helpers (verl rows, the supervised
loop) where they fit. Made once under `.kubedistill/peers/countdown` (`prepare`).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ALPHABET = "0123456789x=.,"
DATA_SOURCE = "countdown"
MAX_GAP = 33
MAX_NEW_TOKENS = 6 * (MAX_GAP + 1)  # the longest answer (203 characters) and its <eos>
TEACHER = {"num_layers": 4, "intermediate_size": 512}
STUDENT = {"num_layers": 2, "intermediate_size": 256}


@dataclass(frozen=True)
class Problem:
    start: int
    gap: int
    """Steps to count down; the answer has gap + 1 items."""

    @property
    def prompt(self) -> str:
        return f"{self.start:02d}x{self.gap:02d}="

    @property
    def answer(self) -> str:
        return ",".join(f"{self.start - i:02d}.{self.gap - i:02d}" for i in range(self.gap + 1))


def split(seed: int = 0, held_out: int = 500) -> tuple[list[Problem], list[Problem]]:
    """All problems (start − gap ≥ 0, gap ≤ MAX_GAP: 2,839), shuffled; the last `held_out` never
    appear in training."""
    problems = [Problem(a, g) for a in range(100) for g in range(min(a, MAX_GAP) + 1)]
    random.Random(seed).shuffle(problems)
    return problems[:-held_out], problems[-held_out:]


def long_tailed(problems: Sequence[Problem], n: int, seed: int) -> list[Problem]:
    """`n` problems (with repeats) whose gap is log-uniform in [0, MAX_GAP]: the median answer is
    ~30 tokens, one in ten is over 130."""
    by_gap: dict[int, list[Problem]] = {}
    for p in problems:
        by_gap.setdefault(p.gap, []).append(p)
    gaps = sorted(by_gap)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        want = math.exp(rng.uniform(0.0, math.log(MAX_GAP + 1))) - 1
        gap = min(gaps, key=lambda g: abs(g - want))  # the nearest gap the set has
        out.append(rng.choice(by_gap[gap]))
    return out


def verl_row(p: Problem, index: int) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": p.prompt}],
        "ability": "counting",
        "reward_model": {"style": "rule", "ground_truth": p.answer},
        "extra_info": {"index": index},
    }


def write_jsonl(problems: Sequence[Problem], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(verl_row(p, i)) + "\n" for i, p in enumerate(problems)))
    return path


def greedy_answers(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, problems: Sequence[Problem], batch_size: int = 250
) -> list[str]:
    """Greedy completions up to MAX_NEW_TOKENS (every prompt has the same length: no padding)."""
    import torch

    out: list[str] = []
    with torch.no_grad():
        for i in range(0, len(problems), batch_size):
            chunk = problems[i : i + batch_size]
            ids = torch.tensor([tok(tok.bos_token + p.prompt, add_special_tokens=False).input_ids for p in chunk])
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            out.extend(tok.decode(g[ids.shape[1] :], skip_special_tokens=True) for g in gen)
    return out


def accuracy(model: PreTrainedModel, tok: PreTrainedTokenizerBase, problems: Sequence[Problem]) -> float:
    """Exact match of the whole count."""
    answers = greedy_answers(model, tok, problems)
    return sum(a.strip() == p.answer for a, p in zip(answers, problems)) / len(problems)


def eval_set(n: int = 200) -> list[Problem]:
    """The held-out problems every evaluation uses, long-tailed like training."""
    return long_tailed(split()[1], n, seed=1)


def evaluate(student_dir: Path, n: int = 200) -> float:
    """Held-out greedy exact-match accuracy of the HF model in `student_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(student_dir))
    model = AutoModelForCausalLM.from_pretrained(str(student_dir)).eval()
    return accuracy(model, tok, eval_set(n))


@dataclass(frozen=True)
class Schedule:
    steps: int
    lr: float
    warmup: int
    decay: bool
    seed: int
    tokens: int = 1536
    """Tokens per batch: a batch holds problems of about one length, as many as fit."""
    max_gap: int = MAX_GAP


TEACHER_TRAINING = Schedule(steps=500, lr=2e-3, warmup=50, decay=True, seed=0)
# Short counts only (gaps ≤ 6): the student has the format and the rule on short answers, and
# the long ones are left for distillation, on its own long-tailed samples.
STUDENT_WARM_START = Schedule(steps=120, lr=1e-3, warmup=20, decay=False, seed=1, max_gap=6)


def length_batch(problems: Sequence[Problem], tokens: int, max_gap: int, rng: random.Random) -> list[Problem]:
    """Problems of one log-uniformly drawn gap (±10 %), as many as `tokens` holds: every batch
    costs about the same whatever its length, with no padding to a long tail."""
    want = math.exp(rng.uniform(0.0, math.log(max_gap + 1))) - 1
    near = [p for p in problems if abs((p.gap) - want) <= max(0.5, 0.1 * want)]
    near = near or [min(problems, key=lambda p: abs((p.gap) - want))]
    size = max(2, tokens // (6 * (round(want) + 1) + 8))
    return [rng.choice(near) for _ in range(size)]


def train(
    shape: dict[str, int], cfg: Schedule, tok: PreTrainedTokenizerBase, log: Callable[[str], object] = print
) -> PreTrainedModel:
    """A model of `shape` trained on long-tailed training problems with the tasks' supervised loop."""
    import torch
    from transformers import AutoModelForCausalLM

    from kubedistill.demo.arith import encode
    from kubedistill.demo.sft import train_loop
    from kubedistill.demo.tiny import tiny_config

    train_set = split()[0]
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(tiny_config(len(tok), **shape))
    t0 = time.time()

    def next_batch() -> dict[str, Any]:
        # encode() only reads .prompt and .answer: it pads the batch to its longest answer.
        ids, labels = encode(tok, length_batch(train_set, cfg.tokens, cfg.max_gap, rng))
        return {"input_ids": ids, "labels": labels}

    def on_step(step: int, loss: float) -> None:
        if step % 50 == 0:
            layers = shape["num_layers"]
            log(f"peers: countdown {layers}-layer step {step}/{cfg.steps}, loss {loss:.3f} ({time.time() - t0:.0f} s)")

    train_loop(
        model, next_batch, cfg.steps, lr=cfg.lr, warmup=cfg.warmup, decay=cfg.decay, betas=(0.9, 0.98), on_step=on_step
    )
    return model


def prepare(base: Path, log: Callable[[str], object] = print) -> dict[str, Any]:
    """Make `base`/{teacher,student,data} once (prepared.json records what was made)."""
    import torch

    from kubedistill.demo.tiny import char_tokenizer

    marker = base / "prepared.json"
    info: dict[str, Any] = json.loads(marker.read_text()) if marker.is_file() else {}
    if {"teacher", "student"} <= info.keys():
        return info
    from kubedistill.demo.quickstart import use_all_cores

    use_all_cores(torch)
    tok = char_tokenizer(ALPHABET)
    for name, shape, cfg in (("teacher", TEACHER, TEACHER_TRAINING), ("student", STUDENT, STUDENT_WARM_START)):
        if name in info:
            continue
        t0 = time.time()
        model = train(shape, cfg, tok, log)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(str(base / name), safe_serialization=True)
        tok.save_pretrained(str(base / name))
        acc = accuracy(model.eval(), tok, eval_set())
        info[name] = {"accuracy": acc, "seconds": round(time.time() - t0, 1), "steps": cfg.steps}
        took = info[name]["seconds"]
        log(f"peers: countdown {name} trained {cfg.steps} steps in {took} s, held-out accuracy {acc:.1%}")
        marker.write_text(json.dumps(info, indent=2))  # a model made survives a failure of the next
    train_set = split()[0]
    write_jsonl(long_tailed(train_set, 20000, seed=2), base / "data" / "train.jsonl")
    marker.write_text(json.dumps(info, indent=2))
    return info


if __name__ == "__main__":
    import sys

    print(prepare(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".kubedistill/peers/countdown")))
