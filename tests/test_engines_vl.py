"""Both engines serving a vision-language student (the tiny Qwen3-VL, kubedistill/demo/tiny_vl.py)
in-process: one vLLM-CPU engine and one hf engine for the module, on one event loop.

Requests carry the processor-expanded ids (one image pad per merged patch) and the base64 images,
as the driver sends them. Each engine's generated log-probs and scores must equal a transformers
forward of the same ids with the processor's pixels (float32, 1e-4): the rollout half of the lag-0
criterion. Then both engines take a VL student's weights from a real gloo group, as rollout
servers do: all of them, then all but a frozen vision tower.
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from kubedistill.demo import dots
from kubedistill.demo.tiny_vl import build_tiny_vl_model
from kubedistill.runtime.driver.multimodal import RenderedImages, image_bytes, open_images, render_images
from kubedistill.runtime.engines.base import BadRequest, Engine, PauseMode
from kubedistill.runtime.engines.hf import HFEngine
from kubedistill.runtime.weight_sync.group import GroupAddress, WeightSyncGroup
from kubedistill.runtime.weight_sync.manifest import tensor_checksum
from kubedistill.runtime.weight_sync.sender import build_manifest
from kubedistill.runtime.weight_sync.transfer import send
from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling, ScoreRequest
from server_fixtures import free_port

torch.set_num_threads(1)
pytestmark = pytest.mark.asyncio(loop_scope="module")

ENGINES = ["vllm", "hf"]
EMBED = "model.language_model.embed_tokens.weight"
TOWER = "model.visual."
TOL = 1e-4
GAPS: dict[str, float] = {}
"""Largest log-prob gap to transformers seen per check (printed at the end of the module: -s)."""


@dataclass(frozen=True)
class Sample:
    """A dots row rendered by the student's processor, as the driver renders it."""

    rendered: RenderedImages
    image: str  # base64
    inputs: dict[str, torch.Tensor]  # the processor's pixel_values and image_grid_thw

    @property
    def ids(self) -> list[int]:
        return self.rendered.prompt_ids


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vl_model(tmp_path_factory.mktemp("vl-engines") / "student", seed=0)


@pytest.fixture(scope="module")
def samples(student: Path) -> list[Sample]:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(student)
    out = []
    for count in (1, 2, 3):
        row = dots.verl_row(dots.Problem(count, 10 + count), count)
        rendered = render_images(row["prompt"], row["images"], proc, f"row {count}")
        images = open_images(image_bytes(row["images"], "row"), "row")
        enc = proc(text=[rendered.text], images=images, return_tensors="pt", add_special_tokens=False)
        assert enc["input_ids"][0].tolist() == rendered.prompt_ids
        inputs = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
        out.append(Sample(rendered, base64.b64encode(row["images"][0]["bytes"]).decode(), inputs))
    return out


