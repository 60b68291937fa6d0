"""Rollout and teacher servers on the hf engine (fast): the wire protocol, bad requests, abort
and resume, and weight sync to two replicas bit for bit. Servers come from server_fixtures."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import torch

from kubedistill.runtime.driver.clients import RolloutClient, ServerError, TeacherClient
from kubedistill.runtime.weight_sync.manifest import tensor_checksum
from kubedistill.runtime.weight_sync.sender import WeightSyncError
from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling, ScoreRequest

torch.set_num_threads(1)
PROMPT = [1, 5, 6, 14, 7]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def reference_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


def perturbed(path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The trainer's side: an HF model's named_parameters (a tied lm_head is not among them)."""
    model = hf_model(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def expected_checksums(named) -> dict[str, str]:
    out = {n: tensor_checksum(t) for n, t in named}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied
    return out


def model_with(path, named):
    model = hf_model(path)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for n, t in named:
            params[n].copy_(t)
    return model


async def wait_in_flight(c: RolloutClient, gen: asyncio.Task[Any], then: float = 0.15) -> None:
    """Return shortly after the /generate `gen` is in flight on the server (the metrics request
    itself counts as one more request in flight), or once it has finished: on a loaded machine a
    short generation can start and end between two polls, which the callers' retries handle."""
    for _ in range(1000):
        if gen.done():
            return
        text = await c.metrics_text()
        line = next(ln for ln in text.splitlines() if ln.startswith("kubedistill_requests_in_flight{"))
        if float(line.rsplit(" ", 1)[1]) >= 2:
            await asyncio.sleep(then)
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the generation never reached the server")


async def test_generate_returns_tokens_logprobs_versions(hf_servers, tiny_models) -> None:
    async with RolloutClient(hf_servers.rollout_urls[0]) as c:
        version = await c.version()
        out = await c.generate(
            GenerateRequest(
                request_id="g1", prompt_token_ids=PROMPT, sampling=Sampling(max_tokens=12, temperature=1.0, seed=3)
            )
        )
    n = len(out.token_ids)
    assert 1 <= n <= 12 and len(out.logprobs) == n and out.versions == [version] * n
    assert out.finish_reason in ("stop", "length")
    if version == 0:  # log-probs are the served model's own log-softmax at each sampled token
        ref = reference_logprobs(hf_model(tiny_models["student"]), PROMPT, out.token_ids)
        assert out.logprobs == pytest.approx(ref, abs=1e-4)


async def test_prefix_continues_a_greedy_generation(hf_servers) -> None:
    async with RolloutClient(hf_servers.rollout_urls[1]) as c:
        greedy = Sampling(max_tokens=10, temperature=0.0, ignore_eos=True)
        full = await c.generate(GenerateRequest(request_id="p-full", prompt_token_ids=PROMPT, sampling=greedy))
        cont = await c.generate(
            GenerateRequest(
                request_id="p-cont", prompt_token_ids=PROMPT, sampling=greedy, prefix_token_ids=full.token_ids[:3]
            )
        )
    # Only the new tokens come back, and max_tokens counts the prefix.
    assert len(full.token_ids) == 10
    assert cont.token_ids == full.token_ids[3:]
    assert cont.logprobs == pytest.approx(full.logprobs[3:], abs=1e-4)


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"request_id": "e", "prompt_token_ids": []}, 400, "prompt_token_ids is empty"),
        ({"request_id": "e", "prompt_token_ids": [1] * 600}, 400, "max_model_len"),
        ({"request_id": "e", "prompt_token_ids": [1, 99]}, 400, "token id 99"),
        # Images to a text-only student: refused in one line, never silently dropped.
        ({"request_id": "e", "prompt_token_ids": [1], "images": ["aGk="]}, 400, "model is text-only"),
        (
            {"request_id": "e", "prompt_token_ids": [1], "prefix_token_ids": [5] * 4, "sampling": {"max_tokens": 4}},
            400,
            "nothing left to generate",
        ),
        ({"request_id": "e", "prompt_token_ids": [1], "sampling": {"n": 2}}, 422, "sampling.n"),
        ({"prompt_token_ids": [1]}, 422, "request_id"),
        # Past what a generator's seed holds (was a 500 and a dropped connection).
        ({"request_id": "e", "prompt_token_ids": [1], "sampling": {"seed": 2**64}}, 422, "sampling.seed"),
        # Strict wire types: no coercion of booleans into token ids or strings into numbers.
        ({"request_id": "e", "prompt_token_ids": [True, False]}, 422, "prompt_token_ids"),
        ({"request_id": "e", "prompt_token_ids": [1], "sampling": {"max_tokens": "10"}}, 422, "sampling.max_tokens"),
    ],
)
def test_bad_generate_requests_get_4xx_and_server_keeps_serving(hf_servers, body, status, message) -> None:
    url = hf_servers.rollout_urls[0]
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    ok = httpx.post(
        url + "/generate",
        json={"request_id": "after-bad", "prompt_token_ids": PROMPT, "sampling": {"max_tokens": 2}},
        timeout=60,
    )
    assert ok.status_code == 200


