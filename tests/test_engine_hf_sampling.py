"""Sampling settings and inference limits on the hf engine, in-process on the tiny student:
topK, repetition penalty, stop strings and stop ids as vLLM applies them, the tokenizer it
decodes with, and /score batched at most maxNumSeqs sequences at a time. The spec -> wire
mapping and vLLM's SamplingParams: tests/test_sampling_api.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kubedistill.runtime.engines.hf import HFEngine, _top_k, inverse_cdf
from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling, ScoreRequest

torch.set_num_threads(1)
PROMPT = [1, 5, 6, 14, 7]


@pytest.fixture
async def student(tiny_models: dict[str, Path]) -> AsyncIterator[HFEngine]:
    engine = HFEngine(str(tiny_models["student"]), dtype="float32", max_num_seqs=2)
    await engine.start()
    yield engine
    await engine.shutdown()


def request(rid: str, **sampling: Any) -> GenerateRequest:
    sampling = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, **sampling}
    return GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=Sampling(**sampling))


def test_top_k_keeps_the_k_most_likely_renormalised() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.4, 0.1]])
    kept = _top_k(probs, torch.tensor([[2], [0]]))
    assert torch.allclose(kept[0], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    assert torch.equal(kept[1], probs[1])  # 0: every token


def test_a_seeded_row_draws_exactly_from_its_distribution_by_inverse_cdf() -> None:
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    # The edges: u = 0 takes the first token with mass, u just under 1 the last one.
    assert inverse_cdf(probs, torch.zeros(3)).tolist() == [0, 2, 0]
    assert inverse_cdf(probs, torch.full((3,), 1 - 1e-7)).tolist() == [3, 2, 1]
    # Unnormalised rows (top-k/top-p leave sums a rounding off 1) scale u by their total.
    assert inverse_cdf(probs[:1] * 0.5, torch.tensor([0.69])).tolist() == [2]
    # Over many uniforms each token's frequency is its probability; a zero is never drawn.
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    picked = inverse_cdf(probs[:1].expand(len(u), -1), u)
    freq = torch.bincount(picked, minlength=4).double() / len(u)
    assert freq[1] == 0 and torch.allclose(freq, probs[0].double(), atol=0.005)


async def test_top_k_1_samples_greedily(student: HFEngine) -> None:
    greedy = await student.generate(request("g"))
    sampled = await asyncio.gather(*(student.generate(request(f"k{i}", temperature=1.0, top_k=1)) for i in range(3)))
    seeded = await student.generate(request("ks", temperature=1.5, top_k=1, seed=3))
    assert all(s.token_ids == greedy.token_ids for s in [*sampled, seeded])
    # The reported log-probs stay the model's own (the behaviour policy the losses read).
    assert sampled[0].logprobs == pytest.approx(greedy.logprobs, abs=1e-5)


async def test_repetition_penalty_is_transformers(student: HFEngine, tiny_models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["student"]), dtype=torch.float32).eval()
    penalty = RepetitionPenaltyLogitsProcessor(1.8)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(24):
            logits = model(input_ids=torch.tensor([ids])).logits[:, -1]
            ids.append(int(penalty(torch.tensor([ids]), logits).argmax()))
    out = await student.generate(request("p", repetition_penalty=1.8))
    plain = await student.generate(request("plain"))
    assert out.token_ids == ids[len(PROMPT) :]
    assert out.token_ids != plain.token_ids, "the penalty changed nothing: pick a larger one"


async def test_stop_strings_and_ids_end_the_response_with_their_token(student: HFEngine) -> None:
    full = await student.generate(request("full"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student.tokenizer_path)
    text = tok.decode(full.token_ids, skip_special_tokens=True)
    assert len(text) == len(full.token_ids), "the tiny tokenizer is one character per token"
    stop = text[5:7]
    end = text.index(stop) + len(stop)  # the first occurrence ends the response
    by_text = await student.generate(request("st", stop=[stop, "never-generated"]))
    assert by_text.finish_reason == "stop" and by_text.token_ids == full.token_ids[:end]
    stop_id = full.token_ids[4]
    by_id = await student.generate(request("si", stop_token_ids=[stop_id]))  # despite ignore_eos
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]


async def test_stop_strings_decode_with_the_spec_tokenizer(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from transformers import AutoTokenizer

    # The model's directory without a tokenizer; the tokenizer in a directory of its own.
    model, tokenizer = tmp_path / "model", tmp_path / "tokenizer"
    model.mkdir()
    for f in tiny_models["student"].iterdir():
        if f.name == "config.json" or f.name == "generation_config.json" or f.suffix == ".safetensors":
            shutil.copy(f, model / f.name)
    AutoTokenizer.from_pretrained(str(tiny_models["student"])).save_pretrained(str(tokenizer))
    engine = HFEngine(str(model), dtype="float32", tokenizer=str(tokenizer))
    await engine.start()
    try:
        full = await engine.generate(request("full"))
        text = AutoTokenizer.from_pretrained(str(tokenizer)).decode(full.token_ids, skip_special_tokens=True)
        stopped = await engine.generate(request("stop", stop=[text[3:5]]))
        assert stopped.finish_reason == "stop" and stopped.token_ids == full.token_ids[: text.index(text[3:5]) + 2]
        assert engine._tokenizer.name_or_path == str(tokenizer)
    finally:
        await engine.shutdown()


async def test_score_batches_at_most_max_num_seqs_sequences(student: HFEngine) -> None:
    reqs = [ScoreRequest(token_ids=[1, 5, 6, 14 - i, 7, 9], prompt_len=2, top_k=2) for i in range(5)]
    before = student.forwards["score"]
    outs = await asyncio.gather(*(student.score(r) for r in reqs))
    assert student.forwards["score"] - before == 3  # 2 + 2 + 1
    alone = [await student.score(r) for r in reqs[:2]]
    for o, a in zip(outs, alone):
        assert o.logprobs == pytest.approx(a.logprobs, abs=1e-5)
