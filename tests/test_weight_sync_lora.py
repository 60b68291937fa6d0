"""LoRA weight versions on the rollout servers (spec.trainer.lora, issue #28, receiver side).

Pure parts of runtime/weight_sync/lora.py (names, the manifest check, the merge arithmetic, the
layers a merged reload must complete, vLLM's adapter limits), then real rollout servers, a
vLLM-CPU one and an hf one in one gloo weight-sync group with a WeightSender in this process, once
per serve_as mode (module-scoped, one mode's servers at a time): adapters built with PEFT on the
tiny student must give the PEFT model's log-probs, a second version must equal that version
alone, and bad manifests are refused with 409 while the group stays usable.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kubedistill.api.spec import LoraSpec
from kubedistill.runtime.weight_sync.lora import (
    VLLM_CPU_ADAPTERS,
    AdaptedModule,
    BaseWeights,
    adapted_modules,
    adapters_to_retire,
    check_lora_manifest,
    merge,
    reload_groups,
    vllm_layer,
    vllm_lora_args,
)
from kubedistill.runtime.weight_sync.manifest import tensor_checksum
from kubedistill.runtime.weight_sync.sender import WeightSyncError, layout, tensor_meta
from kubedistill.runtime.wire.protocol import LoraAdapter, Manifest, TensorMeta
from server_fixtures import Server, free_port, job_config, retry_on_port_taken, stop_all
from test_servers_hf import PROMPT, hf_model, reference_logprobs

torch.set_num_threads(1)

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "v_proj", "gate_proj"]
"""q and v without k, gate without up: vLLM's fused qkv_proj and gate_up_proj are only partly
adapted, so a merged reload must complete them with the base k_proj, up_proj and q/k/v biases."""
QWEN2_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def lora_wire(serve_as: str = "merged", rank: int = RANK, targets: list[str] = TARGETS) -> LoraAdapter:
    return LoraAdapter(rank=rank, alpha=ALPHA, scale=ALPHA / rank, target_modules=targets, serve_as=serve_as)


def lora_manifest(metas: list[TensorMeta], serve_as: str = "merged", rank: int = RANK) -> Manifest:
    manifest = layout(metas, 1 << 20)
    manifest.lora = lora_wire(serve_as, rank)
    return manifest


# --- pure -------------------------------------------------------------------------------------
BASE = {
    "model.embed_tokens.weight": [16, 8],
    "model.layers.0.self_attn.q_proj.weight": [8, 8],
    "model.layers.0.self_attn.q_proj.bias": [8],
    "model.layers.0.self_attn.k_proj.weight": [4, 8],
    "model.layers.0.self_attn.k_proj.bias": [4],
    "model.layers.0.self_attn.v_proj.weight": [4, 8],
    "model.layers.0.self_attn.v_proj.bias": [4],
    "model.layers.0.self_attn.o_proj.weight": [8, 8],
    "model.layers.0.mlp.gate_proj.weight": [12, 8],
    "model.layers.0.mlp.up_proj.weight": [12, 8],
    "model.layers.0.mlp.down_proj.weight": [8, 12],
    "model.layers.0.input_layernorm.weight": [8],
    "model.norm.weight": [8],
}


def adapter_metas(modules: dict[str, tuple[int, int]], rank: int = RANK) -> list[TensorMeta]:
    out = []
    for m, (o, i) in modules.items():
        out.append(TensorMeta(name=f"{m}.lora_A.weight", dtype="float32", shape=[rank, i]))
        out.append(TensorMeta(name=f"{m}.lora_B.weight", dtype="float32", shape=[o, rank]))
    return out


def test_adapter_tensor_names_pair_up_per_module() -> None:
    names = ["m.layers.0.q_proj.lora_A.weight", "m.layers.0.q_proj.lora_B.weight"]
    assert adapted_modules(names) == {"m.layers.0.q_proj": AdaptedModule("m.layers.0.q_proj")}
    m = AdaptedModule("m.layers.0.q_proj")
    assert (m.weight, m.a, m.b, m.leaf) == ("m.layers.0.q_proj.weight", names[0], names[1], "q_proj")
    with pytest.raises(ValueError, match="m.layers.0.q_proj has no lora_B"):
        adapted_modules(names[:1])
    with pytest.raises(ValueError, match="m.layers.0.q_proj.weight is not a LoRA adapter tensor"):
        adapted_modules(["m.layers.0.q_proj.weight"])


def test_a_lora_manifest_must_fit_the_base_linear_layers() -> None:
    q, gate = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj"
    check_lora_manifest(lora_manifest(adapter_metas({q: (8, 8), gate: (12, 8)})), BASE)

    def refused(metas: list[TensorMeta], match: str, **kw: Any) -> None:
        with pytest.raises(ValueError, match=match) as e:
            check_lora_manifest(lora_manifest(metas, **kw), BASE)
        assert "\n" not in str(e.value) and str(e.value).startswith("manifest mismatch: ")

    refused(
        adapter_metas({"model.layers.9.self_attn.q_proj": (8, 8)}),
        "modules the model does not have: model.layers.9.self_attn.q_proj",
    )
    # B's rows must be the base weight's out ([12, 8] for gate_proj), A's columns its in.
    refused(adapter_metas({gate: (8, 8)}), r"gate_proj.lora_B.weight has shape \[8, 4\]; .* must be \[12, 4\]")
    refused(adapter_metas({q: (8, 8)}, rank=2), r"q_proj.lora_A.weight has shape \[2, 8\]")
    refused(adapter_metas({"model.layers.0.self_attn.o_proj": (8, 8)}), "not among the adapter's target_modules")
    refused(adapter_metas({q: (8, 8)})[:1], "q_proj has no lora_B")
    refused(
        [*adapter_metas({q: (8, 8)}), TensorMeta(name="model.norm.weight", dtype="float32", shape=[8])],
        "model.norm.weight is not a LoRA adapter tensor",
    )
    base = dict(BASE, **{"model.layers.0.self_attn.embed_tokens.weight": [8, 8]})
    with pytest.raises(ValueError, match="embeddings or the output head"):
        check_lora_manifest(
            lora_manifest(adapter_metas({"model.layers.0.self_attn.embed_tokens": (8, 8)})).model_copy(
                update={"lora": lora_wire(targets=["all-linear"])}
            ),
            base,
        )


def test_merge_is_the_base_plus_the_scaled_delta_of_this_version_only() -> None:
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(12, 8, generator=g, dtype=torch.float64).to(torch.bfloat16)
    a1, b1 = torch.randn(4, 8, generator=g), torch.randn(12, 4, generator=g)
    a2, b2 = torch.randn(4, 8, generator=g), torch.randn(12, 4, generator=g)
    w = merge(w0, a2, b2, 2.0, torch.float32)
    assert torch.equal(w, w0.float() + (b2 @ a2) * 2.0)
    # bf16 serving: one rounding, of the fp32 sum.
    assert torch.equal(merge(w0, a2, b2, 2.0, torch.bfloat16), (w0.float() + (b2 @ a2) * 2.0).to(torch.bfloat16))
    # Version 2 after version 1 is version 2 alone: merges always start from W0.
    merge(w0, a1, b1, 2.0, torch.float32)
    assert torch.equal(merge(w0, a2, b2, 2.0, torch.float32), w)
    assert w0.dtype == torch.bfloat16  # never written


def test_base_weights_come_from_the_checkpoint_once(tiny_models: dict[str, Path]) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    asked: list[str] = []
    base = BaseWeights(str(tiny_models["student"]), fallback=lambda n: asked.append(n) or torch.zeros(1))
    w = base.get([name])[name]
    assert torch.equal(w, dict(hf_model(tiny_models["student"]).named_parameters())[name].detach())
    assert base.get([name])[name] is w and asked == []
    assert base.get(["not.on.disk"])["not.on.disk"].shape == (1,) and asked == ["not.on.disk"]
    with pytest.raises(ValueError, match="base model's x.weight is not in"):
        BaseWeights(str(tiny_models["student"])).get(["x.weight"])


def test_a_merged_reload_completes_every_layer_it_touches() -> None:
    """vLLM processes a layer once it has all of its elements; one left short is materialised
    uninitialised. q_proj and v_proj alone would leave qkv_proj's k part and biases garbage."""
    assert vllm_layer("model.layers.0.self_attn.v_proj", QWEN2_PACKED) == (
        "model.layers.0.self_attn.qkv_proj",
        tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv"),
    )
    assert vllm_layer("model.layers.0.self_attn.o_proj", QWEN2_PACKED) == (
        "model.layers.0.self_attn.o_proj",
        ("model.layers.0.self_attn.o_proj",),
    )
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.self_attn.v_proj"]
    groups = reload_groups(modules, QWEN2_PACKED, BASE)
    assert [(g.layer, g.tensors) for g in groups] == [
        (
            "model.layers.0.self_attn.qkv_proj",
            tuple(f"model.layers.0.self_attn.{p}_proj.{t}" for p in "qkv" for t in ("weight", "bias")),
        ),
        (
            "model.layers.0.mlp.gate_up_proj",
            ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ),
    ]
    # Decoder-layer order whatever the adapter's order.
    names = {f"model.layers.{i}.mlp.down_proj.weight": [8, 12] for i in (0, 1, 10)}
    layers = [g.layer for g in reload_groups([n.removesuffix(".weight") for n in reversed(names)], {}, names)]
    assert layers == [f"model.layers.{i}.mlp.down_proj" for i in (0, 1, 10)]


