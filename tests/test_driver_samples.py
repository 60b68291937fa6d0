"""Samples: per-token versions and partial-rollout resume (prefix + continuation)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from batch_lists import to_lists
from kubedistill.api.losses import CONTRACTS, ROLLOUT_TOP_K
from kubedistill.api.spec import LossMode
from kubedistill.runtime.driver.samples import Sample, SampleGroup
from kubedistill.runtime.wire.protocol import GenerateRequest, GenerateResponse, Sampling
from kubedistill.runtime.wire.rows import Rows


def response(req_id: str, ids, lps, version: int, reason: str) -> GenerateResponse:
    return GenerateResponse(
        request_id=req_id, token_ids=ids, logprobs=lps, versions=[version] * len(ids), finish_reason=reason
    )


def test_resume_after_abort_merges_prefix_and_continuation() -> None:
    s = Sample(group_id=7, index=1, prompt_ids=[1, 2, 3], max_tokens=6, data_source="arith")
    first = s.continuation()
    assert (first.request_id, first.prefix_token_ids, first.max_tokens) == ("7-1-r1", [], 6)
    s.extend(response(first.request_id, [10, 11], [-0.1, -0.2], 3, "abort"))
    assert s.needs_resume and not s.finished

    second = s.continuation()
    # The wire request the driver sends: prompt unchanged, the tokens so far as the prefix.
    req = GenerateRequest(
        request_id=second.request_id,
        prompt_token_ids=second.prompt_token_ids,
        prefix_token_ids=second.prefix_token_ids,
        sampling=Sampling(max_tokens=second.max_tokens),
    )
    # max_tokens is the whole response's budget: the server generates at most 6 - 2 more.
    assert (req.request_id, req.prompt_token_ids, req.prefix_token_ids, req.sampling.max_tokens) == (
        "7-1-r2",
        [1, 2, 3],
        [10, 11],
        6,
    )
    assert second.remaining == 4
    s.extend(response(req.request_id, [12, 13, 2], [-0.3, -0.4, -0.5], 4, "stop"))

    assert s.response_ids == [10, 11, 12, 13, 2]
    assert s.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]  # each token keeps the log-prob of its sampler
    assert s.versions == [3, 3, 4, 4, 4]
    assert (s.min_version, s.max_version, s.resumed, s.finish_reason) == (3, 4, 1, "stop")
    with pytest.raises(ValueError, match="finished"):
        s.continuation()


def test_abort_on_the_last_budgeted_token_is_a_finished_sample() -> None:
    s = Sample(group_id=0, index=0, prompt_ids=[1], max_tokens=2)
    s.continuation()
    s.extend(response("x", [5, 6], [-1.0, -1.0], 0, "abort"))
    assert s.finish_reason == "length" and s.finished


def test_bad_generate_output_is_refused() -> None:
    s = Sample(group_id=0, index=0, prompt_ids=[1], max_tokens=3)
    s.continuation()

    class Broken:
        token_ids, logprobs, versions, finish_reason = [1, 2], [-1.0], [0, 0], "stop"

    with pytest.raises(ValueError, match="2 token_ids, 1 logprobs"):
        s.extend(Broken())
    with pytest.raises(ValueError, match="exceed maxTokens 3"):
        s.extend(response("x", [1, 2, 3, 4], [0.0] * 4, 0, "stop"))
    Broken.logprobs, Broken.finish_reason = [-1.0, -1.0], "eos"
    with pytest.raises(ValueError, match="finish_reason 'eos'"):
        s.extend(Broken())


def scores(logprobs: list[float], ids: list[list[int]], lps: list[list[float]], gathered: Any = None) -> Any:
    from kubedistill.runtime.wire.protocol import ScoreResponse

    return ScoreResponse(
        logprobs=logprobs,
        topk_ids=Rows.of(ids, "int32"),
        topk_logprobs=Rows.of(lps, "float32"),
        gather_logprobs=None if gathered is None else Rows.of(gathered, "float32"),
    )


def test_teacher_scores_are_checked_against_the_response() -> None:
    s = Sample(group_id=2, index=0, prompt_ids=[1, 2], max_tokens=4)
    s.continuation()
    s.extend(response("x", [7, 8], [-1.0, -1.0], 0, "stop"))
    assert s.score_input() == ([1, 2, 7, 8], 2)
    s.set_scores("math", scores([-0.5, -0.25], [[7, 3], [8, 3]], [[-0.5, -1.0], [-0.25, -2.0]]))
    got = (s.teacher, s.signals["teacher_logprobs"], s.signals["teacher_topk_ids"][1].tolist(), s.scored)
    assert got == ("math", [-0.5, -0.25], [8, 3], True)
    with pytest.raises(ValueError, match="scored 1 log-probs, 1 top-k id rows and 1 top-k log-prob rows for 2"):
        s.set_scores("math", scores([-0.5], [[7]], [[-0.5]]))
    # A score without top-k (k1, k3 ask for none) keeps no top-k rows, not even the last score's.
    s.set_scores("math", scores([-0.75, -0.5], [[], []], [[], []]))
    assert s.signals == {"teacher_logprobs": [-0.75, -0.5]}


def test_a_wire_answers_top_k_rows_are_kept_as_views_of_its_bytes_and_short_rows_as_lists() -> None:
    import numpy as np

    from kubedistill.runtime.wire.protocol import ScoreResponse

    s = Sample(group_id=2, index=0, prompt_ids=[1, 2], max_tokens=4)
    s.continuation()
    s.extend(response("x", [7, 8], [-1.0, -1.0], 0, "stop"))
    out = ScoreResponse.model_validate_json(
        scores([-0.5, -0.25], [[7, 3], [8, 3]], [[-0.5, -1], [-0.25, -2]]).model_dump_json()
    )
    s.set_scores("math", out)
    # Arrays over the answer's bytes: a 1.5k-token top-64 answer is 192k numbers, none a Python object.
    ids, lps = s.signals["teacher_topk_ids"], s.signals["teacher_topk_logprobs"]
    assert isinstance(ids, np.ndarray) and ids.base is not None and ids.tolist() == [[7, 3], [8, 3]]
    assert isinstance(lps, np.ndarray) and lps.dtype == np.float32 and lps.tolist() == [[-0.5, -1.0], [-0.25, -2.0]]
    # A checkpoint holds plain lists (msgpack has no arrays), and they load back as lists.
    state = s.to_dict()
    assert state["signals"]["teacher_topk_ids"] == [[7, 3], [8, 3]]
    assert Sample.from_dict(state).signals["teacher_topk_logprobs"] == [[-0.5, -1.0], [-0.25, -2.0]]
    # Rows shorter than the widest (a vocabulary smaller than top-k) are kept as lists of their entries.
    s.set_scores("math", scores([-0.5, -0.25], [[7, 3], [8]], [[-0.5, -1.0], [-0.25]]))
    assert s.signals["teacher_topk_ids"] == [[7, 3], [8]]
    assert s.signals["teacher_topk_logprobs"] == [[-0.5, -1.0], [-0.25]]


def test_restart_forgets_tokens_and_scores() -> None:
    s = Sample(group_id=0, index=0, prompt_ids=[1], max_tokens=3)
    s.continuation()
    s.extend(response("x", [5], [-1.0], 0, "abort"))
    s.signals["teacher_logprobs"], s.reward = [-2.0], 1.0
    s.restart()
    assert (s.response_ids, s.versions, s.signals, s.reward, s.finish_reason) == ([], [], {}, None, None)
    assert s.continuation().prefix_token_ids == []


def test_group_versions_and_round_trip() -> None:
    g = SampleGroup.for_prompt(
        4, [1, 2], 2, max_tokens=4, data_source="gsm8k", route_value="gsm8k", ground_truth="72", images=["aGVsbG8="]
    )
    assert g.min_version is None and not g.finished
    for s, v in zip(g.samples, (2, 5)):
        s.continuation()
        s.extend(response("x", [9], [-0.5], v, "stop"))
    assert (g.min_version, g.max_version, g.finished) == (2, 5, True)
    again = SampleGroup.from_dict(g.to_dict())
    assert again == g
    with pytest.raises(ValueError, match="unknown fields"):
        Sample.from_dict({**g.samples[0].to_dict(), "bogus": 1})


async def test_resume_on_the_hf_engine_matches_an_uninterrupted_generation(tiny_models) -> None:
    """Greedy decoding interrupted after 2 tokens and continued from that prefix (under a new
    weight version) yields the same tokens and log-probs as one uninterrupted request."""
    import torch

    from kubedistill.runtime.engines.hf import HFEngine

    torch.set_num_threads(1)
    engine = HFEngine(str(tiny_models["student"]), dtype="float32")
    await engine.start()
    prompt, budget = [1, 4, 11, 14, 8, 9, 15], 6
    greedy = Sampling(max_tokens=budget, temperature=0.0)

    whole = await engine.generate(GenerateRequest(request_id="whole", prompt_token_ids=prompt, sampling=greedy))
    assert len(whole.token_ids) > 2  # there is something to continue after the interruption

    s = Sample(group_id=0, index=0, prompt_ids=prompt, max_tokens=budget)
    c = s.continuation()
    head = await engine.generate(
        GenerateRequest(
            request_id=c.request_id,
            prompt_token_ids=c.prompt_token_ids,
            prefix_token_ids=c.prefix_token_ids,
            sampling=Sampling(max_tokens=2, temperature=0.0),
        )
    )
    # What an abort at a weight sync after two tokens returns.
    s.extend(head.model_copy(update={"finish_reason": "abort"}))
    engine.version = 1  # the sync happened
    c = s.continuation()
    tail = await engine.generate(
        GenerateRequest(
            request_id=c.request_id,
            prompt_token_ids=c.prompt_token_ids,
            prefix_token_ids=c.prefix_token_ids,
            sampling=Sampling(max_tokens=c.max_tokens, temperature=0.0),
        )
    )
    s.extend(tail)

    assert s.response_ids == whole.token_ids
    assert s.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert s.versions == [0, 0] + [1] * (len(whole.token_ids) - 2)
    assert s.finish_reason == whole.finish_reason and s.resumed == 1
    await engine.shutdown()


def test_rollout_top_k_rows_follow_the_tokens_across_a_resume() -> None:
    from kubedistill.runtime.driver.batcher import BatchRequirements, to_train_batch

    s = Sample(group_id=1, index=0, prompt_ids=[1, 2], max_tokens=4, data_source="arith")
    c = s.continuation()
    s.extend(
        GenerateResponse(
            request_id=c.request_id,
            token_ids=[5],
            logprobs=[-0.1],
            versions=[0],
            finish_reason="abort",
            topk_ids=Rows.of([[5, 6]], "int32"),
        )
    )
    c = s.continuation()
    s.extend(
        GenerateResponse(
            request_id=c.request_id,
            token_ids=[7, 3],
            logprobs=[-0.2, -0.3],
            versions=[1, 1],
            finish_reason="stop",
            topk_ids=Rows.of([[7, 5], [3, 4]], "int32"),
        )
    )
    # One array across the resume (views of the answers' bytes, joined), not a Python int per id.
    held = s.signals["rollout_topk_ids"]
    assert isinstance(held, np.ndarray) and held.dtype == np.int32 and held.tolist() == [[5, 6], [7, 5], [3, 4]]
    top = ([-1.0] * 3, [[5]] * 3, [[-0.5]] * 3)
    with pytest.raises(ValueError, match="gathered log-prob rows do not match"):
        s.set_scores("t", scores(*top, gathered=[[-1.0, -2.0]] * 2))
    s.set_scores("t", scores(*top, gathered=[[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]]))
    assert isinstance(s.signals["teacher_logprobs_at_rollout_topk"], np.ndarray)
    req = BatchRequirements(group_size=1, mini_batch_size=1, contract=CONTRACTS[LossMode.reverse_kl_top_k], top_k=2)
    gather = req.gather_ids(s)
    assert req.rollout_top_k == 2 and gather is not None and gather.tolist() == [[5, 6], [7, 5], [3, 4]]
    batch = to_lists(to_train_batch([s], req, trainer_version=1))
    assert (batch.signal(ROLLOUT_TOP_K.ids), batch.signal(ROLLOUT_TOP_K.logprobs)) == (
        [[[5, 6], [7, 5], [3, 4]]],
        [[[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]]],
    )
    assert "teacher_topk_ids" not in batch.signals and batch.lag(0) == 1
    # A continuation without rows, after a prefix that has them, is refused.
    s.restart()
    assert s.signals == {}
    c = s.continuation()
    s.extend(
        response(c.request_id, [5], [-0.1], 0, "abort").model_copy(update={"topk_ids": Rows.of([[5, 6]], "int32")})
    )
    c = s.continuation()
    with pytest.raises(ValueError, match="without the top-k ids"):
        s.extend(response(c.request_id, [7], [-0.2], 0, "stop"))


def test_a_traces_observations_add_one_id_rows_and_its_rows_become_lists() -> None:
    from kubedistill.runtime.driver.batcher import BatchRequirements, sample_arrays

    def turn(c_id: str, ids: list[int], rows: list[list[int]], reason: str) -> GenerateResponse:
        return response(c_id, ids, [-0.5] * len(ids), 0, reason).model_copy(update={"topk_ids": Rows.of(rows, "int32")})

    s = Sample(group_id=3, index=0, prompt_ids=[1, 2], max_tokens=8)
    s.extend(turn(s.continuation().request_id, [5, 6], [[5, 7], [6, 8]], "stop"))
    assert isinstance(s.signals["rollout_topk_ids"], np.ndarray)
    s.add_observation([9])  # the environment's token: a one-id row, not the student's top-k
    s.extend(turn(s.continuation().request_id, [4], [[4, 3]], "stop"))
    assert s.signals["rollout_topk_ids"] == [[5, 7], [6, 8], [9], [4, 3]]
    req = BatchRequirements(group_size=1, mini_batch_size=1, contract=CONTRACTS[LossMode.reverse_kl_top_k], top_k=2)
    gather = req.gather_ids(s)
    assert gather is not None and gather.lengths == [2, 2, 1, 2] and gather.tolist() == [[5, 7], [6, 8], [9], [4, 3]]
    s.set_scores(
        "t", scores([-1.0] * 4, [[]] * 4, [[]] * 4, gathered=[[-1.0, -2.0], [-1.5, -2.5], [-0.5], [-3.0, -4.0]])
    )
    a = sample_arrays(s, req)
    assert a.widths["rollout_topk_ids"].tolist() == [2, 2, 1, 2]
    assert a.signals["teacher_logprobs_at_rollout_topk"][2].tolist() == [-0.5, 0.0]
    assert a.loss_mask is not None and a.loss_mask.tolist() == [True, True, False, True]