def hf_vl_model(path: Path, named: list[tuple[str, torch.Tensor]] = ()) -> Any:  # type: ignore[assignment]
    """The transformers model, with `named` weights copied in."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in named:
            params[n].copy_(t)
    return model


@pytest.fixture(scope="module")
def reference_model(student: Path) -> Any:
    return hf_vl_model(student)


@torch.no_grad()
def log_softmax(model: Any, ids: list[int], sample: Sample | None) -> torch.Tensor:
    """transformers' log-probs [len(ids), vocab] of every position of `ids` (the sample's image
    with it), as the trainer computes them."""
    t = torch.tensor([ids])
    extra: dict[str, torch.Tensor] = {}
    if sample is not None:
        extra = {**sample.inputs, "mm_token_type_ids": (t == model.config.image_token_id).int()}
    return torch.log_softmax(model(input_ids=t, **extra).logits[0].float(), -1)


def token_logprobs(model: Any, prompt: list[int], response: list[int], sample: Sample | None) -> list[float]:
    lp = log_softmax(model, prompt + response, sample)
    return [float(lp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(response)]


def gap(name: str, got: list[float], want: list[float]) -> float:
    assert len(got) == len(want) > 0
    g = max(abs(a - b) for a, b in zip(got, want))
    GAPS[name] = max(GAPS.get(name, 0.0), g)
    return g


@pytest.fixture(scope="module")
def _engine_env() -> Iterator[None]:
    """The vLLM engine's core process inherits this process's environment: keep its settings
    (thread binding, KV cache size) from leaking into later tests."""
    saved = dict(os.environ)
    os.environ.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(student: Path, _engine_env: None) -> AsyncIterator[dict[str, Engine]]:
    from kubedistill.runtime.engines.vllm_engine import VLLMEngine

    vllm = VLLMEngine(str(student), device="cpu", dtype="auto", max_model_len=256, kv_cache_gib=1, max_num_seqs=8)
    hf = HFEngine(str(student), dtype="float32")
    await asyncio.gather(vllm.start(), hf.start())
    assert vllm.kwargs["limit_mm_per_prompt"] == {"image": 8, "video": 0}
    yield {"vllm": vllm, "hf": hf}
    await asyncio.gather(vllm.shutdown(), hf.shutdown())
    if GAPS:
        print("largest log-prob gaps to transformers:", {k: f"{v:.1e}" for k, v in sorted(GAPS.items())})


def sampled(seed: int, max_tokens: int = 10) -> Sampling:
    return Sampling(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


GREEDY = Sampling(max_tokens=10, temperature=0.0, ignore_eos=True)
TEXT_PROMPT = [1, 280, 281, 282, 38]


@pytest.mark.parametrize("name", ENGINES)
async def test_generate_with_images_gives_transformers_logprobs(
    name: str, engines: dict[str, Engine], samples: list[Sample], reference_model: Any
) -> None:
    """Image requests join a running text request (on hf: one batch, image rows joining and
    leaving it at different steps): every token's log-prob is transformers' on the expanded ids
    with the image, and a seed gives the same tokens again."""
    engine = engines[name]
    lengths = [6, 12, 9]
    reqs = [
        GenerateRequest(
            request_id=f"{name}-img{i}", prompt_token_ids=s.ids, images=[s.image], sampling=sampled(i, lengths[i])
        )
        for i, s in enumerate(samples)
    ]
    text = GenerateRequest(request_id=f"{name}-text", prompt_token_ids=TEXT_PROMPT, sampling=sampled(7, 40))
    running = asyncio.create_task(engine.generate(text))
    for _ in range(2000):  # until it decodes (or is done): the image requests then join its batch
        state = engine.inflight.get(text.request_id)
        if running.done() or (state is not None and len(state.token_ids) >= 3):
            break
        await asyncio.sleep(0.001)
    outs = [*await asyncio.gather(*(engine.generate(r) for r in reqs)), await running]
    for s, req, out in zip([*samples, None], [*reqs, text], outs):
        prompt = s.ids if s is not None else TEXT_PROMPT
        n = req.sampling.max_tokens
        assert len(out.token_ids) == n and out.versions == [0] * n
        want = token_logprobs(reference_model, prompt, out.token_ids, s)
        assert gap(f"{name} generate", out.logprobs, want) < TOL
    again = await engine.generate(reqs[1].model_copy(update={"request_id": f"{name}-again"}))
    assert again.token_ids == outs[1].token_ids


@pytest.mark.parametrize("name", ENGINES)
async def test_a_resumed_request_continues_with_its_image(
    name: str, engines: dict[str, Engine], samples: list[Sample], reference_model: Any
) -> None:
    engine, s = engines[name], samples[1]
    full = await engine.generate(
        GenerateRequest(request_id=f"{name}-full", prompt_token_ids=s.ids, images=[s.image], sampling=GREEDY)
    )
    cont = await engine.generate(
        GenerateRequest(
            request_id=f"{name}-cont",
            prompt_token_ids=s.ids,
            images=[s.image],
            prefix_token_ids=full.token_ids[:4],
            sampling=GREEDY,
        )
    )
    assert cont.token_ids == full.token_ids[4:]  # only the new tokens; max_tokens counts the prefix
    want = token_logprobs(reference_model, s.ids + full.token_ids[:4], cont.token_ids, s)
    assert gap(f"{name} resumed", cont.logprobs, want) < TOL


@pytest.mark.parametrize("name", ENGINES)
async def test_score_with_images_gives_transformers_logprobs_and_top_k(
    name: str, engines: dict[str, Engine], samples: list[Sample], reference_model: Any
) -> None:
    engine = engines[name]
    responses = [[300 + i, 40, 41, 2, 17, 280 - i] for i in range(len(samples))]
    reqs = [
        ScoreRequest(token_ids=s.ids + r, prompt_len=len(s.ids), top_k=4, images=[s.image])
        for s, r in zip(samples, responses)
    ]
    reqs.append(ScoreRequest(token_ids=TEXT_PROMPT + responses[0], prompt_len=len(TEXT_PROMPT), top_k=4))
    outs = await asyncio.gather(*(engine.score(r) for r in reqs))
    for s, req, out in zip([*samples, None], reqs, outs):
        lp = log_softmax(reference_model, req.token_ids, s)[req.prompt_len - 1 : -1]
        want = lp.gather(1, torch.tensor(req.token_ids[req.prompt_len :])[:, None])[:, 0].tolist()
        assert gap(f"{name} score", out.logprobs, want) < TOL
        top = lp.topk(4, -1)
        assert out.topk_ids.tolist() == top.indices.tolist()
        assert (
            gap(f"{name} score top-k", out.topk_logprobs.array().flatten().tolist(), top.values.flatten().tolist())
            < TOL
        )


def bad_requests(s: Sample, pad: int) -> list[tuple[GenerateRequest | ScoreRequest, str]]:
    ids, n = s.ids, len(s.ids)
    no_pads = [t for t in ids if t != pad]
    two_runs = [*ids, 9, pad]
    return [
        (GenerateRequest(request_id="b1", prompt_token_ids=no_pads, images=[s.image]), r"holds 0 run\(s\)"),
        (GenerateRequest(request_id="b2", prompt_token_ids=ids, images=[s.image] * 2), r"1 run\(s\) .* for 2 image"),
        (GenerateRequest(request_id="b3", prompt_token_ids=ids), r"1 run\(s\) .* for 0 image"),
        (GenerateRequest(request_id="b4", prompt_token_ids=ids, images=["aGk="]), r"images\[0\] is not"),
        (
            GenerateRequest(request_id="b5", prompt_token_ids=ids, images=[s.image], prefix_token_ids=[9, pad]),
            "prefix_token_ids hold the image pad",
        ),
        (ScoreRequest(token_ids=two_runs, prompt_len=n, images=[s.image]), r"token_ids holds 2 run\(s\)"),
        (ScoreRequest(token_ids=[*no_pads, 9], prompt_len=n - 4, images=[s.image]), r"holds 0 run\(s\)"),
    ]


@pytest.mark.parametrize("name", ENGINES)
async def test_image_requests_that_do_not_fit_are_one_line_400s(
    name: str, engines: dict[str, Engine], samples: list[Sample], reference_model: Any
) -> None:
    engine, s = engines[name], samples[0]
    pad = reference_model.config.image_token_id
    assert s.ids.count(pad) == 4  # a 64x64 image: 4 merged patches
    cases = bad_requests(s, pad)
    if name == "hf":  # vLLM expands images itself; the hf engine checks each run's length
        cases.append(
            (
                GenerateRequest(request_id="b6", prompt_token_ids=[*s.ids[:3], *s.ids[4:]], images=[s.image]),
                "image 0 has 3 pad tokens, the model's processor makes 4",
            )
        )
    for req, message in cases:
        with pytest.raises(BadRequest, match=message) as e:
            if isinstance(req, GenerateRequest):
                await engine.generate(req)
            else:
                await engine.score(req)
        assert e.value.status == 400 and "\n" not in str(e.value)
    ok = await engine.generate(
        GenerateRequest(request_id="ok", prompt_token_ids=s.ids, images=[s.image], sampling=Sampling(max_tokens=2))
    )
    assert ok.token_ids


async def test_images_to_a_text_only_hf_model_are_refused(tiny_models: dict[str, Path]) -> None:
    engine = HFEngine(str(tiny_models["student"]), dtype="float32")
    await engine.start()
    try:
        for call in (
            engine.generate(GenerateRequest(request_id="t", prompt_token_ids=[1, 5], images=["aGk="])),
            engine.score(ScoreRequest(token_ids=[1, 5, 6], prompt_len=2, top_k=2, images=["aGk="])),
        ):
            with pytest.raises(BadRequest, match="images: this server's model is text-only") as e:
                await call
            assert "\n" not in str(e.value)
    finally:
        await engine.shutdown()


# --- weight sync of a VL student (last: it changes the engines' weights) ----------------------
@dataclass
class Trainer:
    """Rank 0 of a real gloo weight-sync group holding both engines (ranks 1 and 2), as a
    trainer's WeightSender holds its rollout servers, without the HTTP around it."""

    group: WeightSyncGroup
    engines: list[Engine]
    version: int = 0

    async def sync(
        self, named: list[tuple[str, torch.Tensor]], frozen: Sequence[str] = (), pause: PauseMode = "wait"
    ) -> None:
        self.version += 1
        manifest = build_manifest(named, bucket_bytes=1 << 20)
        manifest.frozen = list(frozen)
        for e in self.engines:
            e.check_manifest(manifest)  # the servers' /weights/begin check

        def broadcast() -> int:
            send(self.group, manifest, (t for _, t in named))
            return self.group.all_reduce_sum(0)

        failed, *_ = await asyncio.gather(
            asyncio.to_thread(broadcast),
            *(e.receive_weights(manifest, self.version, pause, True) for e in self.engines),
        )
        assert failed == 0 and all(e.version == self.version for e in self.engines)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainer(engines: dict[str, Engine]) -> AsyncIterator[Trainer]:
    port = free_port()

    def addr(rank: int) -> GroupAddress:
        return GroupAddress("127.0.0.1", port, rank, 3, "gloo", 120, "vl-engines")

    group, *_ = await asyncio.gather(
        asyncio.to_thread(WeightSyncGroup, addr(0)),
        engines["vllm"].join_weight_group(addr(1)),
        engines["hf"].join_weight_group(addr(2)),
    )
    yield Trainer(group, [engines["vllm"], engines["hf"]])
    await asyncio.gather(*(e.leave_weight_group() for e in engines.values()))
    await asyncio.to_thread(group.close)


