"""The supervised loop the tasks' teachers and warm starts are trained with (arith, dots): AdamW,
linear warm-up, then cosine decay to 0 or a constant LR. What a batch is stays with each task."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def train_loop(
    model: PreTrainedModel,
    next_batch: Callable[[], Mapping[str, Any]],
    steps: int,
    *,
    lr: float,
    warmup: int,
    decay: bool = True,
    betas: tuple[float, float] = (0.9, 0.98),
    on_step: Callable[[int, float], object] | None = None,
) -> None:
    """`steps` AdamW steps on `model(**next_batch()).loss`; `on_step(step, loss)` after each
    (1-based). Leaves the model in eval mode."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not decay:
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    for step in range(1, steps + 1):
        loss = model(**next_batch()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step, float(loss.detach()))
    model.eval()
