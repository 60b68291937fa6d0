"""What a train step reports: per-rank sums over its micro-batches (:class:`StepSums`), summed over
ranks into :class:`StepStats`, and the trainer's Prometheus metrics of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

from kubedistill.api.losses import Signal

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
    compute_seconds: float
    """Of `seconds` (and of a proximal pass before it): forward, loss, backward, clipping and
    AdamW, the part a faster trainer would shrink. The rest is collation and statistics."""
    tokens_per_second: float
    off_policy: dict[str, float] = field(default_factory=dict)
    """How far the samples are from the policy trained (camelCase keys, see :meth:`StepSums.off_policy`)."""


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
    # Off-policy diagnostics. Lag 0 = sampled by the very weights the trainer holds, where the
    # trainer's log-prob minus the engine's (s - mu) measures engine numerics alone.
    lag0_tokens: float = 0.0
    lag0_diff_sum: float = 0.0
    lag0_abs_diff_sum: float = 0.0
    lag0_abs_diff_max: float = field(default=0.0, metadata={"reduce": "max"})
    stale_tokens: float = 0.0
    """Tokens of samples lagging the trainer by one or more weight versions."""
    stale_diff_sum: float = 0.0
    is_weight_sum: float = 0.0
    """Importance weights applied (after truncation or masking)."""
    is_weight_max: float = field(default=0.0, metadata={"reduce": "max"})
    is_cut_tokens: float = 0.0
    """Tokens whose importance weight was truncated or masked."""
    advantage_sum: float = 0.0
    advantage_sq_sum: float = 0.0

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
            if mb.loss_mask is not None:  # the student's own tokens only: observations are not its
                keep = mb.loss_mask
                logprobs = logprobs[keep]
                losses = {k: v[keep] for k, v in losses.items() if k in ("is_weight", "is_cut", "advantage")}
                mb = replace(
                    mb,
                    behaviour_logprobs=mb.behaviour_logprobs[keep],
                    lags=mb.lags[keep] if mb.lags is not None else None,
                    signals={k: v[keep] for k, v in mb.signals.items()},
                )
            teacher = mb.signals.get(Signal.teacher_logprobs.value)
            if teacher is not None:
                self.kl_sum += float((logprobs.detach().double() - teacher.double()).sum())
                self.kl_tokens += logprobs.numel()
            self.tokens += mb.real_tokens
            self.response_tokens += logprobs.numel()
            self._add_off_policy(mb, losses, logprobs)

    def _add_off_policy(self, mb: MicroBatch, losses: Mapping[str, torch.Tensor], logprobs: torch.Tensor) -> None:
        diff = logprobs.detach().double() - mb.behaviour_logprobs.double()
        if mb.lags is not None:
            lag0, stale = mb.lags == 0, mb.lags > 0
            if bool(lag0.any()):
                d0 = diff[lag0]
                self.lag0_tokens += d0.numel()
                self.lag0_diff_sum += float(d0.sum())
                self.lag0_abs_diff_sum += float(d0.abs().sum())
                self.lag0_abs_diff_max = max(self.lag0_abs_diff_max, float(d0.abs().max()))
            self.stale_tokens += int(stale.sum())
            self.stale_diff_sum += float(diff[stale].sum())
        if "is_weight" in losses and logprobs.numel():
            w = losses["is_weight"].double()
            self.is_weight_sum += float(w.sum())
            self.is_weight_max = max(self.is_weight_max, float(w.max()))
            self.is_cut_tokens += int(losses["is_cut"].sum())
        if "advantage" in losses:
            a = losses["advantage"].double()
            self.advantage_sum += float(a.sum())
            self.advantage_sq_sum += float((a * a).sum())

    def all_reduce(
        self,
        sum_over_ranks: Callable[[torch.Tensor], None],
        max_over_ranks: Callable[[torch.Tensor], None] | None = None,
    ) -> StepSums:
        """The totals over every rank: `sum_over_ranks` sums a float64 tensor over ranks in place,
        `max_over_ranks` takes the element-wise maximum (the fields marked reduce=max)."""
        summed = [f.name for f in fields(self) if f.metadata.get("reduce") != "max"]
        maxed = [f.name for f in fields(self) if f.metadata.get("reduce") == "max"]
        sums = torch.tensor([getattr(self, n) for n in summed], dtype=torch.float64)
        maxima = torch.tensor([getattr(self, n) for n in maxed], dtype=torch.float64)
        sum_over_ranks(sums)
        if max_over_ranks is not None:
            max_over_ranks(maxima)
        return StepSums(**dict(zip(summed, sums.tolist())), **dict(zip(maxed, maxima.tolist())))

    def off_policy(self) -> dict[str, float]:
        """The step's off-policy diagnostics (docs/learning.md explains each), for the history."""
        out: dict[str, float] = {}
        if self.lag0_tokens:
            out["lag0Tokens"] = self.lag0_tokens
            out["logprobDiffLag0Mean"] = self.lag0_diff_sum / self.lag0_tokens
            out["logprobDiffLag0AbsMean"] = self.lag0_abs_diff_sum / self.lag0_tokens
            out["logprobDiffLag0AbsMax"] = self.lag0_abs_diff_max
        if self.stale_tokens:
            out["staleTokens"] = self.stale_tokens
            out["logprobDiffStaleMean"] = self.stale_diff_sum / self.stale_tokens
        if self.response_tokens:
            n = self.response_tokens
            mean = self.advantage_sum / n
            out["isWeightMean"] = self.is_weight_sum / n
            out["isWeightMax"] = self.is_weight_max
            out["isCutFraction"] = self.is_cut_tokens / n
            out["advantageMean"] = mean
            out["advantageStd"] = max(self.advantage_sq_sum / n - mean * mean, 0.0) ** 0.5
        return out

    @property
    def kl(self) -> float | None:
        return self.kl_sum / self.kl_tokens if self.kl_tokens > 0 else None

    def stats(
        self, step: int, *, grad_norm: float, lr: float, samples: int, seconds: float, compute_seconds: float
    ) -> StepStats:
        """The step's StepStats from these totals (all_reduce's) and what the step timed."""
        tokens = int(self.tokens)
        return StepStats(
            step=step,
            loss_total=self.loss_total,
            loss_distill=self.loss_distill,
            loss_pg=self.loss_pg,
            grad_norm=grad_norm,
            lr=lr,
            samples=samples,
            tokens=tokens,
            response_tokens=int(self.response_tokens),
            kl=self.kl,
            seconds=seconds,
            compute_seconds=compute_seconds,
            tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
            off_policy=self.off_policy(),
        )


def record_step(metrics: RoleMetrics, s: StepStats) -> None:
    metrics["step"].set(s.step)
    metrics["loss"].labels(kind="total").set(s.loss_total)
    metrics["loss"].labels(kind="distill").set(s.loss_distill)
    metrics["loss"].labels(kind="pg").set(s.loss_pg)
    metrics["grad_norm"].set(s.grad_norm)
    metrics["learning_rate"].set(s.lr)
    metrics["tokens_per_second"].set(s.tokens_per_second)
    if s.kl is not None:
        metrics["kl_student_teacher"].set(s.kl)