def test_vllm_serves_adapters_up_to_the_next_rank_it_has() -> None:
    args = vllm_lora_args(12, ["q_proj", "v_proj"])
    assert args == {
        "enable_lora": True,
        "max_lora_rank": 16,
        "max_loras": 2,
        "max_cpu_loras": VLLM_CPU_ADAPTERS,
        "lora_target_modules": ["q_proj", "v_proj"],
    }
    assert vllm_lora_args(8, ["all-linear"])["lora_target_modules"] is None
    # The oldest adapters' requests are aborted only when the worker could not keep them all.
    assert adapters_to_retire([3, 5, 9], capacity=8) == []
    assert adapters_to_retire(list(range(1, 9)), capacity=8) == [1]
    assert adapters_to_retire([12, 10, 11], capacity=3) == [10]


def test_only_the_rollout_engine_is_started_for_adapters(tiny_models: dict[str, Path]) -> None:
    from kubedistill.runtime.engines.factory import make_engine

    cfg = job_config(
        tiny_models["student"],
        tiny_models["teacher"],
        engine="vllm",
        rollout_urls=["http://r"],
        teacher_urls=["http://t"],
        weight_sync_port=1,
    )
    spec = with_lora(cfg.spec, "adapter")
    rollout = make_engine(spec, spec.student, spec.rollout.inference)
    teacher = make_engine(spec, spec.teachers[0], spec.teachers[0].inference)
    assert rollout.kwargs["enable_lora"] and rollout.kwargs["max_lora_rank"] == 8  # type: ignore[attr-defined]
    assert rollout.kwargs["lora_target_modules"] == TARGETS  # type: ignore[attr-defined]
    assert "enable_lora" not in teacher.kwargs  # type: ignore[attr-defined]
    merged = with_lora(cfg.spec, "merged")
    assert "enable_lora" not in make_engine(merged, merged.student, merged.rollout.inference).kwargs  # type: ignore[attr-defined]


