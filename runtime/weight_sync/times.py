"""Where the trainer's time in one weight sync goes (docs/design.md#step-time-budget)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncTimes:
    """The trainer's side of one weight sync, in four consecutive segments (seconds)."""

    pause: float = 0.0
    """Until every rollout server has paused generation and entered the receive: the group check
    and the /weights/begin round trips, which each server answers once paused."""
    transfer: float = 0.0
    """Broadcasting the buckets (on the trainer: until its last bucket is sent)."""
    load: float = 0.0
    """Until every receiver has loaded the weights (the closing failure all-reduce)."""
    resume: float = 0.0
    """Until every server serves the new version and has resumed generation."""

    @property
    def total(self) -> float:
        return self.pause + self.transfer + self.load + self.resume
