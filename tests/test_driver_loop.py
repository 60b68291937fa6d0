"""The driver's I/O-free parts: checkpoint state (cursor + buffered + in-flight samples), the
per-request seeds, the /status JSON and its HTTP server. The loop itself runs end to end in
test_e2e_modes.py and test_resume.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from e2e_jobs import write_prompts
from kubedistill.api.progress import TrainerProgress
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.operator.policy import Progress
from kubedistill.runtime.driver.loop import Driver, request_seed
from kubedistill.runtime.driver.progress import HistoryWriter, read_history
from kubedistill.runtime.driver.samples import Sample, SampleGroup


def _spec(tmp_path: Path, tiny_models, mode: str = "oneStepOff", partial: bool = False) -> DistillationJobSpec:
    spec = {
        "mode": mode,
        "device": "cpu",
        "student": {"model": str(tiny_models["student"])},
        "teachers": [{"name": "arith", "model": str(tiny_models["teacher"])}],
        "rollout": {"sampling": {"samplesPerPrompt": 2, "maxTokens": 4, "seed": 3}},
        "trainer": {"miniBatchSize": 4, "totalSteps": 5},
        "data": {"train": [str(write_prompts(tmp_path / "train.jsonl", 16))]},
        "checkpoint": {"path": str(tmp_path / "ckpt")},
    }
    if partial:
        spec["async"] = {"partialRollout": True, "stalenessThreshold": 1.0}
    return DistillationJobSpec.model_validate(spec)


def _driver(spec, tiny_models) -> Driver:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models["student"]))
    return Driver(
        spec,
        trainer=None,
        sender=None,
        rollout_urls=["http://127.0.0.1:1"],
        teacher_urls={"arith": ["http://127.0.0.1:2"]},
        tokenizer=tok,
    )


def _half_generated(d: Driver) -> SampleGroup:
    g = SampleGroup.from_prompt(d.src.next(), 2, 4)
    assert d.buffer.try_reserve(g)
    s = g.samples[0]
    s.continuation()
    s.extend(
        type(
            "Out",
            (),
            {
                "token_ids": [5, 6],
                "logprobs": [-1.0, -2.0],
                "versions": [0, 0],
                "finish_reason": "abort",
                "topk_ids": None,
            },
        )()
    )
    return g


@pytest.mark.parametrize("partial", [True, False])
async def test_checkpoint_state_keeps_cursor_and_unfinished_samples(tmp_path, tiny_models, partial) -> None:
    spec = _spec(tmp_path, tiny_models, mode="fullyAsync" if partial else "oneStepOff", partial=partial)
    d = _driver(spec, tiny_models)
    g = _half_generated(d)
    next_uid = d.src.next().uid  # drawn, never reserved: a checkpoint now must not skip it
    d._pending_cursor = {**d.src.state_dict(), "position": d.src.position - 1}
    state = d.driver_state()

    d2 = _driver(spec, tiny_models)
    d2.restore(4, 2, state)
    assert (d2.step, d2.version, d2.status.step, d2.status.weight_version) == (4, 2, 4, 2)
    assert [x.group_id for x in d2._resumed_groups] == [g.group_id]
    assert d2.src.next().uid == next_uid
    s = d2._resumed_groups[0].samples[0]
    if partial:  # resumed from its prefix under the new weights
        assert s.response_ids == [5, 6] and s.needs_resume
        assert s.continuation().prefix_token_ids == [5, 6]
    else:  # restarted from scratch
        assert s.response_ids == [] and s.finish_reason is None


def test_restore_refuses_foreign_state(tmp_path, tiny_models) -> None:
    d = _driver(_spec(tmp_path, tiny_models), tiny_models)
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
        '"trainerIdleRatio": null, "rolloutServers": null}'
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
    assert Progress.of(doc) == Progress(step=3, weight_version=2, last_checkpoint="/ckpt/step-3")
    assert Progress.of({"step": 7}) == Progress(step=7, weight_version=0, last_checkpoint=None)
    with pytest.raises(ValueError):
        Progress.of({"step": "many"})
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
