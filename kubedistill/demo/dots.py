"""Count the dots: a tiny verifiable image task, beside the arithmetic text task (arith.py).

A 64x64 white picture holds 1 to 4 black dots of one size, never touching each other or the border;
the prompt is `<image>How many dots?` and the answer the digit, then <eos>. Every dot darkens the
same number of pixels, so the count is a linear function of the picture: a tiny Qwen3-VL
(kubedistill/demo/tiny_vl.py) learns it on a CPU in minutes (docs/design.md, "Vision-language
students").

Rows are in verl's multimodal format, as its Geometry3K preprocessing writes them: an `images`
column of `{bytes: <PNG>}` and one `<image>` marker in the prompt text per image. `write_mixed`
writes one dataset holding these rows and the arithmetic task's text rows (data_source `arith`),
for a vision-language student distilled from a text teacher and a vision teacher routed by
data_source.
"""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubedistill.demo import arith
from kubedistill.demo.sft import train_loop

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image
    from transformers import PreTrainedModel, ProcessorMixin

DATA_SOURCE = "synthetic/dots"
"""Scored by the built-in exact-match reward (pattern `synthetic/*`), like `reward` below."""
IMAGE_MARKER = "<image>"
QUESTION = "How many dots?"
IMAGE_SIZE = 64
RADIUS = 5
MIN_DOTS, MAX_DOTS = 1, 4


@dataclass(frozen=True)
class Problem:
    count: int
    seed: int
    """Draws the dots' positions."""

    @property
    def prompt(self) -> str:
        return IMAGE_MARKER + QUESTION

    @property
    def answer(self) -> str:
        return str(self.count)

    def centers(self, size: int = IMAGE_SIZE, radius: int = RADIUS) -> list[tuple[int, int]]:
        """Dot centres: inside the picture with a 1-pixel margin, at least 2 pixels apart."""
        rng = random.Random(f"dots:{self.seed}:{self.count}")
        lo, hi = radius + 1, size - radius - 2
        while True:
            pts: list[tuple[int, int]] = []
            for _ in range(200):
                p = (rng.randint(lo, hi), rng.randint(lo, hi))
                if all((p[0] - q[0]) ** 2 + (p[1] - q[1]) ** 2 >= (2 * radius + 2) ** 2 for q in pts):
                    pts.append(p)
                    if len(pts) == self.count:
                        return pts

    def image(self, size: int = IMAGE_SIZE, radius: int = RADIUS) -> Image:
        from PIL import Image, ImageDraw

        img = Image.new("RGB", (size, size), "white")
        draw = ImageDraw.Draw(img)
        for x, y in self.centers(size, radius):
            draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill="black")
        return img

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.image().save(buf, format="PNG")
        return buf.getvalue()


def problems(count: int, seed: int = 0) -> list[Problem]:
    """`count` problems, the dot counts cycling through 1..4, positions drawn from `seed`."""
    return [Problem(MIN_DOTS + i % (MAX_DOTS - MIN_DOTS + 1), seed * 1_000_003 + i) for i in range(count)]


def split(seed: int = 0, train: int = 4000, held_out: int = 400) -> tuple[list[Problem], list[Problem]]:
    """Training and held-out problems (disjoint position seeds)."""
    both = problems(train + held_out, seed)
    return both[:train], both[train:]


def reward(response: str, ground_truth: Any) -> float:
    """1.0 if the stripped response is the count."""
    return 1.0 if ground_truth is not None and response.strip() == str(ground_truth).strip() else 0.0


def verl_row(p: Problem, index: int) -> dict[str, Any]:
    """One row in verl's multimodal format: the PNG in `images`, `<image>` in the prompt."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": p.prompt}],
        "images": [{"bytes": p.png()}],
        "ability": "counting",
        "reward_model": {"style": "rule", "ground_truth": p.answer},
        "extra_info": {"index": index},
    }


def mixed_rows(
    arith_problems: Sequence[arith.Problem], dots_problems: Sequence[Problem], seed: int = 0
) -> list[dict[str, Any]]:
    """Both tasks' rows, shuffled together; text rows have `images: None`."""
    rows = [{**arith.verl_row(p, i), "images": None} for i, p in enumerate(arith_problems)]
    rows += [verl_row(p, i) for i, p in enumerate(dots_problems)]
    random.Random(seed).shuffle(rows)
    return rows


