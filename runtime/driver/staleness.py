"""Staleness arithmetic of the training modes (docs/design.md#staleness; docs/algorithms.md,
"Staleness and off-policy correction"). Pure functions: no clock, no I/O.

Units. A *sample* is one response (a prompt with n responses is a group of n samples). A *weight
version* is the number of trainer -> rollout weight syncs done so far (0 = the initial weights);
it is what the rollout servers stamp on every token and report at /version. A *sync interval*
is the time between two syncs: `triggerParameterSyncStep` train steps.

The bound. The trainer consumes `required = requireBatches x miniBatchSize` samples per step.
Between two syncs the rollout side may hold at most

    maxRequired = floor(required x (stalenessThreshold + 1) x triggerParameterSyncStep)

samples generated (or being generated) under weights older than the next sync: at each sync the
count restarts at the samples still buffered or in flight, every submission adds its samples,
and generation pauses while one more group would exceed the bound. Because the trainer eats
`required x triggerParameterSyncStep` samples per interval, a sample that completes in order
is trained on at most `ceil(maxRequired / (required x triggerParameterSyncStep)) - 1` versions
after the oldest version that produced one of its tokens. Samples lagging more than that (long
stragglers, or samples resumed across several syncs) are dropped and counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING

from kubedistill.api.spec import Mode

if TYPE_CHECKING:
    from kubedistill.api.spec import DistillationJobSpec


def required_samples(mini_batch_size: int, require_batches: int = 1) -> int:
    """Samples the trainer consumes per train step."""
    if mini_batch_size < 1 or require_batches < 1:
        raise ValueError(f"miniBatchSize ({mini_batch_size}) and requireBatches ({require_batches}) must be >= 1")
    return mini_batch_size * require_batches


def max_required_samples(required: int, staleness_threshold: float, trigger_parameter_sync_step: int) -> int:
    """`floor(required x (threshold + 1) x trigger)`: samples allowed under old weights.

    The threshold is a YAML float (0.5, 0.29, ...); it is read through its decimal repr so that
    e.g. 100 x 1.29 gives 129, not the 128 that binary floating point would floor to.
    """
    if staleness_threshold < 0:
        raise ValueError(f"stalenessThreshold must be >= 0, got {staleness_threshold}")
    if trigger_parameter_sync_step < 1:
        raise ValueError(f"triggerParameterSyncStep must be >= 1, got {trigger_parameter_sync_step}")
    exact = Decimal(required) * (Decimal(repr(float(staleness_threshold))) + 1) * trigger_parameter_sync_step
    return int(exact.to_integral_value(rounding="ROUND_FLOOR"))


def max_version_lag(max_required: int, required: int, trigger_parameter_sync_step: int) -> int:
    """Largest `trainer_version - sample_min_version` of a sample completed in submission order.

    A submission's place in the count is below `max_required`; the trainer consumes
    `required x trigger` samples per version, so the sample is trained within
    `ceil(max_required / (required x trigger)) - 1` versions of the one it started under.
    """
    per_version = required * trigger_parameter_sync_step
    return max(0, -(-max_required // per_version) - 1)


def in_flight_limit(required: int, oversample: float, group_size: int, max_required: int) -> int:
    """Samples generating at once: `ceil(required x oversample)` rounded up to whole groups,
    never above the staleness bound (rounded down to whole groups) nor below one group."""
    if oversample < 1.0:
        raise ValueError(f"oversample must be >= 1.0, got {oversample}")
    wanted = math.ceil(Decimal(required) * Decimal(repr(float(oversample))))
    wanted = -(-wanted // group_size) * group_size
    cap = max(group_size, (max_required // group_size) * group_size)
    return min(wanted, cap)


def version_lag(trainer_version: int, min_version: int) -> int:
    """How many weight versions a sample's oldest token lags the trainer."""
    return trainer_version - min_version


def is_too_stale(trainer_version: int, min_version: int, max_lag: int) -> bool:
    return version_lag(trainer_version, min_version) > max_lag


def may_submit(stale_count: int, in_flight: int, group_size: int, max_required: int, in_flight_cap: int) -> bool:
    """Whether one more group of `group_size` samples may start generating now.

    `stale_count` is the count of the staleness rule (samples buffered or in flight at the last
    sync plus every sample submitted since); `in_flight` the samples the cap counts right now
    (see StalenessPolicy.cap_counts_generating).
    """
    return stale_count + group_size <= max_required and in_flight + group_size <= in_flight_cap