async def test_abort_unknown_request_is_404(hf_servers) -> None:
    async with RolloutClient(hf_servers.rollout_urls[0]) as c:
        with pytest.raises(ServerError, match="no request in flight with id 'nope'") as e:
            await c.abort(["nope"])
        assert e.value.status == 404
        assert (await c.health()).status == "ok"


async def test_abort_returns_the_partial_output(hf_servers) -> None:
    # A tiny model decodes 251 tokens in well under a second, so on a loaded machine the request
    # can finish before the abort arrives (then /abort is a 404): a few tries must abort one.
    max_tokens = 256 - len(PROMPT)
    async with RolloutClient(hf_servers.rollout_urls[0]) as c:
        for attempt in range(5):
            rid = f"long-{attempt}"
            gen = asyncio.create_task(
                c.generate(
                    GenerateRequest(
                        request_id=rid,
                        prompt_token_ids=PROMPT,
                        sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                    )
                )
            )
            await wait_in_flight(c, gen, then=0.02)
            try:
                aborted = await c.abort([rid])
            except ServerError as e:
                assert e.status == 404, e
                aborted = None
            out = await gen
            if aborted is not None:
                break
            assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
    assert aborted is not None, "every generation finished before it could be aborted"
    assert aborted.aborted == [rid]
    assert out.finish_reason == "abort" and aborted.outputs[rid].finish_reason == "abort"
    assert len(out.token_ids) == len(aborted.outputs[rid].token_ids) < max_tokens
    assert out.token_ids == aborted.outputs[rid].token_ids
    assert len(out.logprobs) == len(out.versions) == len(out.token_ids)


def teacher_tokens(metrics: str) -> float:
    prefix = 'kubedistill_teacher_tokens_total{job="test",replica="0",role="teacher",teacher="math"} '
    return float(next(ln for ln in metrics.splitlines() if ln.startswith(prefix)).rsplit(" ", 1)[1])


async def batches_served(c: RolloutClient | TeacherClient, endpoint: str, at_least: float = 0.0) -> float:
    """The server's count of answered batch requests to `endpoint`, once it reaches `at_least` (a
    stream's last frame reaches the client a moment before the server counts the request)."""
    for _ in range(100):
        text = await c.metrics_text()
        prefix = f'kubedistill_requests_total{{code="200",endpoint="{endpoint}"'
        served = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(prefix))
        if served >= at_least:
            return served
        await asyncio.sleep(0.02)
    return served