def with_lora(spec: Any, serve_as: str) -> Any:
    lora = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=TARGETS, serve_as=serve_as)
    return spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"lora": lora})})


# --- adapters built with PEFT -------------------------------------------------------------------
@dataclass
class PeftVersion:
    """One trainer version: the PEFT model and its adapter as the trainer sends it (a WeightSource)."""

    model: Any
    named: list[tuple[str, torch.Tensor]]
    lora: LoraAdapter

    def weight_metas(self) -> list[TensorMeta]:
        return [tensor_meta(n, t) for n, t in self.named]

    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.named)

    def frozen_prefixes(self) -> list[str]:
        return []

    def lora_adapter(self) -> LoraAdapter:
        return self.lora


def peft_version(path: Path, seed: int, serve_as: str) -> PeftVersion:
    """PEFT LoRA on the tiny student with random A and B (B starts at zero in PEFT), float32.
    The wire names are PEFT's parameter names minus `base_model.model.` and `.default`."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        hf_model(path), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    ).eval()
    g = torch.Generator().manual_seed(seed)
    named = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                named.append((name.removeprefix("base_model.model.").replace(".default.", "."), p.detach().clone()))
    return PeftVersion(model, named, lora_wire(serve_as))


def merged_checksums(path: Path, v: PeftVersion) -> dict[str, str]:
    """What a merged server must hold bit for bit: W0 + scale * B @ A for the adapted weights
    (this version's only), the base model's own for every other weight."""
    base = {n: p.detach() for n, p in hf_model(path).named_parameters()}
    tensors = dict(v.named)
    for m in adapted_modules(tensors).values():
        base[m.weight] = merge(base[m.weight], tensors[m.a], tensors[m.b], v.lora.scale, torch.float32)
    out = {n: tensor_checksum(t) for n, t in base.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied
    return out


# --- servers ------------------------------------------------------------------------------------
@dataclass
class LoraServers:
    mode: str
    urls: list[str]
    sender: Any
    servers: list[Server]
    student: Path


@pytest.fixture(scope="module", params=["merged", "adapter"])
def lora_servers(
    request: pytest.FixtureRequest, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
):
    """Rollout replica 0 on vLLM-CPU, replica 1 on hf, one gloo group, spec.trainer.lora with
    serveAs = the param. Adapter mode pauses with 'keep' (partialRollout inflight): requests in
    flight at a sync go on, on their adapter."""
    from kubedistill.runtime.weight_sync.sender import WeightSender

    mode = request.param
    base = tmp_path_factory.mktemp(f"lora-{mode}")

    def start() -> tuple[list[str], list[Server], dict[str, Any]]:
        ports, wport = [free_port(), free_port()], free_port()
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        servers, cfg = [], None
        for i, engine in enumerate(["vllm", "hf"]):
            cfg = job_config(
                tiny_models["student"],
                tiny_models["teacher"],
                engine=engine,
                rollout_urls=urls,
                teacher_urls=["http://127.0.0.1:1"],
                weight_sync_port=wport,
                partial_rollout="inflight" if mode == "adapter" else None,
            )
            # The hf engine follows each manifest's serve_as; the API refuses serveAs adapter with
            # inference.engine hf (kubedistill/api/rules.py), so the hf replica's spec says merged.
            cfg = cfg.model_copy(update={"spec": with_lora(cfg.spec, mode if engine == "vllm" else "merged")})
            cfg.dump(base / f"rollout{i}.json")
            servers.append(Server("rollout", base / f"rollout{i}.json", ports[i], replica=i))
        assert cfg is not None
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.update(sender=WeightSender(cfg.spec, cfg.endpoints)), daemon=True)
        t.start()
        try:
            for s in servers:
                s.wait_healthy()
            t.join(timeout=600)
            assert "sender" in box, "the weight-sync group did not form"
        except BaseException:
            stop_all(servers)
            raise
        return urls, servers, box

    urls, servers, box = retry_on_port_taken(start)
    try:
        yield LoraServers(mode, urls, box["sender"], servers, tiny_models["student"])
    finally:
        box["sender"].close()
        stop_all(servers)


def next_version(s: LoraServers) -> int:
    return max(httpx.get(u + "/version").json()["version"] for u in s.urls) + 1


def greedy(url: str, rid: str, max_tokens: int = 8) -> dict[str, Any]:
    r = httpx.post(
        url + "/generate",
        json={
            "request_id": rid,
            "prompt_token_ids": PROMPT,
            "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def assert_serves(s: LoraServers, v: PeftVersion, version: int, tag: str) -> None:
    """Both engines generate what the PEFT model would: its greedy tokens, its log-probs."""
    for url in s.urls:
        out = greedy(url, f"{tag}-{url[-5:]}")
        assert out["versions"] == [version] * 8, url
        ref = reference_logprobs(v.model, PROMPT, out["token_ids"])
        assert out["logprobs"] == pytest.approx(ref, abs=1e-4), url
        with torch.no_grad():
            tokens = v.model.generate(
                torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=0
            )[0, len(PROMPT) :].tolist()
        assert out["token_ids"] == tokens, url


def test_versions_serve_what_peft_computes_and_never_drift(lora_servers: LoraServers) -> None:
    s = lora_servers
    v1, v2 = (peft_version(s.student, seed, s.mode) for seed in (1, 2))
    n1 = next_version(s)
    s.sender.sync(n1, v1)
    assert_serves(s, v1, n1, "v1")
    n2 = n1 + 1
    stats = s.sender.sync(n2, v2)
    assert stats.bytes == sum(t.numel() * 4 for _, t in v2.named)  # the adapter only, as the trainer holds it
    assert_serves(s, v2, n2, "v2")
    last = [httpx.get(u + "/weights/last").json() for u in s.urls]
    assert all(x["loaded"] and x["version"] == n2 for x in last), last
    # Merged: W0 + delta of version 2 exactly, whatever version 1 was. Adapter: the engines keep
    # the base weights and apply the adapter apart.
    if s.mode == "merged":
        want = merged_checksums(s.student, v2)
    else:
        want = {n: tensor_checksum(p) for n, p in hf_model(s.student).named_parameters()}
    for url in s.urls:
        got = httpx.get(url + "/weights/checksums", timeout=120).json()
        assert {n for n in want if got.get(n) != want[n]} == set(), url


def test_bad_lora_manifests_get_409_and_the_group_stays_usable(lora_servers: LoraServers) -> None:
    s = lora_servers
    before = [httpx.get(u + "/version").json()["version"] for u in s.urls]
    good = peft_version(s.student, 3, s.mode)

    def renamed(old: str, new: str) -> PeftVersion:
        return PeftVersion(good.model, [(n.replace(old, new), t) for n, t in good.named], good.lora)

    with pytest.raises(WeightSyncError, match="modules the model does not have: model.layers.9.self_attn.q_proj"):
        s.sender.sync(before[0] + 50, renamed("layers.0.self_attn.q_proj", "layers.9.self_attn.q_proj"))
    wrong_rank = PeftVersion(good.model, good.named, good.lora.model_copy(update={"rank": RANK * 2}))
    with pytest.raises(WeightSyncError, match=r"lora_A.weight has shape \[4, 128\]; .* must be \[8, 128\]"):
        s.sender.sync(before[0] + 51, wrong_rank)
    other = "adapter" if s.mode == "merged" else "merged"
    switched = PeftVersion(good.model, good.named, good.lora.model_copy(update={"serve_as": other}))
    match = "needs an engine started for it" if s.mode == "merged" else "cannot load a LoRA adapter to merge"
    with pytest.raises(WeightSyncError, match=match):
        s.sender.sync(before[0] + 52, switched)
    assert [httpx.get(u + "/version").json()["version"] for u in s.urls] == before
    # Each refusal still took part in the broadcast: the group is in step for the next sync.
    n = max(before) + 1
    s.sender.sync(n, good)
    assert_serves(s, good, n, "after-409")


# Merged versions replace the weights under requests in flight, as full weights do: adapters only.
@pytest.mark.parametrize("lora_servers", ["adapter"], indirect=True)
async def test_requests_in_flight_keep_their_adapter_across_syncs(lora_servers: LoraServers) -> None:
    """Pause mode 'keep' with adapters: a vLLM request in flight at a sync goes on with the
    adapter it started on (tokens tagged with that version), even across a second sync, so the
    worker must keep that adapter registered while it drops the unused ones."""
    from kubedistill.runtime.driver.clients import RolloutClient
    from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling

    s = lora_servers
    assert s.mode == "adapter"
    url = s.urls[0]
    old = peft_version(s.student, 4, "adapter")
    newer = [peft_version(s.student, seed, "adapter") for seed in (5, 6, 7)]
    n = next_version(s)
    await asyncio.to_thread(s.sender.sync, n, old)
    max_tokens = 256 - len(PROMPT) - 1
    async with RolloutClient(url) as c:
        for attempt in range(5):
            gen = asyncio.create_task(
                c.generate(
                    GenerateRequest(
                        request_id=f"keep-{attempt}",
                        prompt_token_ids=PROMPT,
                        sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                    )
                )
            )
            while not gen.done():
                line = next(
                    ln
                    for ln in (await c.metrics_text()).splitlines()
                    if ln.startswith("kubedistill_requests_in_flight{")
                )
                if float(line.rsplit(" ", 1)[1]) >= 2:
                    break
                await asyncio.sleep(0.005)
            await asyncio.to_thread(s.sender.sync, n + 1, newer[0])
            await asyncio.to_thread(s.sender.sync, n + 2, newer[1])
            spanned = not gen.done()
            out = await gen
            if spanned:
                break
            n += 2
        assert spanned, "every long generation ended before two syncs"
    assert out.finish_reason == "length" and out.versions == [n] * max_tokens
    ref = reference_logprobs(old.model, PROMPT, out.token_ids)
    assert out.logprobs == pytest.approx(ref, abs=1e-4)
    # The adapters nobody uses any more are dropped at the next sync; the engine serves on.
    await asyncio.to_thread(s.sender.sync, n + 3, newer[2])
    assert_serves(s, newer[2], n + 3, "after-keep")