@dataclass(frozen=True)
class StalenessPolicy:
    """The numbers one job's driver runs with, derived once from its spec."""

    mode: Mode
    group_size: int
    """rollout.sampling.samplesPerPrompt: samples per prompt, generated and trained as one group."""
    required: int
    """Samples per train step (requireBatches x miniBatchSize)."""
    trigger_parameter_sync_step: int
    """Train steps between weight syncs."""
    max_required: int
    """Samples allowed under old weights (the pause bound)."""
    max_lag: int
    """Largest version lag a trained sample may have; older samples are dropped."""
    in_flight_cap: int
    """Samples generating at once."""
    cap_counts_generating: bool
    """fullyAsync: the in-flight cap counts only samples still generating, so a group's finished
    samples waiting for a long sibling leave room for new work (generation stays continuous).
    sync/oneStepOff: it counts every sample of an unfinished group (lock-step batches)."""
    partial_rollout: bool
    """Interrupt in-flight generations at a sync and continue them under the new weights."""

    @classmethod
    def build(
        cls,
        *,
        mode: Mode | str,
        group_size: int,
        mini_batch_size: int,
        require_batches: int = 1,
        staleness_threshold: float = 0.0,
        trigger_parameter_sync_step: int = 1,
        oversample: float = 1.0,
        partial_rollout: bool = False,
    ) -> StalenessPolicy:
        """The policy of a mode. sync is staleness 0 with a sync after every step; oneStepOff is
        threshold 1 with a sync after every step (the next step's batch is generated while this
        one trains, so every sample is one version old); fullyAsync takes the spec's numbers.
        `mode` may be spec.mode's value (sync, oneStepOff, fullyAsync)."""
        if group_size < 1:
            raise ValueError(f"rollout.sampling.samplesPerPrompt must be >= 1, got {group_size}")
        if mini_batch_size % group_size:
            raise ValueError(
                f"trainer.miniBatchSize ({mini_batch_size}) must be a multiple of "
                f"rollout.sampling.samplesPerPrompt ({group_size})"
            )
        try:
            mode = Mode(mode)
        except ValueError:
            raise ValueError(f"spec.mode must be sync, oneStepOff or fullyAsync, got {mode!r}") from None
        if mode is Mode.sync:
            staleness_threshold, trigger_parameter_sync_step, oversample, partial_rollout = 0.0, 1, 1.0, False
        elif mode is Mode.one_step_off:
            staleness_threshold, trigger_parameter_sync_step, partial_rollout = 1.0, 1, False
        required = required_samples(mini_batch_size, require_batches)
        bound = max_required_samples(required, staleness_threshold, trigger_parameter_sync_step)
        return cls(
            mode=mode,
            group_size=group_size,
            required=required,
            trigger_parameter_sync_step=trigger_parameter_sync_step,
            max_required=bound,
            max_lag=max_version_lag(bound, required, trigger_parameter_sync_step),
            in_flight_cap=in_flight_limit(required, oversample, group_size, bound),
            cap_counts_generating=mode is Mode.fully_async,
            partial_rollout=partial_rollout,
        )

    @classmethod
    def from_spec(cls, spec: DistillationJobSpec) -> StalenessPolicy:
        a = spec.async_settings
        return cls.build(
            mode=spec.mode,
            group_size=spec.rollout.sampling.samples_per_prompt,
            mini_batch_size=spec.trainer.mini_batch_size,
            require_batches=a.require_batches,
            staleness_threshold=a.staleness_threshold or 0.0,
            trigger_parameter_sync_step=a.trigger_parameter_sync_step,
            oversample=a.oversample,
            partial_rollout=a.partial_rollout,
        )

    def may_submit(self, stale_count: int, in_flight: int, group_size: int | None = None) -> bool:
        return may_submit(stale_count, in_flight, group_size or self.group_size, self.max_required, self.in_flight_cap)

    def is_too_stale(self, trainer_version: int, min_version: int) -> bool:
        return is_too_stale(trainer_version, min_version, self.max_lag)
