"""What a train step reports: per-rank sums over its micro-batches (:class:`StepSums`), summed over
ranks into :class:`StepStats`, and the trainer's Prometheus metrics of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kubedistill.runtime.metrics import RoleMetrics
    from kubedistill.runtime.trainer.microbatch import MicroBatch


@dataclass
class StepStats:
    """What one train step did (global over ranks; identical on every rank)."""

    step: int
    """Completed optimiser steps after this one (1-based)."""
    loss_total: float
    loss_distill: float
    loss_pg: float
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    samples: int
    tokens: int
    """Prompt + response tokens forwarded (no padding)."""
    response_tokens: int
    kl: float | None
    """Mean k1 = s - T over response tokens: the reverse KL(student || teacher) estimate
    (None when the batch has no teacher log-probs of the sampled tokens)."""
    seconds: float
    tokens_per_second: float


@dataclass
class StepSums:
    """One rank's sums over the micro-batches of a step; :meth:`all_reduce` sums them over ranks.

    Float64 throughout, as one tensor when reduced, so the global values do not depend on how
    the batch was split. Filler micro-batches (zero loss weights) add nothing.
    """

    loss_total: float = 0.0
    """Sum of per-token loss x loss weight / world size (the trainer scales the weights by the
    world size for FSDP's gradient averaging; this undoes it)."""
    loss_distill: float = 0.0
    loss_pg: float = 0.0
    kl_sum: float = 0.0
    """Sum of k1 = s - T over response tokens that have teacher log-probs."""
    kl_tokens: float = 0.0
    """The response tokens counted in kl_sum."""
    tokens: float = 0.0
    """Prompt + response tokens forwarded (no padding)."""
    response_tokens: float = 0.0

    def add(
        self, mb: MicroBatch, losses: Mapping[str, torch.Tensor], logprobs: torch.Tensor, world: int, filler: bool
    ) -> None:
        """Add micro-batch `mb`, given its per-token `losses` and the student's `logprobs`."""
        with torch.no_grad():
            w = mb.weights.double() / world
            self.loss_total += float((losses["total"].double() * w).sum())
            self.loss_distill += float((losses["distill"].double() * w).sum())
            self.loss_pg += float((losses["pg"].double() * w).sum())
            if filler:
                return
            if mb.teacher_logprobs is not None:
                self.kl_sum += float((logprobs.detach().double() - mb.teacher_logprobs.double()).sum())
                self.kl_tokens += logprobs.numel()
            self.tokens += mb.real_tokens
            self.response_tokens += logprobs.numel()

    def all_reduce(self, sum_over_ranks: Callable[[torch.Tensor], None]) -> StepSums:
        """The sums over every rank; `sum_over_ranks` sums a float64 tensor over ranks in place."""
        packed = torch.tensor(astuple(self), dtype=torch.float64)
        sum_over_ranks(packed)
        return StepSums(*packed.tolist())

    @property
    def kl(self) -> float | None:
        return self.kl_sum / self.kl_tokens if self.kl_tokens > 0 else None


def record_step(metrics: RoleMetrics, s: StepStats) -> None:
    metrics["step"].set(s.step)
    metrics["step_seconds"].labels(phase="train").observe(s.seconds)
    metrics["loss"].labels(kind="total").set(s.loss_total)
    metrics["loss"].labels(kind="distill").set(s.loss_distill)
    metrics["loss"].labels(kind="pg").set(s.loss_pg)
    metrics["grad_norm"].set(s.grad_norm)
    metrics["learning_rate"].set(s.lr)
    metrics["tokens_per_second"].set(s.tokens_per_second)
    if s.kl is not None:
        metrics["kl_student_teacher"].set(s.kl)