async def test_requests_made_together_go_as_one_batch_and_each_is_answered_when_done(hf_servers) -> None:
    long_tokens = 256 - len(PROMPT)
    async with RolloutClient(hf_servers.rollout_urls[0]) as c:
        before = await batches_served(c, "/generate/batch")
        greedy = Sampling(max_tokens=long_tokens, temperature=0.0, ignore_eos=True)
        long = asyncio.ensure_future(
            c.generate(GenerateRequest(request_id="b-long", prompt_token_ids=PROMPT, sampling=greedy))
        )
        short = asyncio.ensure_future(
            c.generate(GenerateRequest(request_id="b-short", prompt_token_ids=PROMPT, sampling=Sampling(max_tokens=1)))
        )
        bad = asyncio.ensure_future(c.generate(GenerateRequest(request_id="b-bad", prompt_token_ids=[1, 99])))
        done, _ = await asyncio.wait([long, short], return_when=asyncio.FIRST_COMPLETED)
        # The short answer streams back while the long generation of the same batch goes on.
        assert done == {short} and len(short.result().token_ids) == 1
        with pytest.raises(ServerError, match="token id 99") as e:
            await bad
        assert e.value.status == 400
        assert (await long).request_id == "b-long" and len(long.result().token_ids) == long_tokens
        assert await batches_served(c, "/generate/batch", before + 1) == before + 1
    tokens = PROMPT + [8, 9, 10, 11]
    async with TeacherClient(hf_servers.teacher.url) as t:
        before = await batches_served(t, "/score/batch")
        a, b = await asyncio.gather(
            t.score(ScoreRequest(token_ids=tokens, prompt_len=len(PROMPT), top_k=4)),
            t.score(ScoreRequest(token_ids=tokens[:-1], prompt_len=len(PROMPT), top_k=4)),
        )
        assert await batches_served(t, "/score/batch", before + 1) == before + 1
    assert len(a.logprobs) == 4 and len(b.logprobs) == 3
    assert b.logprobs == pytest.approx(a.logprobs[:3], abs=1e-5)  # causal: the same prefix, the same scores


async def test_score_matches_the_teacher_model(hf_servers, tiny_models) -> None:
    tokens, prompt_len = PROMPT + [8, 9, 10, 11], len(PROMPT)
    async with TeacherClient(hf_servers.teacher.url) as c:
        scored_before = teacher_tokens(await c.metrics_text())
        out = await c.score(ScoreRequest(token_ids=tokens, prompt_len=prompt_len, top_k=4))
        with pytest.raises(ServerError, match="prompt_len") as bad:
            await c.score(ScoreRequest(token_ids=PROMPT, prompt_len=len(PROMPT), top_k=4))
        assert bad.value.status == 400
        with pytest.raises(ServerError, match="text-only") as text_only:
            await c.score(ScoreRequest(token_ids=tokens, prompt_len=prompt_len, top_k=4, images=["aGk="]))
        assert text_only.value.status == 400 and "\n" not in text_only.value.message
        bare = await c.score(ScoreRequest(token_ids=tokens, prompt_len=prompt_len, top_k=0))
    assert bare.logprobs == pytest.approx(out.logprobs, abs=1e-6)
    assert bare.topk_ids.shape == bare.topk_logprobs.shape == (4, 0)
    model = hf_model(tiny_models["teacher"])
    assert out.logprobs == pytest.approx(reference_logprobs(model, tokens[:prompt_len], tokens[prompt_len:]), abs=1e-4)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0], -1)[prompt_len - 1 : -1]
    top = lp.topk(4, -1)
    assert out.topk_ids.tolist() == top.indices.tolist()
    assert torch.allclose(torch.tensor(out.topk_logprobs.tolist()), top.values, atol=1e-4)
    # out's 4 tokens and bare's (other tests score on the same server)
    assert teacher_tokens(httpx.get(hf_servers.teacher.url + "/metrics").text) == scored_before + 8