def perturbed(model: Any, seed: int, skip: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The trainer's side: the model's named parameters (a tied lm_head is not among them), each
    moved a little, all but those under `skip` (left out of the result too: a frozen tower)."""
    g = torch.Generator().manual_seed(seed)
    named = []
    with torch.no_grad():
        for n, p in model.named_parameters():
            if skip is not None and n.startswith(skip):
                continue
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            named.append((n, p.detach().clone()))
    return named


async def check_served(engines: dict[str, Engine], model: Any, samples: list[Sample], tag: str) -> None:
    """Each engine's greedy tokens for an image it has seen before the sync, and its score of
    them, carry `model`'s log-probs (the encoder cache holds no embedding of the old weights)."""
    s = samples[2]
    for name, engine in engines.items():
        out = await engine.generate(
            GenerateRequest(request_id=f"{name}-{tag}", prompt_token_ids=s.ids, images=[s.image], sampling=GREEDY)
        )
        assert out.versions == [engine.version] * 10
        assert gap(f"{name} after sync", out.logprobs, token_logprobs(model, s.ids, out.token_ids, s)) < TOL
        scored = await engine.score(
            ScoreRequest(token_ids=s.ids + out.token_ids, prompt_len=len(s.ids), top_k=4, images=[s.image])
        )
        assert gap(f"{name} score after sync", scored.logprobs, out.logprobs) < TOL


async def test_a_vl_students_weights_load_by_their_hf_names(
    engines: dict[str, Engine], trainer: Trainer, samples: list[Sample], student: Path
) -> None:
    for name, engine in engines.items():
        names = set(engine.expected_tensors())
        assert EMBED in names and "lm_head.weight" not in names  # tied
        assert any(n.startswith(TOWER) for n in names), name
    # Both engines generate with the image first, so vLLM's encoder cache holds its embedding.
    await check_served(engines, hf_vl_model(student), samples, "before")
    model = hf_vl_model(student)
    named = perturbed(model, seed=1)
    # 'keep' (partialRolloutStrategy inflight) clears no cache when it pauses: the engine must
    # forget the old tower's image embeddings after the load, or the same image reuses them.
    await trainer.sync(named, pause="keep")
    want = {n: tensor_checksum(t) for n, t in named}
    want["lm_head.weight"] = want[EMBED]
    for name, engine in engines.items():  # bit for bit, vLLM's read back under HF names
        got = await engine.weight_checksums()
        assert {n for n in want if got.get(n) != want[n]} == set(), name
    await check_served(engines, model, samples, "v1")


async def test_a_frozen_tower_left_out_of_the_sync_stays(
    engines: dict[str, Engine], trainer: Trainer, samples: list[Sample], student: Path
) -> None:
    before = {name: await e.weight_checksums() for name, e in engines.items()}
    model = hf_vl_model(student)
    with torch.no_grad():  # the engines' current weights (version 1 of the test above)
        params = dict(model.named_parameters())
        for n, t in perturbed(hf_vl_model(student), seed=1):
            params[n].copy_(t)
    named = perturbed(model, seed=2, skip=TOWER)
    assert named and not any(n.startswith(TOWER) for n, _ in named)
    await trainer.sync(named, frozen=[TOWER])
    for name, engine in engines.items():
        after = await engine.weight_checksums()
        tower = [n for n in before[name] if n.startswith(TOWER)]
        assert tower and all(after[n] == before[name][n] for n in tower), name
        assert after[EMBED] != before[name][EMBED]
    await check_served(engines, model, samples, "v2")


async def test_vision_tokens_are_never_sampled(
    engines: dict[str, Engine], trainer: Trainer, samples: list[Sample], student: Path
) -> None:
    """Weights whose logits put nearly all mass on the image pad and vision markers: neither
    engine samples them (they would be taken for image placeholders downstream, and the sample's
    scoring fail), and the log-probs each reports stay the model's own, as the trainer computes
    them."""
    from kubedistill.runtime.engines.images import vision_token_ids

    model = hf_vl_model(student)
    never = vision_token_ids(model.config)
    assert len(never) >= 3  # image pad, vision start and end (the tiny model also has a video pad)
    s = samples[1]
    with torch.no_grad():
        t = torch.tensor([s.ids])
        extra = {**s.inputs, "mm_token_type_ids": (t == model.config.image_token_id).int()}
        hidden = model(input_ids=t, output_hidden_states=True, **extra).hidden_states[-1][0, -1]
        # Tied: these rows are the lm_head's too. Along the prompt's last hidden state they win
        # its logits by a wide margin (and, the model's states being alike, the next ones').
        embed = model.get_input_embeddings().weight
        for i in never:
            embed[i] = 30.0 * hidden / hidden.norm() ** 2
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    await trainer.sync(named)
    for name, engine in engines.items():
        for seed in range(3):
            out = await engine.generate(
                GenerateRequest(
                    request_id=f"{name}-never-{seed}", prompt_token_ids=s.ids, images=[s.image], sampling=sampled(seed)
                )
            )
            assert not set(out.token_ids) & set(never), (name, out.token_ids)
            want = token_logprobs(model, s.ids, out.token_ids, s)
            assert gap(f"{name} never sampled", out.logprobs, want) < TOL
    # The test moved the mass there: unmasked, these tokens would have been most of the samples.
    lp = log_softmax(model, s.ids, s)[-1]
    assert float(lp[never].exp().sum()) > 0.5
