"""The driver's checkpoint state (cursor + buffered + in-flight samples) taken from a running
driver and resumed by another, the per-request seeds, the /status JSON and its HTTP server. The
loop runs against fakes in test_driver_loop_fake.py and end to end in test_e2e_modes.py and
test_resume.py."""

from __future__ import annotations

import asyncio
import json
import pickle
from typing import Any

import httpx
import pytest

from driver_fakes import Checkpoint, FakeRolloutServer, job_spec, rig
from kubedistill.api.progress import TrainerProgress
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.operator.policy import TrainerReport
from kubedistill.runtime.driver.buffer import SampleBuffer
from kubedistill.runtime.driver.history import HistoryWriter, read_history
from kubedistill.runtime.driver.loop import request_seed
from kubedistill.runtime.driver.samples import Sample
from kubedistill.runtime.driver.staleness import StalenessPolicy
from kubedistill.runtime.wire.protocol import GenerateRequest


def _servers() -> list[FakeRolloutServer]:
    # One fast and one slow server: a group's samples finish apart, so a checkpoint finds groups
    # with finished samples waiting for unfinished ones.
    return [
        FakeRolloutServer("http://rollout-0", token_seconds=0.001),
        FakeRolloutServer("http://rollout-1", token_seconds=0.005),
    ]


def _unfinished_state(checkpoint: Checkpoint, rule: StalenessPolicy, partial: bool) -> bool:
    """Whether the checkpoint caught a group with a finished sample and an unfinished one (with
    partial rollouts: one holding tokens, to be continued)."""
    buffer = SampleBuffer(rule)
    buffer.load_bytes(pickle.loads(checkpoint.driver_state)["buffer"])
    samples = [s for g in buffer.in_flight_groups() for s in g.samples]
    unfinished = [s for s in samples if not s.finished and (s.response_ids or not partial)]
    return bool(unfinished) and any(s.finished for s in samples)


PARTIAL = ("fullyAsync", {"partialRollout": True, "stalenessThreshold": 1.0})
NOT_PARTIAL = ("fullyAsync", {"partialRollout": False, "stalenessThreshold": 1.0})
ONE_STEP_OFF = ("oneStepOff", None)


@pytest.mark.parametrize(
    ("before", "after"),
    [(PARTIAL, PARTIAL), (PARTIAL, NOT_PARTIAL), (ONE_STEP_OFF, ONE_STEP_OFF)],
    ids=["partial", "partial-switched-off", "oneStepOff"],
)
async def test_a_checkpoint_resumes_unfinished_samples_and_skips_no_prompt(tmp_path, before, after) -> None:
    checkpoint = {"path": str(tmp_path / "ckpt"), "everySteps": 1, "exportHf": False}

    def spec(steps: int, mode_and_async: tuple[str, dict[str, Any] | None]) -> DistillationJobSpec:
        mode, asyncspec = mode_and_async
        return job_spec(tmp_path, mode=mode, steps=steps, max_tokens=8, asyncspec=asyncspec, checkpoint=checkpoint)

    partial, resume_partial = before is PARTIAL, after is PARTIAL
    # Whether a checkpoint falls while a group is half generated is a matter of timing (mostly the
    # last step's, in oneStepOff not always): a few runs find one. Up to 12, stopping at the first:
    # under CI's load (background jobs beside the unit tests) 4 runs of oneStepOff found none once.
    for _ in range(12):
        first = rig(spec(6, before), rollouts=_servers())
        first.trainer.step_seconds = 0.01
        await first.run()
        rule = first.driver.staleness_policy
        saved = next((c for c in first.trainer.checkpoints if _unfinished_state(c, rule, partial)), None)
        if saved is not None:
            break
    assert saved is not None, "no checkpoint caught a group half generated"
    state = pickle.loads(saved.driver_state)
    buffer = SampleBuffer(rule)
    buffer.load_bytes(state["buffer"])
    in_flight, ready = buffer.in_flight_groups(), buffer.ready_groups()

    # The cursor is one past the last prompt put in the buffer: every prompt before it was trained
    # on, is buffered or in flight, or was dropped as too stale (none is skipped, none repeated).
    next_uid = state["data"]["epoch"] * 16 + state["data"]["position"]
    trained = [g for line in first.driver.history.lines[: saved.step] for g in line["groups"]]
    held = trained + [g.group_id for g in [*ready, *in_flight]]
    dropped = buffer.counters["dropped_stale"] // 2
    assert len(held) == len(set(held)) == next_uid - dropped and max(held) < next_uid

    second = rig(spec(saved.step + 2, after), rollouts=_servers())
    second.driver.restore(saved.step, saved.weight_version, saved.driver_state)
    assert (second.driver.step, second.driver.version) == (saved.step, saved.weight_version)
    await second.driver.sync_weights(saved.weight_version)  # as the trainer does after a restore
    await second.run()
    assert len(second.trainer.steps) == 2
    sent = {q.request_id: q for s in second.cluster.rollouts.values() for q in s.requests}

    def first_request(sample: Sample) -> GenerateRequest | None:
        ids = [rid for rid in sent if rid.startswith(f"{sample.sample_id}-r")]
        return sent[min(ids, key=lambda r: int(r.split("-r")[1]))] if ids else None

    for s in (s for g in in_flight for s in g.samples):
        request = first_request(s)
        if s.finished:  # kept, not generated again
            assert request is None
        elif resume_partial:  # continued from its tokens under the new weights
            assert request is not None and request.prefix_token_ids == s.response_ids
        else:  # generated from scratch, whatever tokens it had
            assert request is not None and request.prefix_token_ids == []
    # The first prompt drawn after the restore is the one the cursor points at.
    new_groups = {int(rid.split("-")[0]) for rid in sent} - {g.group_id for g in in_flight}
    assert min(new_groups) == next_uid
    trained_after = [g for line in second.driver.history.lines for g in line["groups"]]
    assert not set(trained_after) & set(trained)