def test_weight_sync_reaches_both_replicas_bit_for_bit(hf_servers, tiny_models) -> None:
    before = [httpx.get(u + "/version").json()["version"] for u in hf_servers.rollout_urls]
    named = perturbed(tiny_models["student"], seed=1)
    version = max(before) + 1
    stats = hf_servers.sender.sync(version, named)
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in named)
    want = expected_checksums(named)
    for url in hf_servers.rollout_urls:
        assert httpx.get(url + "/version").json()["version"] == version
        assert httpx.get(url + "/weights/checksums", timeout=60).json() == want
        metrics = httpx.get(url + "/metrics").text
        assert (
            f'kubedistill_weight_version{{job="test",replica="{hf_servers.rollout_urls.index(url)}",'
            f'role="rollout"}} {version}.0' in metrics
        )
        assert "kubedistill_weight_sync_bytes_total" in metrics and "kubedistill_weight_sync_seconds_count" in metrics
    # The new weights are the ones generating: log-probs match the synced model.
    out = httpx.post(
        hf_servers.rollout_urls[0] + "/generate",
        json={"request_id": "after-sync", "prompt_token_ids": PROMPT, "sampling": {"max_tokens": 6, "temperature": 0}},
        timeout=60,
    ).json()
    assert out["versions"] == [version] * len(out["token_ids"])
    model = model_with(tiny_models["student"], named)
    assert out["logprobs"] == pytest.approx(reference_logprobs(model, PROMPT, out["token_ids"]), abs=1e-4)


def test_manifest_mismatch_is_refused_and_servers_keep_serving(hf_servers, tiny_models) -> None:
    before = [httpx.get(u + "/version").json()["version"] for u in hf_servers.rollout_urls]
    wrong = [(n, p.detach()) for n, p in hf_model(tiny_models["teacher"]).named_parameters()]
    with pytest.raises(WeightSyncError, match="manifest mismatch: unknown tensors model.layers.2"):
        hf_servers.sender.sync(99, wrong)
    assert [httpx.get(u + "/version").json()["version"] for u in hf_servers.rollout_urls] == before
    # The group is still in step: a correct sync right after works.
    named = perturbed(tiny_models["student"], seed=2)
    hf_servers.sender.sync(max(before) + 1, named)
    assert httpx.get(hf_servers.rollout_urls[1] + "/weights/checksums", timeout=60).json() == expected_checksums(named)


async def test_partial_rollout_resume_aborts_at_sync_then_continues_under_new_weights(hf_servers, tiny_models) -> None:
    # hf_servers runs with partialRollout: resume, so a sync aborts the generations in flight. The
    # generation may finish before the sync reaches the server on a loaded machine: a few tries
    # (each one a real sync) must catch one mid-generation.
    url = hf_servers.rollout_urls[0]
    async with RolloutClient(url) as c:
        for attempt in range(4):
            v0 = httpx.get(url + "/version").json()["version"]
            named = perturbed(tiny_models["student"], seed=3 + attempt)
            gen = asyncio.create_task(
                c.generate(
                    GenerateRequest(
                        request_id="straggler",
                        prompt_token_ids=PROMPT,
                        sampling=Sampling(max_tokens=300, temperature=0.0, ignore_eos=True),
                    )
                )
            )
            await wait_in_flight(c, gen, then=0.02)
            await asyncio.to_thread(hf_servers.sender.sync, v0 + 1, named)
            first = await gen
            assert first.versions == [v0] * len(first.versions)
            if first.finish_reason == "abort":
                break
            assert first.finish_reason == "length" and len(first.token_ids) == 256 - len(PROMPT)
        assert first.finish_reason == "abort", "every generation finished before the sync reached the server"
        assert len(first.token_ids) > 0
        resumed = await c.generate(
            GenerateRequest(
                request_id="straggler",
                prompt_token_ids=PROMPT,
                prefix_token_ids=first.token_ids,
                sampling=Sampling(max_tokens=len(first.token_ids) + 5, temperature=0.0, ignore_eos=True),
            )
        )
    assert resumed.versions == [v0 + 1] * 5 and resumed.finish_reason == "length"
    ref = reference_logprobs(model_with(tiny_models["student"], named), PROMPT + first.token_ids, resumed.token_ids)
    assert resumed.logprobs == pytest.approx(ref, abs=1e-4)


def test_rollout_servers_report_their_weight_dtype_to_the_sender(hf_servers) -> None:
    r = httpx.get(hf_servers.rollout_urls[0] + "/weights/group", timeout=30)
    assert r.status_code == 200 and r.json()["dtype"] == "float32"
    hf_servers.sender.ensure_group()
    assert hf_servers.sender.wire_dtype == "float32"
