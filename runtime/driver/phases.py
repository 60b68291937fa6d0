"""A train step's time budget (docs/design.md#step-time-budget): where trainer rank 0's wall time
goes, step by step, split finely enough to show fixed costs.

The driver's training side runs one step after another; a :class:`StepClock` cuts that timeline
into laps, each charged to one phase, so the phases of a step add up to its wall time (from the
end of the previous step to the end of this one). Two laps are split further by what the
component that ran them reports: the trainer's call into its optimiser compute and the rest, a
weight sync into the sender's four segments (:class:`SyncTimes`). `gen` and `score` are not step
phases: they are per-sample latencies on the generation side, which overlaps the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kubedistill.runtime.weight_sync.times import SyncTimes

STEP_PHASES = (
    "wait",
    "train_compute",
    "train_other",
    "eval",
    "sync_pause",
    "sync_transfer",
    "sync_load",
    "sync_resume",
    "checkpoint",
    "driver",
)
"""The phases of a step, in the order they happen; every step reports each (0 when it did not
happen), so a mean per phase is a mean per step. `eval`: the wait, before a sync, for the held-out
evaluation of the weights being replaced to finish (runtime/driver/evaluation.py)."""

SAMPLE_PHASES = ("gen", "score")
"""Per-sample latencies of the generation side (`kubedistill_step_seconds` too, not step phases)."""


class StepClock:
    """Cuts the training side's timeline into laps charged to STEP_PHASES. `lap(phase)` charges
    the time since the previous mark; `close()` ends the step at the last mark and returns its
    budget (every phase, 0 when absent)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._mark = clock()
        self._phases: dict[str, float] = dict.fromkeys(STEP_PHASES, 0.0)

    def start(self, at: float | None = None) -> None:
        """Start the first step at `at` (default now), forgetting anything charged so far."""
        self._mark = self.clock() if at is None else at
        self._phases = dict.fromkeys(STEP_PHASES, 0.0)

    def lap(self, phase: str, parts: Mapping[str, float] | None = None) -> float:
        """Charge the time since the previous mark: first `parts` (what whoever ran the lap reports
        of it, each capped by what is left of the lap, so the lap keeps the length the clock
        measured), the rest to `phase`. Returns the lap's length."""
        now = self.clock()
        seconds = now - self._mark
        self._mark = now
        left = seconds
        for part, reported in (parts or {}).items():
            share = min(max(reported, 0.0), left)
            self._charge(part, share)
            left -= share
        self._charge(phase, left)
        return seconds

    def _charge(self, phase: str, seconds: float) -> None:
        if phase not in self._phases:
            raise KeyError(f"{phase!r} is not a step phase ({', '.join(STEP_PHASES)})")
        self._phases[phase] += seconds

    @property
    def mark(self) -> float:
        """When the last lap ended."""
        return self._mark

    def close(self) -> dict[str, float]:
        """The step's budget, ending at the last mark (which starts the next step)."""
        out, self._phases = self._phases, dict.fromkeys(STEP_PHASES, 0.0)
        return out


def sync_parts(times: SyncTimes) -> dict[str, float]:
    """A sync's segments as the step phases they are charged to."""
    return {
        "sync_pause": times.pause,
        "sync_transfer": times.transfer,
        "sync_load": times.load,
        "sync_resume": times.resume,
    }
