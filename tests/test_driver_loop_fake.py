"""The driver's real loop (runtime/driver/loop.py) in-process, against fake rollout and teacher
servers, a fake weight sender and a fake trainer (tests/driver_fakes.py): staleness bounds per
mode, partial-rollout resume, servers that die and come back, scale-up and drain. Each run takes
well under a second; test_e2e_modes.py and test_e2e_scaling.py run the same paths through real
processes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest

from driver_fakes import (
    FakeRolloutServer,
    FakeTeacherServer,
    Rig,
    job_spec,
    refused,
    rig,
    token_at,
    until,
    versions_of,
)
from kubedistill.runtime.driver.routing import MAX_TRANSPORT_FAILURES, AllEndpointsDown

PROBE = {"probe_seconds": 0.005, "rollout_poll_seconds": 0.005}
"""Fast probes and membership polls: the tests wait for what they trigger."""

NO_SYNC = {"triggerParameterSyncStep": 1000}
"""fullyAsync without a weight sync in the run: a rollout server dead at a sync fails it, as the
real sender does (after weightSync.timeoutSeconds)."""


async def run_with(r: Rig, scenario: Awaitable[None], timeout: float = 60.0) -> None:
    """Run the driver while `scenario` acts on the fakes; both must finish."""
    run = asyncio.create_task(r.run(timeout))
    try:
        await scenario
        await run
    finally:
        r.trainer.release_all()
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)


def trained_groups(r: Rig) -> list[int]:
    return [g for line in r.driver.history.lines for g in line["groups"]]


# ---- staleness ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "asyncspec", "bound"),
    [
        ("sync", None, 0),
        ("oneStepOff", None, 1),
        ("fullyAsync", {"stalenessThreshold": 2.0}, 2),
        ("fullyAsync", {"stalenessThreshold": 0.5, "triggerParameterSyncStep": 2}, 1),
    ],
)
async def test_trained_samples_lag_at_most_the_modes_bound(tmp_path, mode, asyncspec, bound) -> None:
    steps = 6
    spec = job_spec(tmp_path, mode=mode, steps=steps, max_tokens=4, asyncspec=asyncspec)
    # Generation is much faster than a train step: without the bound, the rollouts would run ahead.
    r = rig(spec, rollouts=[FakeRolloutServer(f"http://rollout-{i}", token_seconds=0.001) for i in range(2)])
    r.trainer.step_seconds = 0.02
    await r.run()

    trigger = r.driver.staleness_policy.trigger_parameter_sync_step
    assert r.driver.staleness_policy.max_lag == bound
    assert len(r.trainer.steps) == steps
    # The trainer's version is the number of syncs so far, and every server loaded every one.
    syncs = (steps - 1) // trigger
    assert [step[0].trainer_version for step in r.trainer.steps] == [i // trigger for i in range(steps)]
    assert [v for v, _ in r.sender.syncs] == list(range(1, syncs + 1))
    assert all(s.loads == list(range(1, syncs + 1)) for s in r.cluster.rollouts.values())
    lags = [version - oldest for version, oldests in r.trainer.trained() for oldest in oldests]
    assert len(lags) == steps * 4
    assert max(lags) == bound  # reached (generation runs ahead as far as allowed), never exceeded
    groups = trained_groups(r)
    assert len(groups) == len(set(groups)) == steps * 2


# ---- partial rollouts --------------------------------------------------------------------------
async def test_a_generation_aborted_by_a_sync_resumes_from_its_tokens(tmp_path) -> None:
    spec = job_spec(
        tmp_path,
        mode="fullyAsync",
        steps=5,
        max_tokens=8,
        asyncspec={"partialRollout": True, "stalenessThreshold": 1.0, "oversample": 2.0},
    )
    r = rig(spec, rollouts=[FakeRolloutServer(f"http://rollout-{i}", token_seconds=0.003) for i in range(2)])
    r.trainer.step_seconds = 0.01
    await r.run()

    requests = [q for s in r.cluster.rollouts.values() for q in s.requests]
    resumed = [q for q in requests if q.prefix_token_ids]
    assert resumed, "no generation was in flight at a sync"
    for q in resumed:
        # The tokens it had, and the budget of the whole response (not what is left of it).
        assert q.prefix_token_ids == [token_at(q.prompt_token_ids, p) for p in range(len(q.prefix_token_ids))]
        assert q.sampling.max_tokens == 8
    spanning = 0
    for step in r.trainer.steps:
        for b in step:
            for i, ids in enumerate(b.token_ids):
                prompt, response = ids[: b.prompt_lens[i]], ids[b.prompt_lens[i] :]
                # Exactly the tokens of an uninterrupted generation, none lost or repeated ...
                assert response == [token_at(prompt, p) for p in range(8)]
                # ... each with the log-prob of the weights that sampled it, oldest first.
                versions = versions_of(b.rollout_logprobs[i])
                assert versions == sorted(versions) and b.weight_versions[i] == versions[0]
                spanning += versions[-1] > versions[0]
    assert spanning > 0, "no trained sample was resumed across a sync"
    history = r.driver.history.lines
    assert sum(h["resumedSamples"] for h in history) > 0
    assert any(lo < hi for h in history for lo, hi in h["resumedVersionRanges"])


# ---- servers that fail -------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["rollout", "teacher"])
async def test_a_dead_server_is_taken_out_of_rotation_and_the_run_completes(tmp_path, role) -> None:
    spec = job_spec(tmp_path, mode="fullyAsync", steps=6, asyncspec=NO_SYNC)
    rollouts = [FakeRolloutServer(f"http://rollout-{i}") for i in range(3)]
    teachers = [FakeTeacherServer(f"http://arith-{i}") for i in range(2)]
    dead = rollouts[1] if role == "rollout" else teachers[1]
    dead.die_at_request = 3
    r = rig(spec, rollouts=rollouts, teachers=teachers, **PROBE)
    pool = r.driver.pool if role == "rollout" else r.driver.router.pools["arith"]
    await r.run(timeout=60)

    assert len(r.trainer.steps) == 6
    assert pool.out_of_rotation() == [dead.base_url]
    # Once out, it got no request: only those already on their way when it was taken out failed.
    assert MAX_TRANSPORT_FAILURES <= dead.failed < MAX_TRANSPORT_FAILURES + r.driver.staleness_policy.in_flight_cap
    assert dead.health_checks > 1  # probed (the first check was the driver's start)
    groups = trained_groups(r)
    assert len(groups) == len(set(groups)) == 12


class _GatedHealth:
    """A server out of rotation whose /health is refused once `gate` opens."""

    def __init__(self, url: str):
        self.base_url = url
        self.gate = asyncio.Event()
        self.health_checks = 0

    async def health(self) -> None:
        self.health_checks += 1
        await self.gate.wait()
        raise refused(self.base_url)


@pytest.mark.parametrize("role", ["rollout", "teacher"])
async def test_a_probe_whose_health_is_refused_as_the_run_ends_is_cancelled(tmp_path, role) -> None:
    # The run ends (it cancels its background tasks) just as a probe's /health is refused: the
    # probe must end with it, not swallow the cancellation and probe on while the run waits for it.
    spec = job_spec(tmp_path, mode="fullyAsync", steps=1, asyncspec=NO_SYNC)
    r = rig(spec, rollouts=2, teachers=2, probe_seconds=0.001)
    pool = r.driver.pool if role == "rollout" else r.driver.router.pools["arith"]
    url = pool.urls[1]
    for _ in range(MAX_TRANSPORT_FAILURES):
        pool.failed(url)
    assert pool.out_of_rotation() == [url]
    server = _GatedHealth(url)
    clients: dict[str, Any] = r.driver.fleet.rollout if role == "rollout" else r.driver.fleet.teacher
    clients[url] = server
    probe = asyncio.create_task(r.driver.fleet.bring_back(pool, url))
    try:
        await until(lambda: server.health_checks == 1, "the driver probes it")
        server.gate.set()  # refused ...
        probe.cancel()  # ... as the run ends
        await asyncio.wait({probe}, timeout=1.0)
        assert probe.cancelled(), f"the probe swallowed its cancellation and went on ({server.health_checks} probes)"
    finally:  # a probe that swallows one cancellation may take several to end
        for _ in range(100):
            if probe.done():
                break
            probe.cancel()
            await asyncio.sleep(0.01)
        await asyncio.gather(probe, return_exceptions=True)


@pytest.mark.parametrize("role", ["rollout", "teacher"])
async def test_the_run_fails_naming_the_servers_when_a_role_has_none_left(tmp_path, role) -> None:
    spec = job_spec(tmp_path, mode="fullyAsync", steps=6, asyncspec=NO_SYNC)
    rollouts = [FakeRolloutServer(f"http://rollout-{i}") for i in range(2)]
    teachers = [FakeTeacherServer("http://arith-0")]
    dying = rollouts if role == "rollout" else teachers  # both rollout servers; the only teacher
    for server in dying:
        server.die_at_request = 2
    r = rig(spec, rollouts=rollouts, teachers=teachers, **PROBE)
    with pytest.raises(AllEndpointsDown, match="failed 5 times in a row and no other endpoint") as failure:
        await r.run(timeout=60)
    assert all(s.base_url in str(failure.value) for s in dying)
    assert len(r.trainer.steps) < 6


async def test_a_server_that_answers_again_is_put_back_in_rotation(tmp_path) -> None:
    spec = job_spec(tmp_path, mode="sync", steps=4)
    rollouts = [FakeRolloutServer(f"http://rollout-{i}") for i in range(2)]
    back = rollouts[1]
    back.die_at_request = 1  # unreachable from its first request on (a network partition)
    r = rig(spec, rollouts=rollouts, **PROBE)
    first_step = r.trainer.hold(1)  # no sync while it is unreachable: that would fail the run

    async def scenario() -> None:
        await until(lambda: back.base_url in r.driver.pool.out_of_rotation(), "it is out of rotation")
        assert back.answers == []
        checks = back.health_checks
        await until(lambda: back.health_checks >= checks + 2, "the driver probes it")
        assert back.base_url in r.driver.pool.out_of_rotation()
        back.revive()
        await until(lambda: back.base_url in r.driver.pool.serving(), "it is back in rotation")
        first_step.set()

    await run_with(r, scenario())
    assert len(r.trainer.steps) == 4
    assert back.answers, "it got no request after coming back"
    assert back.loads == [1, 2, 3]  # it took every sync
    assert set(back.generated_versions()) == {1, 2, 3}


async def test_a_replaced_server_is_back_only_once_a_sync_gave_it_the_current_weights(tmp_path) -> None:
    spec = job_spec(tmp_path, mode="sync", steps=5)
    rollouts = [FakeRolloutServer(f"http://rollout-{i}") for i in range(2)]
    replaced = rollouts[1]
    replaced.die_after_load = 1  # loads version 1, then its pod dies
    r = rig(spec, rollouts=rollouts, **PROBE)
    second_step, third_step = r.trainer.hold(2), r.trainer.hold(3)

    async def scenario() -> None:
        await until(lambda: replaced.base_url in r.driver.pool.out_of_rotation(), "it is out of rotation")
        replaced.revive(fresh=True)  # the new pod: initial weights (version 0), in no group
        answered = len(replaced.answers)
        checks = replaced.health_checks
        await until(
            lambda: replaced.health_checks >= checks + 2 or replaced.base_url in r.driver.pool.serving(),
            "the driver probes the new pod",
        )
        assert replaced.base_url in r.driver.pool.out_of_rotation(), "back with stale weights"
        second_step.set()  # step 2, then sync 2 reaches the new pod
        await until(lambda: replaced.base_url in r.driver.pool.serving(), "it is back in rotation")
        assert replaced.loads == [1, 2] and len(replaced.answers) == answered
        third_step.set()

    await run_with(r, scenario())
    assert len(r.trainer.steps) == 5
    after = [v for out in replaced.answers if min(out.versions) > 0 for v in out.versions]
    assert after and min(after) >= 2, "the new pod generated before it had the current weights"
    # It died right after sync 1: /version found it gone, which the history records.
    assert r.driver.history.lines[0]["rolloutVersions"] == [1, None]


# ---- scaling -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "asyncspec"), [("sync", None), ("fullyAsync", {"partialRollout": True, "stalenessThreshold": 1.0})]
)
async def test_a_new_server_joins_at_a_sync_and_a_removed_one_is_drained(tmp_path, mode, asyncspec) -> None:
    spec = job_spec(tmp_path, mode=mode, steps=4, asyncspec=asyncspec)
    old, new = FakeRolloutServer("http://rollout-0"), FakeRolloutServer("http://rollout-1", alive=False)
    wanted = [old.base_url, new.base_url]
    r = rig(spec, rollouts=[old], rollout_source=lambda: list(wanted), **PROBE)
    r.cluster.rollouts[new.base_url] = new  # its pod is not up yet
    first_step = r.trainer.hold(1)
    # Until the old server is let go, the new one keeps what it is sent: the run cannot end first.
    new.answering.clear()
    requests_to_old: list[int] = []

    async def scenario() -> None:
        await until(lambda: new.health_checks >= 2, "the driver waits for the new server")
        assert new.base_url not in r.sender.members and new.base_url not in r.driver.pool.urls
        new.revive()
        await until(lambda: new.base_url in r.driver.rollouts.ready, "the new server is ready")
        first_step.set()  # the sync after step 1 takes it in
        await until(lambda: new.base_url in r.driver.pool.serving(), "the new server takes requests")
        wanted.remove(old.base_url)
        await until(lambda: old.base_url not in r.driver.pool.serving(), "the old server drains")
        requests_to_old.append(len(old.requests))
        await until(lambda: old.base_url not in r.driver.pool.urls, "the old server is let go")
        assert r.sender.members == [new.base_url]
        new.answering.set()

    await run_with(r, scenario())
    assert len(r.trainer.steps) == 4
    assert r.sender.syncs[0] == (1, [old.base_url, new.base_url])
    assert [members for _, members in r.sender.syncs[1:]] == [[new.base_url]] * 2
    assert len(old.requests) == requests_to_old[0], "the drained server got new requests"
    assert new.answers and min(new.generated_versions()) >= 1, "the new server generated before it joined"
    assert r.driver.pool.urls == r.driver.status.rollout_servers == [new.base_url]
    assert (r.driver.rollouts.added, r.driver.rollouts.removed) == (1, 1)
    groups = trained_groups(r)
    assert len(groups) == len(set(groups)) == 8


# ---- the step's time budget ---------------------------------------------------------------------
async def test_a_steps_phases_add_up_to_its_wall_time_and_name_where_it_went(tmp_path) -> None:
    from kubedistill.runtime.driver.phases import STEP_PHASES
    from kubedistill.runtime.metrics import RoleMetrics
    from kubedistill.runtime.weight_sync.times import SyncTimes

    steps, every = 6, 3
    spec = job_spec(tmp_path, mode="oneStepOff", steps=steps, max_tokens=4)
    spec.checkpoint.every_steps = every
    metrics = RoleMetrics("job", "trainer", 0)
    r = rig(spec, metrics=metrics)
    r.trainer.step_seconds = 0.04
    r.sender.segment_seconds = SyncTimes(pause=0.01, transfer=0.02, load=0.015, resume=0.005)
    await r.run()

    hist = r.driver.history.lines
    assert [h["step"] for h in hist] == list(range(1, steps + 1))
    previous = 0.0
    for h in hist:
        phases = h["phases"]
        assert list(phases) == list(STEP_PHASES) and all(v >= 0 for v in phases.values()), phases
        wall = h["time"] - previous
        previous = h["time"]
        assert sum(phases.values()) == pytest.approx(wall, rel=0.05, abs=0.002), (h["step"], phases, wall)
        # Each lap is charged to what ran in it: the trainer's reported compute (the fake reports
        # its sleep), the sender's segments (the fake servers' load falls in `load`, the driver's
        # own part of the sync in `resume`), the time blocked on the buffer.
        assert phases["train_compute"] == pytest.approx(h["trainSeconds"], abs=2e-4)
        assert phases["train_compute"] >= 0.04
        assert phases["wait"] == pytest.approx(h["waitSeconds"], abs=2e-4)
        if h["synced"]:
            sent = r.sender.times[h["step"] - 1]
            assert (phases["sync_pause"], phases["sync_transfer"], phases["sync_load"]) == pytest.approx(
                (sent.pause, sent.transfer, sent.load), abs=2e-4
            )
            assert phases["sync_resume"] >= sent.resume - 2e-4
            assert sent.pause >= 0.01 and sent.transfer >= 0.02 and sent.load >= 0.015 and sent.resume >= 0.005
        else:
            assert all(phases[p] == 0 for p in STEP_PHASES if p.startswith("sync_"))
        # the checkpoint of a step is written after its line: the next step's phase
        assert (phases["checkpoint"] > 0) == (h["step"] > 1 and (h["step"] - 1) % every == 0)
    assert [h["synced"] for h in hist] == [True] * (steps - 1) + [False]
    # The same budget, per phase, in kubedistill_step_seconds: one observation per step each.
    labels = {"job": "job", "role": "trainer", "replica": "0"}
    for phase in STEP_PHASES:
        count = metrics.registry.get_sample_value("kubedistill_step_seconds_count", {**labels, "phase": phase})
        total = metrics.registry.get_sample_value("kubedistill_step_seconds_sum", {**labels, "phase": phase})
        assert count == steps, phase
        assert total == pytest.approx(sum(h["phases"][phase] for h in hist), abs=1e-3), phase


# ---- requireBatches ----------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "require_batches"), [("oneStepOff", 1), ("oneStepOff", 3), ("sync", 2)])
async def test_each_train_step_gets_require_batches_mini_batches(tmp_path, mode, require_batches) -> None:
    """spec.async.requireBatches on the driver's side, from the spec: every train step hands the
    trainer that many mini-batches of miniBatchSize samples, and the staleness bound counts them."""
    steps = 3
    spec = job_spec(tmp_path, mode=mode, steps=steps, max_tokens=4, asyncspec={"requireBatches": require_batches})
    r = rig(spec)
    await r.run()
    assert [len(step) for step in r.trainer.steps] == [require_batches] * steps
    assert all(len(b.token_ids) == 4 for step in r.trainer.steps for b in step)
    assert r.driver.staleness_policy.required == 4 * require_batches
    assert len(set(trained_groups(r))) == steps * require_batches * 2


# ---- multi-turn traces -------------------------------------------------------------------------
class _Step:
    def __init__(self, text: str, done: bool, reward: float | None = None):
        self.observation_text, self.done, self.reward = text, done, reward


class _Episode:
    """Answers the first action with an observation, and ends the episode at the second."""

    def __init__(self, log: list[str]):
        self.log, self.steps = log, 0

    async def step(self, text: str) -> _Step:
        self.log.append(text)
        self.steps += 1
        await asyncio.sleep(0.002)
        return _Step("=12", done=self.steps >= 2, reward=0.5 if self.steps >= 2 else None)

    async def close(self) -> None:
        pass


async def test_a_fully_async_job_trains_traces_with_their_observations_masked(tmp_path) -> None:
    from kubedistill.api.spec import DistillationJobSpec

    base = job_spec(tmp_path, mode="fullyAsync", steps=4, max_tokens=3, asyncspec={"stalenessThreshold": 2.0})
    doc = base.model_dump(by_alias=True, mode="json", exclude_none=True)
    doc["environments"] = [{"name": "calc", "command": ["serve"]}]
    doc["rollout"]["multiTurn"] = {"maxTurns": 3, "maxTraceTokens": 12}
    spec = DistillationJobSpec.model_validate(doc)
    actions: list[str] = []
    opened: list[tuple[str, int | None]] = []

    class Replica:
        base_url, checks = "http://calc-0:8000", 0

        async def health(self) -> None:
            Replica.checks += 1
            if Replica.checks < 3:  # still starting: the driver waits for it
                raise ConnectionRefusedError

    class Environments:
        async def open(self, name: str, seed: int | None) -> _Episode:
            assert Replica.checks >= 3, "an episode opened before the environment answered /health"
            opened.append((name, seed))
            return _Episode(actions)

        def replicas(self) -> list[Any]:
            return [Replica()]

    r = rig(spec, environments=Environments())
    await r.run()
    assert len(r.trainer.steps) == 4 and opened and {name for name, _ in opened} == {"calc"}
    for step in r.trainer.steps:
        for b in step:
            assert b.loss_masks is not None
            for ids, prompt_len, mask in zip(b.token_ids, b.prompt_lens, b.loss_masks, strict=True):
                response = ids[prompt_len:]
                # Two turns of 3 tokens around the observation "=12" (3 tokens), which carries no loss.
                assert len(response) == 9 and mask == [True] * 3 + [False] * 3 + [True] * 3
                assert response[3:6] == [11, 1, 2]  # "=12" in the fake tokenizer's alphabet
    # The teacher scored each whole trace in one request; the history reports the traces.
    scored = [req for servers in r.cluster.teachers.values() for t in servers for req in t.scored]
    assert scored and all(len(req.token_ids) - req.prompt_len == 9 for req in scored)
    line = r.driver.history.lines[-1]
    assert line["turnsMean"] == 2 and line["lossTokenShare"] == pytest.approx(6 / 9) and line["envErrors"] == 0
    assert line["rewardMean"] == 0.5  # the environment's reward, summed over the trace


async def test_a_frozen_driver_starts_no_more_trainer_work(tmp_path) -> None:
    """After SIGTERM's freeze, no train step or checkpoint runs: the history and the checkpoints
    end where the process stopped recording."""
    every_step = {"path": str(tmp_path / "ckpt"), "exportHf": False, "everySteps": 1}
    r = rig(job_spec(tmp_path, mode="sync", steps=50, max_tokens=2, checkpoint=every_step))
    run = asyncio.create_task(r.run(timeout=30))
    try:
        await until(lambda: len(r.trainer.checkpoints) >= 2, "two checkpoints")
        r.driver.freeze()
        await asyncio.sleep(0.3)  # the trainer work already running ends
        steps, checkpoints = len(r.trainer.steps), len(r.trainer.checkpoints)
        await asyncio.sleep(0.5)
        assert (len(r.trainer.steps), len(r.trainer.checkpoints)) == (steps, checkpoints) and steps < 50
    finally:
        r.driver.frozen.set()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
