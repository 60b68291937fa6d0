"""The step's time budget (runtime/driver/phases.py): laps charged to phases, split by reports."""

from __future__ import annotations

import pytest

from kubedistill.runtime.driver.phases import STEP_PHASES, StepClock, sync_parts
from kubedistill.runtime.weight_sync.times import SyncTimes


class Ticks:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_laps_cover_the_step_and_reports_split_them_without_exceeding_them() -> None:
    t = Ticks()
    clock = StepClock(t)
    clock.start()
    t.now += 0.5
    assert clock.lap("wait") == pytest.approx(0.5)
    t.now += 1.0
    clock.lap("train_other", {"train_compute": 0.75})
    t.now += 0.25
    # A sender that reports more than the lap (clock skew, a bug) cannot stretch the step.
    clock.lap("sync_resume", sync_parts(SyncTimes(pause=0.1, transfer=0.1, load=0.2, resume=0.05)))
    phases = clock.close()
    assert list(phases) == list(STEP_PHASES)
    assert phases["wait"] == pytest.approx(0.5)
    assert (phases["train_compute"], phases["train_other"]) == pytest.approx((0.75, 0.25))
    assert (phases["sync_pause"], phases["sync_transfer"], phases["sync_load"]) == pytest.approx((0.1, 0.1, 0.05))
    assert phases["sync_resume"] == 0
    assert sum(phases.values()) == pytest.approx(1.75)
    assert clock.mark == t.now
    assert sum(clock.close().values()) == 0  # the next step starts empty


def test_an_unknown_phase_is_refused() -> None:
    clock = StepClock(Ticks())
    with pytest.raises(KeyError, match="not a step phase"):
        clock.lap("sync")
