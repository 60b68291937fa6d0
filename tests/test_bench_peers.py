"""bench/peers.py's pure logic: where the clocks start and how time to target is read off a
curve. The benchmark itself stays out of CI (it runs two training stacks for minutes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # after everything else: bench/operator.py

import peers  # noqa: E402


def test_time_to_target_interpolates_between_the_points_around_the_first_crossing() -> None:
    curve = [(0.0, 0.3), (10.0, 0.5), (20.0, 0.9), (30.0, 0.7), (40.0, 0.95)]
    assert peers.first_time_at_or_above(curve, 0.8) == pytest.approx(17.5)
    assert peers.first_time_at_or_above(curve, 0.3) == 0.0
    assert peers.first_time_at_or_above(curve, 0.99) is None


def test_clock_zero_is_the_tightest_bound_over_the_lines_seen() -> None:
    # Zero at wall 100.0; lines seen 0.05-0.3 s after they were written.
    seen = [(100.0 + stamp + lag, stamp) for stamp, lag in [(1.0, 0.3), (2.0, 0.05), (3.0, 0.1)]]
    assert peers.clock_zero(seen) == pytest.approx(100.05)


def test_run_time_to_target_uses_the_train_clock_and_step_zero() -> None:
    run = peers.Run("1", "TRL", 0, launch=0.0, zero=10.0, exit=50.0)
    run.step_end = {s: s * 0.1 for s in range(1, 201)}
    run.accuracy = {0: 0.33, 100: 0.6, 150: 0.76, 200: 0.86}
    assert run.time_to(0.8) == pytest.approx(15.0 + 5.0 * 0.4)
    assert run.startup == 10.0 and run.command == 50.0 and run.train == pytest.approx(20.0)
    assert run.per_step == pytest.approx(0.1)


def test_repeats_alternate_which_side_goes_first_and_evaluation_ends_on_the_last_step() -> None:
    order = [side for r in range(2) for side in peers.ordered_sides(r)]
    assert order == ["kubedistill", "TRL", "TRL", "kubedistill"]
    assert peers.eval_steps(200, 25)[-2:] == [175, 200]
    assert peers.eval_steps(30, 25) == [25, 30]
