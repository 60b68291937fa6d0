"""spec.rollout.sampling's group size, temperature, topP, maxTokens and seed reach every
/generate request the driver sends (topK, repetitionPenalty and the stops:
tests/test_sampling_api.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from driver_fakes import job_spec, rig
from kubedistill.runtime.driver.loop import request_seed


async def test_every_rollout_request_carries_the_group_size_temperature_top_p_budget_and_seed(tmp_path: Path) -> None:
    spec = job_spec(tmp_path, steps=2, n=4, mini_batch=8, max_tokens=5)
    raw = spec.to_api()
    raw["rollout"]["sampling"].update(temperature=0.7, topP=0.9, seed=11)
    spec = type(spec).model_validate(raw)
    r = rig(spec)
    await r.run()
    sent = [q for s in r.cluster.rollouts.values() for q in s.requests]
    assert sent
    for q in sent:
        assert (q.sampling.temperature, q.sampling.top_p, q.sampling.max_tokens) == (0.7, 0.9, 5)
        assert q.sampling.seed is not None
    # Each request's seed derives from the spec's and the sample's place (request_seed).
    assert len({q.sampling.seed for q in sent}) == len(sent)
    per_prompt = Counter(tuple(q.prompt_token_ids) for q in sent)
    assert set(per_prompt.values()) <= {4, 8}, "samplesPerPrompt responses per prompt (a prompt may come twice)"


def test_an_unset_seed_leaves_sampling_unseeded() -> None:
    from kubedistill.runtime.driver.samples import Sample

    s = Sample(group_id=1, index=0, prompt_ids=[1], max_tokens=4)
    assert request_seed(None, s) is None
    assert request_seed(11, s) != request_seed(12, s)