def write_rows(rows: Iterable[dict[str, Any]], path: Path) -> Path:
    """Rows to .parquet (image bytes as binary, as verl stores them) or .jsonl (image bytes as
    base64 strings, which kubedistill's reader takes too)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys = list(dict.fromkeys(k for r in rows for k in r))  # every column in every row
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    elif path.suffix == ".jsonl":

        def jsonable(row: dict[str, Any]) -> dict[str, Any]:
            if row.get("images"):
                row = {**row, "images": [base64.b64encode(img["bytes"]).decode() for img in row["images"]]}
            return row

        with path.open("w") as f:
            for r in rows:
                f.write(json.dumps(jsonable(r)) + "\n")
    else:
        raise ValueError(f"{path}: write .parquet or .jsonl")
    return path


def write_dataset(dots_problems: Sequence[Problem], path: Path) -> Path:
    """The image task alone."""
    return write_rows((verl_row(p, i) for i, p in enumerate(dots_problems)), path)


def write_mixed(
    path: Path, arith_problems: Sequence[arith.Problem], dots_problems: Sequence[Problem], seed: int = 0
) -> Path:
    """One dataset holding the image task's rows and the arithmetic task's text rows."""
    return write_rows(mixed_rows(arith_problems, dots_problems, seed), path)


# ---- supervised training of a tiny VL model (a vision teacher, a warm start) --------------------
def _prompt_text(processor: ProcessorMixin) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text: str = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text


def encode(processor: ProcessorMixin, batch: Sequence[Problem], answers: bool = True) -> dict[str, torch.Tensor]:
    """The processor's tensors for `batch` (every prompt has the same length: one image size),
    with `labels` on the answer and <eos> when `answers`."""
    tok = processor.tokenizer
    prompt = _prompt_text(processor)
    texts = [prompt + (p.answer + tok.eos_token if answers else "") for p in batch]
    enc = processor(text=texts, images=[p.image() for p in batch], return_tensors="pt", add_special_tokens=False)
    out = dict(enc)
    if answers:
        labels = enc["input_ids"].clone()
        prompt_len = labels.shape[1] - len(tok(batch[0].answer, add_special_tokens=False).input_ids) - 1
        labels[:, :prompt_len] = -100
        out["labels"] = labels
    return out


def train_supervised(
    model: PreTrainedModel,
    processor: ProcessorMixin,
    train: Sequence[Problem],
    steps: int,
    *,
    lr: float = 3e-3,
    batch_size: int = 32,
    warmup: int = 20,
    seed: int = 0,
    on_step: Callable[[int, float], object] | None = None,
) -> None:
    """AdamW with warm-up then cosine decay to 0; `on_step(step, loss)` after every step."""
    rng = random.Random(seed)
    problems = list(train)
    train_loop(
        model,
        lambda: encode(processor, rng.sample(problems, batch_size)),
        steps,
        lr=lr,
        warmup=warmup,
        on_step=on_step,
    )


def greedy_answers(
    model: PreTrainedModel, processor: ProcessorMixin, batch: Sequence[Problem], batch_size: int = 100
) -> list[str]:
    """Greedy completions (up to 2 tokens) of each problem's prompt."""
    import torch

    tok = processor.tokenizer
    out: list[str] = []
    with torch.no_grad():
        for i in range(0, len(batch), batch_size):
            enc = encode(processor, batch[i : i + batch_size], answers=False)
            gen = model.generate(
                **enc, max_new_tokens=2, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
            )
            width = enc["input_ids"].shape[1]
            out.extend(tok.decode(g[width:], skip_special_tokens=True) for g in gen)
    return out


def accuracy(model: PreTrainedModel, processor: ProcessorMixin, batch: Sequence[Problem]) -> float:
    answers = greedy_answers(model, processor, batch)
    return sum(reward(a, p.answer) for a, p in zip(answers, batch)) / len(batch)
