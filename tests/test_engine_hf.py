"""The hf engine's continuous batching, in-process on the tiny student/teacher: batched greedy
decoding equals the plain model one request at a time (requests of different lengths joining
and leaving at different steps), per-request sampling, abort inside a batch, the pause modes a
weight load uses, and batched scoring."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kubedistill.runtime.engines.hf import HFEngine
from kubedistill.runtime.engines.hf_batch import PaddedKVBatch
from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling, ScoreRequest

torch.set_num_threads(1)


def plain_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def greedy_reference(model: Any, context: list[int], n: int) -> tuple[list[int], list[float]]:
    """The unbatched model, no cache, one token at a time."""
    ids, tokens, logprobs = list(context), [], []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        t = int(logits.argmax())
        tokens.append(t)
        logprobs.append(torch.log_softmax(logits, -1)[t].item())
        ids.append(t)
    return tokens, logprobs


def greedy(rid: str, prompt: list[int], max_tokens: int, prefix: Sequence[int] = ()) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        prefix_token_ids=list(prefix),
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(5000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting until {what}")


async def until_tokens(engine: HFEngine, rid: str, n: int) -> None:
    def reached() -> bool:
        st = engine.inflight.get(rid)
        return st is not None and len(st.token_ids) >= n

    await until(reached, f"{rid} has {n} tokens")


@pytest.fixture
async def student(tiny_models: dict[str, Path]) -> AsyncIterator[HFEngine]:
    engine = HFEngine(str(tiny_models["student"]), dtype="float32")
    await engine.start()
    yield engine
    await engine.shutdown()


PROMPTS = {
    "a": [1, 5, 6, 14, 7],
    "b": [1, 2],
    "c": [1, 4, 11, 14, 8, 9, 15, 3, 3, 5, 6, 12, 13],
    "d": [1, 9],
    "e": [1, 7, 7, 7, 8, 10, 11],
}
BUDGET = {"a": 20, "b": 9, "c": 14, "d": 25, "e": 6}


async def test_batched_greedy_equals_the_plain_model_one_at_a_time(
    student: HFEngine, tiny_models: dict[str, Path]
) -> None:
    first = [asyncio.create_task(student.generate(greedy(r, PROMPTS[r], BUDGET[r]))) for r in ("a", "b")]
    await until_tokens(student, "a", 3)  # c and d join a running batch, together
    second = [asyncio.create_task(student.generate(greedy(r, PROMPTS[r], BUDGET[r]))) for r in ("c", "d")]
    await first[1]  # b has left; e joins a narrower batch, resuming from a prefix
    ref_model = plain_model(tiny_models["student"])
    e_prefix = greedy_reference(ref_model, PROMPTS["e"], 2)[0]
    third = [asyncio.create_task(student.generate(greedy("e", PROMPTS["e"], BUDGET["e"], prefix=e_prefix)))]
    outs = {o.request_id: o for o in await asyncio.gather(*first, *second, *third)}

    for rid, out in outs.items():
        context = PROMPTS[rid] + (e_prefix if rid == "e" else [])
        want = BUDGET[rid] - (len(e_prefix) if rid == "e" else 0)
        tokens, logprobs = greedy_reference(ref_model, context, want)
        assert out.token_ids == tokens, rid
        assert out.logprobs == pytest.approx(logprobs, abs=1e-4), rid
        assert out.finish_reason == "length" and out.versions == [0] * want
    # Batched: far fewer decode forwards than tokens, several rows per forward.
    total = sum(len(o.token_ids) for o in outs.values())
    assert student.forwards["decode"] + student.forwards["prefill"] < total * 0.6
    assert student.forwards["prefill"] <= 4  # a+b, c+d, e (+ at most one split by timing)


def test_rows_leave_and_the_padding_is_cut(tiny_models: dict[str, Path]) -> None:
    model = plain_model(tiny_models["student"])
    with torch.no_grad():
        batch, _ = PaddedKVBatch.prefill(model, [[1, 2, 3, 4, 5, 6], [1, 2], [1, 2, 3]])
    assert batch.mask.tolist() == [[1] * 6, [0] * 4 + [1] * 2, [0] * 3 + [1] * 3]
    batch.select([2, 1])
    # The longest row left: one padded column is common to both rows and goes.
    assert batch.mask.tolist() == [[1, 1, 1], [0, 1, 1]] and batch.lengths.tolist() == [3, 2]
    assert all(layer.keys.shape[:3] == (2, 2, 3) for layer in batch.cache.layers)
    assert batch.select([]) is None


async def test_sampling_stays_per_request(student: HFEngine) -> None:
    def sampled(rid: str, seed: int | None, temperature: float = 1.0, top_p: float = 1.0) -> GenerateRequest:
        return GenerateRequest(
            request_id=rid,
            prompt_token_ids=PROMPTS["a"],
            sampling=Sampling(max_tokens=12, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=True),
        )

    alone = await student.generate(sampled("alone", seed=7))
    crowd = await asyncio.gather(
        student.generate(sampled("s7", seed=7)),
        student.generate(greedy("g", PROMPTS["c"], 12)),
        student.generate(sampled("s8", seed=8)),
        student.generate(sampled("hot", None, temperature=2.0)),
        student.generate(sampled("narrow", None, top_p=1e-6)),
    )
    s7, g, s8, hot, narrow = crowd
    # A seeded request is reproducible whatever else is in the batch; another seed differs.
    assert s7.token_ids == alone.token_ids and s7.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert s8.token_ids != s7.token_ids
    # top_p that keeps one token is greedy; greedy is greedy next to sampled rows.
    assert narrow.token_ids == (await student.generate(greedy("ga", PROMPTS["a"], 12))).token_ids
    assert g.token_ids == (await student.generate(greedy("gc", PROMPTS["c"], 12))).token_ids
    assert len(hot.token_ids) == 12 and all(lp <= 0 for lp in hot.logprobs)


async def test_abort_inside_a_batch_leaves_the_others_exact(student: HFEngine, tiny_models: dict[str, Path]) -> None:
    tasks = {r: asyncio.create_task(student.generate(greedy(r, PROMPTS[r], 30))) for r in ("a", "c", "d")}
    await until_tokens(student, "c", 4)
    aborted = await student.abort(["c"])
    outs = {r: await t for r, t in tasks.items()}
    assert outs["c"].finish_reason == "abort" and aborted["c"].token_ids == outs["c"].token_ids
    assert 4 <= len(outs["c"].token_ids) < 30
    ref_model = plain_model(tiny_models["student"])
    for r in ("a", "d"):
        assert outs[r].finish_reason == "length"
        assert outs[r].token_ids == greedy_reference(ref_model, PROMPTS[r], 30)[0]
    assert outs["c"].token_ids == greedy_reference(ref_model, PROMPTS["c"], len(outs["c"].token_ids))[0]


async def test_keep_pause_freezes_the_batch_and_continues_under_the_new_version(
    student: HFEngine, tiny_models: dict[str, Path]
) -> None:
    tasks = [asyncio.create_task(student.generate(greedy(r, PROMPTS[r], 20))) for r in ("a", "b")]
    await until_tokens(student, "a", 3)
    await student._pause_generation("keep", timeout=60)
    frozen = [len(student.inflight[r].token_ids) for r in ("a", "b")]
    forwards = dict(student.forwards)
    late = asyncio.create_task(student.generate(greedy("late", PROMPTS["d"], 4)))
    # Queuing "late" sets the scheduler's wake-up event, and only the scheduler clears it, when it
    # goes idle again: once it is clear, the scheduler has been through its loop with "late" queued.
    await until(lambda: "late" in student.inflight and not student._wake.is_set(), "the scheduler saw 'late'")
    assert student.forwards == forwards
    assert [len(student.inflight[r].token_ids) for r in ("a", "b")] == frozen
    assert student.inflight["late"].token_ids == []  # new requests queue during the load
    student.version = 1  # what a load does between pause and resume
    student._resume_generation()
    a, b = await asyncio.gather(*tasks)
    assert (await late).versions == [1] * 4
    ref_model = plain_model(tiny_models["student"])
    for out, rid, n in ((a, "a", frozen[0]), (b, "b", frozen[1])):
        assert out.versions == [0] * n + [1] * (20 - n)
        assert out.token_ids == greedy_reference(ref_model, PROMPTS[rid], 20)[0]


async def test_wait_pause_finishes_running_requests_and_abort_pause_ends_them(student: HFEngine) -> None:
    running = asyncio.create_task(student.generate(greedy("a", PROMPTS["a"], 15)))
    await until_tokens(student, "a", 2)
    await student._pause_generation("wait", timeout=60)
    out = await running  # the pause returned only once it was done
    assert out.finish_reason == "length" and len(out.token_ids) == 15
    student._resume_generation()

    running = [asyncio.create_task(student.generate(greedy(r, PROMPTS[r], 200))) for r in ("b", "c")]
    await until_tokens(student, "c", 2)
    await student._pause_generation("abort", timeout=60)
    outs = await asyncio.gather(*running)
    assert all(o.finish_reason == "abort" and 0 < len(o.token_ids) < 200 for o in outs)
    student._resume_generation()
    after = await student.generate(greedy("after", PROMPTS["a"], 3))
    assert after.finish_reason == "length" and len(after.token_ids) == 3


async def test_concurrent_scores_share_one_forward_and_match_the_model(tiny_models: dict[str, Path]) -> None:
    engine = HFEngine(str(tiny_models["teacher"]), dtype="float32")
    await engine.start()
    reqs = [
        ScoreRequest(token_ids=PROMPTS[r] + [8, 9, 10, 11][: 1 + i], prompt_len=len(PROMPTS[r]), top_k=3)
        for i, r in enumerate(("a", "b", "c", "d"))
    ]
    outs = await asyncio.gather(*(engine.score(r) for r in reqs))
    assert engine.forwards["score"] == 1
    model = plain_model(tiny_models["teacher"])
    for req, out in zip(reqs, outs):
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([req.token_ids])).logits[0], -1)
        lp = lp[req.prompt_len - 1 : -1]
        targets = torch.tensor(req.token_ids[req.prompt_len :])
        assert out.logprobs == pytest.approx(lp.gather(1, targets[:, None])[:, 0].tolist(), abs=1e-4)
        top = lp.topk(3, -1)
        assert out.topk_ids.tolist() == top.indices.tolist()
        assert torch.allclose(torch.from_numpy(out.topk_logprobs.array().copy()), top.values, atol=1e-4)
    await engine.shutdown()


async def test_top_k_ids_per_generated_position_and_teacher_gathers(tiny_models: dict[str, Path]) -> None:
    # lossMode reverseKLTopK: the rollout returns its top-k ids at each position it samples, and
    # the teacher returns its log-probs at exactly those ids.
    student = HFEngine(str(tiny_models["student"]), dtype="float32")
    teacher = HFEngine(str(tiny_models["teacher"]), dtype="float32")
    await student.start()
    await teacher.start()
    try:
        prompt = PROMPTS["a"]
        req = GenerateRequest(
            request_id="k",
            prompt_token_ids=prompt,
            sampling=Sampling(max_tokens=6, temperature=0.0, ignore_eos=True, top_k_ids=3),
        )
        out = await student.generate(req)
        # The same request without top-k ids: the same tokens, no ids.
        plain = await student.generate(greedy("plain", prompt, 6))
        assert plain.topk_ids is None and plain.token_ids == out.token_ids
        assert out.topk_ids is not None and out.topk_ids.shape == (len(out.token_ids), 3) == (6, 3)
        rows = out.topk_ids.tolist()
        model = plain_model(tiny_models["student"])
        ids = list(prompt)
        for token, row in zip(out.token_ids, rows):
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
            assert row == lp.topk(3).indices.tolist() and row[0] == token  # greedy: the best id
            ids.append(token)
        score = await teacher.score(
            ScoreRequest(token_ids=ids, prompt_len=len(prompt), top_k=2, gather_ids=out.topk_ids)
        )
        tmodel = plain_model(tiny_models["teacher"])
        with torch.no_grad():
            tlp = torch.log_softmax(tmodel(input_ids=torch.tensor([ids])).logits[0], -1)[len(prompt) - 1 : -1]
        assert score.gather_logprobs is not None
        gathered = score.gather_logprobs.tolist()
        for t, row in enumerate(rows):
            assert gathered[t] == pytest.approx(tlp[t, row].tolist(), abs=1e-4)
    finally:
        await student.shutdown()
        await teacher.shutdown()


async def test_the_teacher_scores_at_temperature_1_whatever_the_rollout_temperature(
    tiny_models: dict[str, Path],
) -> None:
    """docs/algorithms.md#temperature: the teacher engine the spec makes scores with the log-softmax
    of its own logits, not of logits / rollout.sampling.temperature."""
    from kubedistill.api.spec import DistillationJobSpec
    from kubedistill.runtime.engines.factory import make_engine

    spec = DistillationJobSpec.model_validate(
        {
            "device": "cpu",
            "student": {"model": str(tiny_models["student"])},
            "teachers": [{"name": "t", "model": str(tiny_models["teacher"]), "inference": {"engine": "hf"}}],
            "rollout": {"sampling": {"temperature": 0.25}},
            "trainer": {"miniBatchSize": 4},
            "data": {"train": ["/d/t.parquet"]},
        }
    )
    [teacher] = spec.teachers
    engine = make_engine(spec, teacher, teacher.inference)
    await engine.start()
    req = ScoreRequest(token_ids=PROMPTS["c"] + [8, 9, 10], prompt_len=len(PROMPTS["c"]), top_k=3)
    out = await engine.score(req)
    await engine.shutdown()
    with torch.no_grad():
        logits = plain_model(tiny_models["teacher"])(input_ids=torch.tensor([req.token_ids])).logits[0]
    targets = torch.tensor(req.token_ids[req.prompt_len :])[:, None]
    at = {t: torch.log_softmax(logits / t, -1)[req.prompt_len - 1 : -1].gather(1, targets)[:, 0] for t in (1.0, 0.25)}
    assert out.logprobs == pytest.approx(at[1.0].tolist(), abs=1e-4)
    assert not torch.allclose(torch.tensor(out.logprobs), at[0.25], atol=1e-2)
    assert "temperature" not in ScoreRequest.model_fields


async def test_the_temperature_decides_what_is_drawn(student: HFEngine) -> None:
    """The same seed draws the greedy tokens at a temperature near 0 and others at 1: a
    temperature the engine ignored (or took as 1, or as greedy) fails one of the two."""

    def at(temperature: float) -> GenerateRequest:
        return GenerateRequest(
            request_id=f"t{temperature}",
            prompt_token_ids=PROMPTS["a"],
            sampling=Sampling(max_tokens=12, temperature=temperature, seed=7, ignore_eos=True),
        )

    greedy_ids = (await student.generate(greedy("g", PROMPTS["a"], 12))).token_ids
    cold, warm = (await student.generate(at(1e-4))), (await student.generate(at(1.0)))
    assert cold.token_ids == greedy_ids
    assert warm.token_ids != greedy_ids
