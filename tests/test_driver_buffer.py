"""SampleBuffer: pause/resume under the staleness bound, stale drops, checkpoint round trip."""

from __future__ import annotations

import asyncio
import random

import pytest

from kubedistill.runtime.driver.buffer import BufferClosed, SampleBuffer
from kubedistill.runtime.driver.samples import SampleGroup
from kubedistill.runtime.driver.staleness import StalenessPolicy
from kubedistill.runtime.metrics import RoleMetrics


class Out:
    def __init__(self, ids, version, reason="stop"):
        self.token_ids, self.logprobs = list(ids), [-0.5] * len(ids)
        self.versions, self.finish_reason = [version] * len(ids), reason
        self.topk_ids = None


def staleness_policy(**kw) -> StalenessPolicy:
    base = dict(
        mode="fullyAsync",
        group_size=2,
        mini_batch_size=4,
        staleness_threshold=0.5,
        trigger_parameter_sync_step=1,
        oversample=2.0,
    )
    base.update(kw)
    return StalenessPolicy.build(**base)


def group(gid: int, n: int = 2) -> SampleGroup:
    return SampleGroup.for_prompt(gid, [1, 2, 3], n, max_tokens=4, data_source="arith")


def generate(g: SampleGroup, version: int) -> SampleGroup:
    for s in g.samples:
        s.continuation()
        s.extend(Out([5, 6], version))
    return g


async def test_generation_pauses_at_the_bound_and_resumes_after_a_sync() -> None:
    p = staleness_policy()  # required 4, bound 4 x 1.5 = 6 samples, lag ceil(6/4) - 1 = 1, in flight <= 6
    assert (p.required, p.max_required, p.max_lag, p.in_flight_cap) == (4, 6, 1, 6)
    buf = SampleBuffer(p)
    for gid in range(3):
        assert buf.try_reserve(group(gid))
    assert buf.stale_count == 6
    assert not buf.try_reserve(group(3))

    waiter = asyncio.create_task(buf.reserve(group(3)))
    await asyncio.sleep(0)
    for _ in range(2):
        await buf.put(generate(buf.in_flight_groups()[0], 0))
    await asyncio.sleep(0)
    assert not waiter.done()  # finished groups do not free the bound: only a sync does
    taken = await buf.take()
    assert [g.group_id for g in taken] == [0, 1]
    await asyncio.sleep(0)
    assert not waiter.done()
    await buf.synced(1)  # count restarts at buffered (0) + in flight (group 2: 2 samples)
    await asyncio.wait_for(waiter, 1)
    assert buf.stale_count == 4 and buf.in_flight == 4
    assert buf.counters == {"generated": 4, "consumed": 4, "dropped_stale": 0, "resumed": 0}


def finish(s, version: int = 0) -> None:
    s.continuation()
    s.extend(Out([5, 6], version))


@pytest.mark.parametrize("mode", ["fullyAsync", "oneStepOff"])
async def test_in_flight_cap_counts_generating_samples_in_fully_async_only(mode: str) -> None:
    """fullyAsync: a group's finished samples waiting for a long sibling free their places in the
    cap, so generation stays continuous; oneStepOff keeps whole groups (lock-step batches)."""
    p = staleness_policy(mode=mode, group_size=4, mini_batch_size=8, staleness_threshold=3.0, oversample=1.0)
    assert p.in_flight_cap == 8 and p.max_required >= 16
    buf = SampleBuffer(p)
    a, b = group(0, 4), group(1, 4)
    assert buf.try_reserve(a) and buf.try_reserve(b)
    waiter = asyncio.create_task(buf.reserve(group(2, 4)))
    for s in a.samples[:3]:
        finish(s)
        await buf.sample_finished()
    await asyncio.sleep(0)
    assert not waiter.done()  # 5 samples still generating (or counted): no room for 4 more
    finish(b.samples[0])
    await buf.sample_finished()
    await asyncio.sleep(0)
    if mode == "fullyAsync":  # 4 generating + 4 = the cap: admitted before either group is put
        await asyncio.wait_for(waiter, 1)
        assert buf.generating == 8 and buf.in_flight == 12
    else:
        assert not waiter.done()
        finish(a.samples[3])
        await buf.put(a)  # a whole group leaves: now it fits
        await asyncio.wait_for(waiter, 1)
        assert buf.in_flight == 8


async def test_take_waits_for_a_full_step_and_close_wakes_it() -> None:
    buf = SampleBuffer(staleness_policy())
    buf.try_reserve(group(0))
    await buf.put(generate(buf.in_flight_groups()[0], 0))
    waiter = asyncio.create_task(buf.take())
    await asyncio.sleep(0)
    assert not waiter.done()  # 2 of 4 samples
    await buf.close()
    with pytest.raises(BufferClosed, match="2 of 4"):
        await asyncio.wait_for(waiter, 1)


