"""spec.rollout.sampling's topK, repetitionPenalty, stop and stopTokenIds: the driver sends them
with every /generate (through the fake rig), vLLM gets them as SamplingParams, the servers refuse
a stop id outside the vocabulary. The hf engine's own sampling: tests/test_engine_hf_sampling.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver_fakes import job_spec, rig
from kubedistill.runtime.engines.base import BadRequest, check_generate
from kubedistill.runtime.engines.vllm_engine import sampling_params
from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling

SAMPLING = {"topK": 5, "repetitionPenalty": 1.3, "stop": ["\n\n", "###"], "stopTokenIds": [7, 9]}


async def test_every_rollout_request_carries_the_specs_sampling(tmp_path: Path) -> None:
    spec = job_spec(tmp_path, steps=1)
    raw = spec.to_api()
    raw["rollout"]["sampling"].update(SAMPLING)
    spec = type(spec).model_validate(raw)
    r = rig(spec)
    await r.run()
    sent = [q.sampling for s in r.cluster.rollouts.values() for q in s.requests]
    assert sent
    for s in sent:
        assert (s.top_k, s.repetition_penalty, s.stop, s.stop_token_ids) == (5, 1.3, ["\n\n", "###"], [7, 9])
    default = job_spec(tmp_path / "default", steps=1).rollout.sampling
    assert (default.top_k, default.repetition_penalty, default.stop, default.stop_token_ids) == (None, 1.0, [], [])


def test_vllm_gets_them_as_sampling_params() -> None:
    from vllm import SamplingParams

    s = Sampling(
        max_tokens=8,
        temperature=0.35,
        top_p=0.9,
        top_k=500,
        repetition_penalty=1.3,
        stop=["###"],
        stop_token_ids=[7, 9],
    )
    params = SamplingParams(**sampling_params(s, 8, 100, None))
    assert (params.temperature, params.top_p) == (0.35, 0.9)
    assert params.top_k == 100, "clamped to the vocabulary"
    assert params.repetition_penalty == 1.3 and params.stop == ["###"] and params.stop_token_ids == [7, 9]
    assert params.detokenize, "vLLM matches stop strings on the text"
    plain = SamplingParams(**sampling_params(Sampling(max_tokens=8), 8, 100, None))
    assert plain.top_k == 0 and not plain.detokenize and plain.stop == [] and plain.repetition_penalty == 1.0


def test_a_stop_id_outside_the_vocabulary_is_a_400() -> None:
    req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=Sampling(stop_token_ids=[3, 100]))
    with pytest.raises(BadRequest, match="sampling.stop_token_ids"):
        check_generate(req, 64, 100)


def test_the_hf_engine_gets_the_models_tokenizer(tmp_path: Path) -> None:
    from kubedistill.api.spec import Engine
    from kubedistill.runtime.engines.factory import make_engine
    from kubedistill.runtime.engines.hf import HFEngine

    student = {"model": str(tmp_path / "student"), "tokenizer": str(tmp_path / "tok")}
    spec = job_spec(tmp_path, student=student, rollout={"inference": {"engine": "hf"}})
    engine = make_engine(spec, spec.student, spec.rollout.inference)
    assert isinstance(engine, HFEngine) and engine.tokenizer_path == str(tmp_path / "tok")
    teacher = spec.teachers[0]  # no tokenizer of its own: the model's directory
    engine = make_engine(spec, teacher, teacher.inference.model_copy(update={"engine": Engine.hf}))
    assert isinstance(engine, HFEngine) and engine.tokenizer_path == teacher.model
