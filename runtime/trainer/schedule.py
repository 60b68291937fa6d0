"""Learning-rate schedule: linear warm-up, then constant, cosine or linear decay (spec.trainer.optim)."""

from __future__ import annotations

import math

from kubedistill.api.spec import DistillationJobSpec, LrSchedule, OptimSpec


def updates_per_step(spec: DistillationJobSpec) -> int:
    """Optimiser updates per train step: one per mini-batch, async.requireBatches of them."""
    return spec.async_settings.require_batches


def lr_factor(step: int, optim: OptimSpec, total_steps: int) -> float:
    """Multiplier of optim.lr at the train step with 0-based index `step` (every optimiser update
    of the step, one per mini-batch, uses it: warm-up and decay count train steps).

    Warm-up ramps (step + 1) / warmupSteps so the first step already learns; decay runs from the
    end of warm-up to total_steps, ending at minLrRatio.
    """
    warmup = optim.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    schedule = optim.schedule
    if schedule is LrSchedule.constant:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = optim.min_lr_ratio
    if schedule is LrSchedule.cosine:
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule is LrSchedule.linear:
        return floor + (1.0 - floor) * (1.0 - progress)
    raise ValueError(f"trainer.optim.schedule must be constant, cosine or linear, got {schedule.value!r}")