async def test_restore_refuses_foreign_state(tmp_path) -> None:
    d = rig(job_spec(tmp_path)).driver
    with pytest.raises(ValueError, match="unknown format"):
        d.restore(1, 1, {"format": 99})


def test_request_seeds_differ_per_sample_and_request() -> None:
    a, b = (
        Sample(group_id=7, index=0, prompt_ids=[1], max_tokens=4),
        Sample(group_id=7, index=1, prompt_ids=[1], max_tokens=4),
    )
    assert request_seed(None, a) is None
    seeds = {request_seed(0, a), request_seed(0, b)}
    a.requests = 1
    seeds.add(request_seed(0, a))
    assert len(seeds) == 3
    assert request_seed(0, a) == request_seed(0, a)


def test_status_json_and_history(tmp_path) -> None:
    st = TrainerProgress(total_steps=10)
    # The wire format: every key in this order, null while unknown; `message` only on failure.
    assert json.dumps(st.to_json()) == (
        '{"step": 0, "totalSteps": 10, "weightVersion": 0, "lastCheckpoint": null, "phase": "starting", '
        '"samplesPerSecond": null, "rewardMean": null, "klStudentTeacher": null, "stalenessMean": null, '
        '"trainerIdleRatio": null, "rolloutServers": null, "evaluation": null}'
    )
    with pytest.raises(ValueError, match="phase"):
        st.set_phase("exploded")
    st.step, st.weight_version, st.last_checkpoint, st.samples_per_second = 3, 2, "/ckpt/step-3", 1.5
    st.set_phase("failed", "boom")
    doc = st.to_json()
    assert list(doc)[-1] == "message" and doc["message"] == "boom"
    # Both readers: `kubedistill run` (the whole document) and the operator (what the job's status holds).
    assert TrainerProgress.from_json(doc) == st
    assert TrainerProgress.from_json({**doc, "time": 1.0, "lossTotal": 0.5}) == st  # a history line
    assert TrainerReport.of(doc) == TrainerReport(step=3, weight_version=2, last_checkpoint="/ckpt/step-3")
    assert TrainerReport.of({"step": 7}) == TrainerReport(step=7, weight_version=0, last_checkpoint=None)
    with pytest.raises(ValueError):
        TrainerReport.of({"step": "many"})
    h = HistoryWriter(tmp_path / "h.jsonl")
    assert read_history(tmp_path / "h.jsonl") == []
    h.write({"step": 1})
    h.write({"step": 2})
    assert (tmp_path / "h.jsonl").read_text().splitlines() == ['{"step": 1}', '{"step": 2}']
    assert read_history(tmp_path / "h.jsonl") == h.lines == [{"step": 1}, {"step": 2}]


async def test_status_server_serves_status_health_metrics() -> None:
    from kubedistill.runtime.entrypoints.status_server import StatusServer
    from kubedistill.runtime.metrics import RoleMetrics
    from server_fixtures import free_port

    st = TrainerProgress(total_steps=3)
    m = RoleMetrics("j", "trainer", 0)
    m["step"].set(2)
    port = free_port()
    server = StatusServer(st, m, "127.0.0.1", port)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            st.step, st.phase = 2, "running"
            assert (await c.get("/status")).json()["step"] == 2
            assert (await c.get("/health")).status_code == 200
            assert "kubedistill_step" in (await c.get("/metrics")).text
            st.set_phase("failed", "boom")
            r = await c.get("/health")
            assert r.status_code == 500
            assert (await c.get("/status")).json()["message"] == "boom"
    finally:
        await server.stop()
    await asyncio.sleep(0)
