"""Two-digit addition as a tiny verifiable task: prompt `07+45=`, answer `52` then <eos>.

Char-level vocabulary (16 ids), so a 1 M-parameter teacher learns it on a CPU in minutes
(docs/quickstart.md, "Measured") and a smaller student can be distilled from it on-policy.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubedistill.demo.sft import train_loop

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ALPHABET = "0123456789+="
DATA_SOURCE = "arith"


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a:02d}+{self.b:02d}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def split(seed: int = 0, held_out: int = 1000) -> tuple[list[Problem], list[Problem]]:
    """All 10,000 problems, shuffled; the last `held_out` never appear in training."""
    problems = [Problem(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(problems)
    return problems[:-held_out], problems[-held_out:]


def verl_row(p: Problem, index: int) -> dict[str, Any]:
    """One row in verl's data format."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": p.prompt}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": p.answer},
        "extra_info": {"index": index},
    }


def write_jsonl(problems: Iterable[Problem], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, p in enumerate(problems):
            f.write(json.dumps(verl_row(p, i)) + "\n")
    return path


def encode(tokenizer: PreTrainedTokenizerBase, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) tensors for supervised training: loss on the answer and <eos> only."""
    import torch

    seqs, labels = [], []
    for p in problems:
        prompt = tokenizer(tokenizer.bos_token + p.prompt, add_special_tokens=False).input_ids
        answer = tokenizer(p.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
    return ids, lab


def train_supervised(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: list[Problem],
    steps: int,
    *,
    lr: float = 2e-3,
    batch_size: int = 128,
    warmup: int = 100,
    decay: bool = True,
    betas: tuple[float, float] = (0.9, 0.98),
    seed: int = 0,
    on_step: Callable[[int, float], object] | None = None,
) -> None:
    """AdamW with warm-up, then cosine decay to 0 (a constant LR plateaus lower here) or,
    with `decay=False`, a constant LR. `on_step(step, loss)` runs after every step (1-based)."""
    rng = random.Random(seed)

    def next_batch() -> dict[str, Any]:
        ids, labels = encode(tokenizer, rng.sample(problems, batch_size))
        return {"input_ids": ids, "labels": labels}

    train_loop(model, next_batch, steps, lr=lr, warmup=warmup, decay=decay, betas=betas, on_step=on_step)


def greedy_answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: list[Problem], batch_size: int = 500
) -> list[str]:
    """Greedy completions (up to 4 tokens) of each problem's prompt."""
    import torch

    out: list[str] = []
    with torch.no_grad():
        for i in range(0, len(problems), batch_size):
            chunk = problems[i : i + batch_size]
            ids = torch.tensor(
                [tokenizer(tokenizer.bos_token + p.prompt, add_special_tokens=False).input_ids for p in chunk]
            )
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=4,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            out.extend(tokenizer.decode(g[ids.shape[1] :], skip_special_tokens=True) for g in gen)
    return out


def accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: list[Problem]) -> float:
    answers = greedy_answers(model, tokenizer, problems)
    return sum(a.strip() == p.answer for a, p in zip(answers, problems)) / len(problems)