async def test_too_stale_groups_are_dropped_and_counted() -> None:
    metrics = RoleMetrics("j", "trainer", 0)
    buf = SampleBuffer(staleness_policy(), metrics=metrics)  # max lag 1
    for gid in range(3):
        buf.try_reserve(group(gid))
    g0, g1, g2 = buf.in_flight_groups()
    assert await buf.put(generate(g0, 0))
    await buf.synced(1)
    assert await buf.put(generate(g1, 1))
    # A partial rollout: first tokens under version 0, the rest under version 2.
    g2.samples[0].continuation()
    g2.samples[0].extend(Out([7], 0, "abort"))
    g2.samples[0].continuation()
    g2.samples[0].extend(Out([8], 2))
    generate_one = g2.samples[1]
    generate_one.continuation()
    generate_one.extend(Out([9], 2))
    dropped = await buf.synced(2)  # lag of g0 = 2 - 0 > 1
    assert dropped == 2 and [g.group_id for g in buf.ready_groups()] == [1]
    assert not await buf.put(g2)  # min version 0: lag 2
    assert buf.counters == {"generated": 6, "consumed": 0, "dropped_stale": 4, "resumed": 1}
    reg = metrics.registry
    labels = {"job": "j", "role": "trainer", "replica": "0"}
    assert reg.get_sample_value("kubedistill_samples_total", {**labels, "state": "dropped_stale"}) == 4
    assert reg.get_sample_value("kubedistill_samples_total", {**labels, "state": "resumed"}) == 1
    assert reg.get_sample_value("kubedistill_buffer_size", labels) == 2


async def test_take_prefers_the_oldest_version_and_records_staleness() -> None:
    metrics = RoleMetrics("j", "trainer", 0)
    buf = SampleBuffer(staleness_policy(staleness_threshold=1.0), metrics=metrics)  # bound 8, lag 1
    buf.try_reserve(group(10))
    await buf.synced(1)
    for gid in (11, 12):
        buf.try_reserve(group(gid))
    g10, g11, g12 = buf.in_flight_groups()
    await buf.put(generate(g11, 1))
    await buf.put(generate(g12, 1))
    await buf.put(generate(g10, 0))  # arrived last but generated under version 0
    taken = await buf.take()
    assert [g.group_id for g in taken] == [10, 11]
    labels = {"job": "j", "role": "trainer", "replica": "0"}
    assert metrics.registry.get_sample_value("kubedistill_staleness_count", labels) == 4
    assert metrics.registry.get_sample_value("kubedistill_staleness_sum", labels) == 2  # two samples lag 1


async def test_state_round_trip_keeps_ready_and_in_flight_samples() -> None:
    buf = SampleBuffer(staleness_policy())
    for gid in range(3):
        buf.try_reserve(group(gid))
    g0, g1, _ = buf.in_flight_groups()
    await buf.put(generate(g0, 0))
    g1.samples[0].continuation()
    g1.samples[0].extend(Out([4, 4], 0, "abort"))  # half-generated when the checkpoint is taken
    data = buf.to_bytes()

    restored = SampleBuffer(staleness_policy())
    restored.load_bytes(data)
    assert restored.state_dict() == buf.state_dict()
    assert restored.buffered == 2 and restored.in_flight == 4 and restored.stale_count == 6
    partial = restored.in_flight_groups()[0].samples[0]
    assert partial.response_ids == [4, 4] and partial.needs_resume
    assert partial.continuation().prefix_token_ids == [4, 4]
    with pytest.raises(ValueError, match="format"):
        restored.load_state_dict({"format": 99})


async def test_put_refuses_unfinished_or_unknown_groups() -> None:
    buf = SampleBuffer(staleness_policy())
    with pytest.raises(ValueError, match="not in flight"):
        await buf.put(group(5))
    g = group(6)
    buf.try_reserve(g)
    with pytest.raises(ValueError, match="not finished"):
        await buf.put(g)
    assert buf.in_flight == 2  # still registered


@pytest.mark.parametrize("threshold,trigger", [(0.0, 1), (0.5, 1), (1.0, 1), (1.0, 2), (2.0, 1)])
async def test_simulated_fully_async_run_respects_the_lag_bound(threshold: float, trigger: int) -> None:
    """A generator that completes groups in submission order and a trainer that syncs every
    `trigger` steps: no sample is trained beyond max_lag versions, none is dropped, and the
    count of samples under old weights never exceeds the bound."""
    p = staleness_policy(staleness_threshold=threshold, trigger_parameter_sync_step=trigger)
    buf = SampleBuffer(p)
    lags: list[int] = []
    rng = random.Random(0)
    steps = 12

    async def generator() -> None:
        gid = 0
        while True:
            g = group(gid)
            gid += 1
            try:
                await buf.reserve(g)
            except BufferClosed:
                return
            assert buf.stale_count <= p.max_required
            version = buf.version
            for _ in range(rng.randint(0, 2)):
                await asyncio.sleep(0)
            await buf.put(generate(g, version))

    async def trainer() -> None:
        for step in range(1, steps + 1):
            groups = await buf.take()
            lags.extend(buf.version - g.min_version for g in groups)
            await asyncio.sleep(0)
            if step % p.trigger_parameter_sync_step == 0:
                await buf.synced(buf.version + 1)
        await buf.close()

    gen = asyncio.create_task(generator())
    await asyncio.wait_for(trainer(), 5)
    await asyncio.wait_for(gen, 5)
    assert buf.counters["dropped_stale"] == 0
    assert max(lags) == p.max_lag  # the bound is reached, not just respected
    assert buf.counters["consumed"] == steps * p.required


def test_every_sample_state_is_exported_at_zero_before_its_first_sample() -> None:
    """The dashboard's stale-drop panel divides two of these rates: a job that never drops a
    sample must show 0, not "No data" (a labelled series exists only once a child is made)."""
    from prometheus_client import generate_latest

    metrics = RoleMetrics("j", "trainer", 0)
    SampleBuffer(staleness_policy(), metrics)
    text = generate_latest(metrics.registry).decode()
    for state in ("generated", "consumed", "dropped_stale", "resumed"):
        assert f'state="{state}"' in text and "kubedistill_samples_total" in text, state
