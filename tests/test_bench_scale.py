"""bench/fleet_sim.py, small: the real driver fed over HTTP by fake rollout and teacher servers
that speak the product's protocol, with the weight sender's real control messages. The sweeps
(bench/scale.py) stay out of CI."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # after everything else: bench/operator.py

import fleet_sim  # noqa: E402


def test_the_answer_lengths_follow_the_asked_median_and_p99() -> None:
    lengths = sorted(fleet_sim.FleetShape(median_tokens=1024, p99_tokens=8192, pool=200).lengths())
    assert lengths[100] == 1024 or abs(lengths[99] - 1024) / 1024 < 0.05
    assert abs(lengths[198] - 8192) / 8192 < 0.15


def test_a_small_simulated_fleet_feeds_the_trainer_and_syncs_every_step(tmp_path: Path) -> None:
    fleet = fleet_sim.FleetShape(
        rollouts=2, teachers=1, rate=40_000, request_rate=10_000, median_tokens=48, p99_tokens=192, top_k=8,
        prompt_tokens=12, transfer_seconds=0.01, load_seconds=0.01, pool=8, fake_procs=1,
    )  # fmt: skip
    job = fleet_sim.JobShape(step_seconds=0.1, required=8, n=2, seconds=2.0, warmup=1.5)
    out = asyncio.run(fleet_sim.run_point(fleet, job, cache=tmp_path))
    assert out["ended"] == ""
    assert out["steps"] >= 2, out
    assert out["trained_samples_per_s"] > 0 and out["trained_tokens_per_s"] > 0, out
    assert out["ingested_samples_per_s"] > 0 and out["cpu_ms_per_1k_tokens"] > 0, out
    # One sync after every step: POST /weights/begin to every fake, GET /version?at_least answered.
    assert out["synced_version"] >= out["steps"], out


def test_rank_0_settles_its_collector_for_the_run() -> None:
    """What the driver's process was made of moves to the permanent generation and collections
    run less often (runtime/entrypoints/trainer.py, before the driver runs)."""
    import gc

    from kubedistill.runtime.entrypoints.trainer import GC_THRESHOLDS, settle_gc

    saved = gc.get_threshold()
    try:
        settle_gc()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)
