"""Samples: per-token versions and partial-rollout resume (prefix + continuation)."""

from __future__ import annotations

import pytest

from kubedistill.runtime.driver.samples import Sample, SampleGroup
from kubedistill.runtime.protocol import GenerateRequest, GenerateResponse, Sampling


def response(req_id: str, ids, lps, version: int, reason: str) -> GenerateResponse:
    return GenerateResponse(request_id=req_id, token_ids=ids, logprobs=lps, versions=[version] * len(ids),
                            finish_reason=reason)


def test_resume_after_abort_merges_prefix_and_continuation() -> None:
    s = Sample(group_id=7, index=1, prompt_ids=[1, 2, 3], max_tokens=6, data_source="arith")
    first = s.continuation()
    assert (first.request_id, first.prefix_token_ids, first.max_tokens) == ("7-1-r1", [], 6)
    s.extend(response(first.request_id, [10, 11], [-0.1, -0.2], 3, "abort"))
    assert s.needs_resume and not s.finished

    second = s.continuation()
    # The wire request the driver sends: prompt unchanged, the tokens so far as the prefix.
    req = GenerateRequest(request_id=second.request_id, prompt_token_ids=second.prompt_token_ids,
                          prefix_token_ids=second.prefix_token_ids, sampling=Sampling(max_tokens=second.max_tokens))
    assert (req.request_id, req.prompt_token_ids, req.prefix_token_ids, req.sampling.max_tokens) == (
        "7-1-r2", [1, 2, 3], [10, 11], 4)
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


def test_restart_forgets_tokens_and_scores() -> None:
    s = Sample(group_id=0, index=0, prompt_ids=[1], max_tokens=3)
    s.continuation()
    s.extend(response("x", [5], [-1.0], 0, "abort"))
    s.teacher_logprobs, s.reward = [-2.0], 1.0
    s.restart()
    assert (s.response_ids, s.versions, s.teacher_logprobs, s.reward, s.finish_reason) == ([], [], None, None, None)
    assert s.continuation().prefix_token_ids == []


def test_group_versions_and_round_trip() -> None:
    g = SampleGroup.for_prompt(4, [1, 2], 2, max_tokens=4, data_source="gsm8k", route_value="gsm8k",
                               ground_truth="72", images=["aGVsbG8="])
    assert g.min_version is None and not g.finished
    for s, v in zip(g.samples, (2, 5)):
        s.continuation()
        s.extend(response("x", [9], [-0.5], v, "stop"))
    assert (g.min_version, g.max_version, g.finished) == (2, 5, True)
    again = SampleGroup.from_dict(g.to_dict())
    assert again == g
    with pytest.raises(ValueError, match="unknown fields"):
        Sample.from_dict({**g.samples[0].to_dict(), "bogus": 1})
