"""Staleness arithmetic (docs/design.md#staleness) against hand-computed numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubedistill.api.validate import load_job
from kubedistill.runtime.driver.staleness import (
    StalenessPolicy,
    in_flight_limit,
    is_too_stale,
    max_required_samples,
    max_version_lag,
    may_submit,
    required_samples,
)

ROOT = Path(__file__).resolve().parent.parent


def test_bound_formula_hand_computed() -> None:
    # required = requireBatches x miniBatchSize; maxRequired = required x (s + 1) x trigger
    assert required_samples(16, 1) == 16
    assert required_samples(16, 3) == 48
    assert max_required_samples(16, 0.5, 4) == 96  # 16 x 1.5 x 4
    assert max_required_samples(64, 0.5, 1) == 96  # 64 x 1.5
    assert max_required_samples(10, 0.0, 3) == 30
    assert max_required_samples(10, 0.25, 1) == 12  # floor(12.5)
    # 100 x 1.29 is 128.99999999999997 in binary floating point; the rule reads 0.29 as written.
    assert max_required_samples(100, 0.29, 1) == 129


def test_version_lag_bound_hand_computed() -> None:
    # ceil(maxRequired / (required x trigger)) - 1
    assert max_version_lag(16, 16, 1) == 0  # s = 0: trained under the version that generated it
    assert max_version_lag(32, 16, 1) == 1  # s = 1
    assert max_version_lag(96, 16, 4) == 1  # s = 0.5, trigger 4: 96 / 64 -> 2 - 1
    assert max_version_lag(48, 16, 1) == 2  # s = 2
    assert max_version_lag(40, 16, 1) == 2  # s = 1.5: ceil(2.5) - 1


def test_in_flight_limit() -> None:
    assert in_flight_limit(16, 1.0, 4, 96) == 16
    assert in_flight_limit(16, 1.3, 4, 96) == 24  # ceil(20.8) = 21 -> whole groups of 4 -> 24
    assert in_flight_limit(16, 10.0, 4, 96) == 96  # never above the staleness bound
    assert in_flight_limit(16, 1.0, 4, 2) == 4  # never below one group
    with pytest.raises(ValueError, match="oversample"):
        in_flight_limit(16, 0.5, 4, 96)


def test_may_submit_and_drop_rule() -> None:
    assert may_submit(stale_count=92, in_flight=0, group_size=4, max_required=96, in_flight_cap=16)
    assert not may_submit(stale_count=93, in_flight=0, group_size=4, max_required=96, in_flight_cap=16)
    assert not may_submit(stale_count=0, in_flight=16, group_size=4, max_required=96, in_flight_cap=16)
    assert not is_too_stale(trainer_version=5, min_version=4, max_lag=1)
    assert is_too_stale(trainer_version=5, min_version=3, max_lag=1)


def test_policies_of_the_three_modes() -> None:
    sync = StalenessPolicy.build(
        mode="sync",
        group_size=4,
        mini_batch_size=16,
        staleness_threshold=3.0,
        trigger_parameter_sync_step=5,
        partial_rollout=True,
    )
    assert (sync.required, sync.max_required, sync.max_lag, sync.in_flight_cap) == (16, 16, 0, 16)
    assert sync.trigger_parameter_sync_step == 1 and not sync.partial_rollout
    one = StalenessPolicy.build(mode="oneStepOff", group_size=4, mini_batch_size=16, staleness_threshold=3.0)
    assert (one.required, one.max_required, one.max_lag, one.trigger_parameter_sync_step) == (16, 32, 1, 1)
    full = StalenessPolicy.build(
        mode="fullyAsync",
        group_size=4,
        mini_batch_size=16,
        require_batches=2,
        staleness_threshold=1.0,
        trigger_parameter_sync_step=2,
        oversample=1.5,
        partial_rollout=True,
    )
    # required 32; bound 32 x 2 x 2 = 128; lag ceil(128 / 64) - 1 = 1; in flight ceil(48) -> 48
    assert (full.required, full.max_required, full.max_lag, full.in_flight_cap) == (32, 128, 1, 48)
    assert full.partial_rollout
    with pytest.raises(ValueError, match="multiple of rollout.sampling.samplesPerPrompt"):
        StalenessPolicy.build(mode="sync", group_size=3, mini_batch_size=16)
    with pytest.raises(ValueError, match="spec.mode"):
        StalenessPolicy.build(mode="async", group_size=1, mini_batch_size=16)


def test_policy_from_example_specs() -> None:
    multi = StalenessPolicy.from_spec(load_job(ROOT / "examples/multi-teacher-6gpu.yaml").spec)
    # miniBatchSize 16, n 4, s 0.5, trigger 4 -> 16 x 1.5 x 4 = 96 samples, lag 1
    assert (multi.mode, multi.required, multi.max_required, multi.max_lag, multi.in_flight_cap) == (
        "fullyAsync",
        16,
        96,
        1,
        16,
    )
    quick = StalenessPolicy.from_spec(load_job(ROOT / "examples/quickstart-cpu.yaml").spec)
    # miniBatchSize 64, s 1.0, trigger 1 -> 64 x 2 x 1 = 128 samples, lag 1
    assert (quick.required, quick.max_required, quick.max_lag) == (64, 128, 1)
    one_gpu = StalenessPolicy.from_spec(load_job(ROOT / "examples/one-gpu.yaml").spec)
    assert (one_gpu.mode, one_gpu.max_required, one_gpu.max_lag) == ("sync", 32, 0)
