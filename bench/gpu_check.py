"""The GPU check: what one borrowed GPU can tell about kubedistill's GPU paths in a few minutes,
with neither vLLM nor Ray (docs/gpu.md). Run it through bench/gpu_check.sh.

Each part runs in a process of its own (an error or an out-of-memory stays in its part), on a
random-weight student of a real size built on the spot and saved in bfloat16:

* ``text``: a Qwen3-1.7B-shaped student. The rollout server (``kubedistill role rollout``, engine
  hf, on the GPU) runs in a second process; this one is trainer rank 0 (FSDP2, bfloat16 compute
  over float32 master weights, gradient checkpointing) and the weight sender.
  1. log-probs at lag 0: the server samples, the trainer trains on the samples at once; the step
     reports its log-probs against the engine's on the same weights;
  2. train steps on long samples: tokens/s, MFU, peak memory;
  3. a weight sync over NCCL into the server (two ranks on one GPU, told apart as two hosts, so
     NCCL's socket transport over loopback carries it: a lower bound of a pod network's path),
     then the server's weight checksums against the trainer's weights in bfloat16;
  4. log-probs at lag 0 again, from samples of the synced weights.
* ``lora``: the same student with LoRA adapters (rank 16, all-linear): train steps.
* ``vl``: a Qwen3-VL-2B-shaped student: train steps on image and text samples in one batch.
* ``fixed``: what a step costs beyond its model work: a SmolLM2-135M-shaped student, steps of 64
  short samples (the quickstart's shape), wall time against compute, and weight syncs into the
  hf rollout server split into the sender's segments (pause, transfer, load, resume).

What one GPU cannot cover: NCCL between GPUs (NVLink, InfiniBand) and between pods, vLLM's
engines (not installed there), FSDP over several ranks.

``--dry-run`` runs every part at tiny shapes on the CPU (gloo, float32 engine), as CI does. The
JSON (``--out``) has one entry per part; the last line printed is the verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ABSENT = ("vllm", "ray")
"""What the borrowed GPU machine lacks: every process of the check runs as if they were absent."""


def hide_absent_packages() -> None:
    """Make vLLM and Ray look uninstalled to this process (import fails, find_spec says None), so
    a dry run on CPU proves the checked paths need neither."""
    for name in ABSENT:
        sys.modules[name] = None  # type: ignore[assignment]


@dataclass(frozen=True)
class TextShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class VisionShape:
    depth: int
    hidden: int
    intermediate: int
    heads: int
    deepstack: tuple[int, ...]


@dataclass(frozen=True)
class Scale:
    """The sizes of one run of the check: real ones on a GPU, tiny ones in a dry run."""

    text: TextShape
    vision: VisionShape
    samples: int  # per train step
    prompt: int
    response: int
    micro_batch_tokens: int
    gen_requests: int  # samples of the log-prob check
    gen_prompt: int
    gen_tokens: int
    image_grid: int  # patches per side of each image (merged 2x2 into tokens)
    timed_steps: int
    small: TextShape  # the fixed-cost part's student
    small_samples: int  # per step, each small_prompt + small_response tokens
    small_prompt: int
    small_response: int
    small_steps: int  # timed steps and syncs of the fixed-cost part


QWEN3_1_7B = TextShape(vocab=151936, hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128)
SMOLLM2_135M = TextShape(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64)
"""The small student of the fixed-cost part: where a step's model work is small, the rest shows."""
QWEN3_VL_2B_VISION = VisionShape(depth=24, hidden=1024, intermediate=4096, heads=16, deepstack=(5, 11, 17))
GPU = Scale(
    text=QWEN3_1_7B,
    vision=QWEN3_VL_2B_VISION,
    samples=8,
    prompt=512,
    response=1536,
    micro_batch_tokens=16384,
    gen_requests=16,
    gen_prompt=64,
    gen_tokens=256,
    image_grid=32,
    timed_steps=3,
    small=SMOLLM2_135M,
    small_samples=64,
    small_prompt=32,
    small_response=16,
    small_steps=8,
)
TINY = Scale(
    text=TextShape(vocab=512, hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, head_dim=64),
    vision=VisionShape(depth=2, hidden=128, intermediate=256, heads=2, deepstack=(0,)),
    samples=4,
    prompt=16,
    response=16,
    micro_batch_tokens=4096,
    gen_requests=4,
    gen_prompt=8,
    gen_tokens=8,
    image_grid=4,
    timed_steps=1,
    small=TextShape(vocab=512, hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, head_dim=64),
    small_samples=8,
    small_prompt=8,
    small_response=4,
    small_steps=2,
)

PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0}
"""Dense bf16 peak by card name (datasheet figures; the first name contained in the device's wins)."""


def peak_bf16_tflops(device_name: str) -> float | None:
    for name, tflops in PEAK_BF16_TFLOPS.items():
        if name in device_name:
            return tflops
    return None


def train_flops(text: TextShape, lengths: list[int], response_lens: list[int]) -> float:
    """Model FLOPs of one train step (forward + backward = 3 x forward; gradient checkpointing's
    second forward not counted, as MFU is usually stated): the decoder's matrix products on every
    token, causal attention over each sample's own tokens, and the LM head only at the response
    positions, where the trainer applies it."""
    attn_width = text.heads * text.head_dim
    kv_width = text.kv_heads * text.head_dim
    per_layer = (
        text.hidden * (attn_width + 2 * kv_width) + attn_width * text.hidden + 3 * text.hidden * text.intermediate
    )
    matmul = 2 * per_layer * text.layers * sum(lengths)
    attention = sum(2 * text.layers * attn_width * n * n for n in lengths)  # QK^T and PV, causal half of 2 x 2
    head = 2 * text.hidden * text.vocab * sum(response_lens)
    return 3.0 * (matmul + attention + head)


# ---- models ------------------------------------------------------------------------------------


def decoder_fields(shape: TextShape) -> dict[str, Any]:
    """A decoder's config fields, shared by the text student and the VL student's text side."""
    return dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def text_config(shape: TextShape) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**decoder_fields(shape), tie_word_embeddings=True)


def vl_config(text: TextShape, vision: VisionShape) -> Any:
    from transformers import Qwen3VLConfig

    # M-RoPE's sections cover head_dim / 2 frequencies: Qwen3-VL's [24, 20, 20] at head_dim 128.
    half = text.head_dim // 2
    sections = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": sections, "mrope_interleaved": True}
    return Qwen3VLConfig(
        text_config={**decoder_fields(text), "rope_parameters": rope},
        vision_config=dict(
            depth=vision.depth,
            hidden_size=vision.hidden,
            intermediate_size=vision.intermediate,
            num_heads=vision.heads,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=text.hidden,
            num_position_embeddings=2304,
            deepstack_visual_indexes=list(vision.deepstack),
        ),
        image_token_id=text.vocab - 1,
        video_token_id=text.vocab - 2,
        vision_start_token_id=text.vocab - 3,
        vision_end_token_id=text.vocab - 4,
        tie_word_embeddings=True,
    )


def build_model(config: Any, out: Path, device: str, dtype: str) -> Path:
    """A random-weight model from `config`, made on `device` (a 2B model initialises in seconds on
    a GPU, a minute on CPU) and saved to `out` in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


# ---- the job the parts run -----------------------------------------------------------------------


def job_spec(model: Path, work: Path, scale: Scale, dry: bool, lora: bool = False) -> Any:
    from kubedistill.api.spec import DistillationJobSpec

    engine = {"engine": "hf", "dtype": "float32" if dry else "bfloat16", "maxModelLen": 4096}
    trainer: dict[str, Any] = {
        "mixedPrecision": "bfloat16",
        "gradientCheckpointing": True,
        "miniBatchSize": scale.samples,
        "microBatchTokens": scale.micro_batch_tokens,
        "totalSteps": 1000,
        "optim": {"lr": 1e-5, "warmupSteps": 0},
    }
    if lora:
        trainer["lora"] = {"rank": 16, "alpha": 32}
    return DistillationJobSpec.model_validate(
        {
            "mode": "sync",
            "device": "cpu" if dry else "cuda",
            "student": {"model": str(model)},
            "teachers": [{"name": "t", "model": str(model), "inference": engine}],
            "rollout": {"inference": engine, "sampling": {"samplesPerPrompt": 1, "maxTokens": scale.gen_tokens}},
            "trainer": trainer,
            "algorithm": {"distillation": {"lossMode": "k3"}},
            "data": {"train": [str(work / "unused.jsonl")]},
            "checkpoint": {"path": str(work / "ckpt")},
            "weightSync": {"backend": "gloo" if dry else "nccl", "bucketMB": 512},
        }
    )


def synthetic_batch(scale: Scale, vocab: int, seed: int, images: Any = None) -> Any:
    """`scale.samples` samples of prompt + response random ids (k3's signals: the teacher's
    log-prob of each response token); `images(i)` gives sample i's (ids prefix, SampleImages)."""
    import torch

    from kubedistill.runtime.wire.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids, prompt_lens, imgs = [], [], []
    for i in range(scale.samples):
        prefix, img = images(i) if images is not None else ([], None)
        prompt = prefix + torch.randint(3, vocab - 8, (scale.prompt - len(prefix),), generator=g).tolist()
        ids.append(prompt + torch.randint(3, vocab - 8, (scale.response,), generator=g).tolist())
        prompt_lens.append(len(prompt))
        imgs.append(img)
    lps = [(-torch.rand(scale.response, generator=g) * 4 - 8).tolist() for _ in range(scale.samples)]
    return TrainBatch(
        token_ids=ids,
        prompt_lens=prompt_lens,
        rollout_logprobs=lps,
        signals={"teacher_logprobs": lps},
        images=imgs if images is not None else None,
    ).to_parts()


def timed_steps(trainer: Any, batches: list[Any], text: TextShape, peak: float | None) -> dict[str, Any]:
    """Train on batches[0] (warm-up), then time the rest: tokens/s, MFU, peak memory."""
    import torch

    cuda = trainer.device.type == "cuda"
    trainer.train([batches[0]])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds, tokens, flops = [], 0, 0.0
    for b in batches[1:]:
        t0 = time.perf_counter()
        stats = trainer.train([b])[-1]
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        lengths = b.lengths
        tokens += sum(lengths)
        flops += train_flops(text, lengths, [s.response_len for s in b.parts])
        if not (stats.loss_total == stats.loss_total):  # NaN
            raise RuntimeError(f"train step {stats.step}: the loss is NaN")
    total = sum(seconds)
    out: dict[str, Any] = {
        "step_seconds": [round(s, 3) for s in seconds],
        "tokens_per_step": tokens // len(seconds),
        "tokens_per_second": round(tokens / total, 1),
        "model_tflops_per_second": round(flops / total / 1e12, 2),
    }
    if peak is not None:
        out["mfu"] = round(flops / total / 1e12 / peak, 4)
    if cuda:
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


# ---- the rollout server beside the trainer -----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RolloutServer:
    """`kubedistill role rollout` (engine hf) in a process of its own, on the trainer's GPU as
    another NCCL host (runtime/entrypoints/gpu_share.py)."""

    def __init__(self, spec: Any, work: Path, log: Path):
        from kubedistill.api.roleconfig import Endpoints, JobConfig

        self.port, wport = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoints = Endpoints(
            trainer="http://127.0.0.1:1",
            master_addr="127.0.0.1",
            weight_sync_port=wport,
            rollout=[self.url],
            teachers={"t": ["http://127.0.0.1:1"]},
        )
        config = work / "config.json"
        JobConfig(job="gpu-check", spec=spec, endpoints=self.endpoints).dump(config)
        env = {**os.environ, "NCCL_HOSTID": "kubedistill-check-rollout", "NCCL_NET": "Socket"}
        cmd = [sys.executable, __file__, "serve", str(config), str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, http: Any, timeout: float) -> float:
        from kubedistill.runtime.wire.http import REQUEST_ERRORS

        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the rollout server exited with {self.proc.returncode}")
            try:
                http.fetch("GET", self.url + "/health", timeout=2)
                return time.monotonic() - t0
            except REQUEST_ERRORS:
                pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"the rollout server was not healthy after {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def sample(http: Any, url: str, scale: Scale, vocab: int, seed: int) -> tuple[Any, float]:
    """`scale.gen_requests` concurrent /generate requests of random prompts, as a batch for the
    trainer whose teacher log-probs are the rollout's own (k3 reads them; the loss is then ~0)."""
    import asyncio

    import torch

    from kubedistill.runtime.wire.batch import TrainBatch
    from kubedistill.runtime.wire.http import call
    from kubedistill.runtime.wire.protocol import GenerateRequest, GenerateResponse, Sampling

    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, vocab - 8, (scale.gen_prompt,), generator=g).tolist() for _ in range(scale.gen_requests)
    ]
    sampling = Sampling(max_tokens=scale.gen_tokens, temperature=1.0, ignore_eos=True)

    async def all_requests() -> list[GenerateResponse]:
        reqs = [
            GenerateRequest(request_id=f"c{seed}-{i}", prompt_token_ids=p, sampling=sampling)
            for i, p in enumerate(prompts)
        ]
        return list(
            await asyncio.gather(
                *(call(http.session, "POST", url + "/generate", GenerateResponse, r, timeout=600) for r in reqs)
            )
        )

    t0 = time.perf_counter()
    outs = http.run(all_requests())
    seconds = time.perf_counter() - t0
    versions = [min(o.versions) for o in outs]
    batch = TrainBatch(
        token_ids=[p + o.token_ids for p, o in zip(prompts, outs)],
        prompt_lens=[len(p) for p in prompts],
        rollout_logprobs=[o.logprobs for o in outs],
        signals={"teacher_logprobs": [o.logprobs for o in outs]},
        weight_versions=versions,
    )
    return batch, seconds


def served_weights_match(http: Any, server: RolloutServer, trainer: Any) -> dict[str, Any]:
    """The server's weights against the trainer's cast to the server's dtype, tensor by tensor
    (GET /weights/checksums); raises unless every one is equal bit for bit."""
    from kubedistill.runtime.weight_sync.manifest import tensor_checksum
    from kubedistill.runtime.weight_sync.transfer import torch_dtype
    from kubedistill.runtime.wire.protocol import WeightsGroupResponse

    served = http.call("GET", server.url + "/weights/group", WeightsGroupResponse, timeout=60).dtype or "float32"
    want = {n: tensor_checksum(t.to(torch_dtype(served))) for n, t in trainer.named_full_weights()}
    if "lm_head.weight" not in want and "model.embed_tokens.weight" in want:
        want["lm_head.weight"] = want["model.embed_tokens.weight"]  # tied
    got = json.loads(http.fetch("GET", server.url + "/weights/checksums", timeout=300))
    bad = sorted(n for n in want if got.get(n) != want[n])
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(want)} synced weights differ on the server, e.g. {bad[:3]}")
    return {"compared": len(want), "dtype": served, "differ": 0}


def lag0(stats: Any) -> dict[str, float]:
    off = stats.off_policy
    if "lag0Tokens" not in off:
        raise RuntimeError(f"the step saw no tokens at lag 0: {off}")
    return {
        "tokens": int(off["lag0Tokens"]),
        "abs_mean": round(off["logprobDiffLag0AbsMean"], 6),
        "abs_max": round(off["logprobDiffLag0AbsMax"], 6),
        "mean": round(off["logprobDiffLag0Mean"], 6),
    }


# ---- the parts ---------------------------------------------------------------------------------


def part_text(work: Path, scale: Scale, dry: bool, device_name: str) -> dict[str, Any]:
    import torch

    from kubedistill.runtime.trainer import Trainer
    from kubedistill.runtime.weight_sync.sender import WeightSender
    from kubedistill.runtime.wire.http import BlockingClient

    out: dict[str, Any] = {}
    device = "cpu" if dry else "cuda"
    t0 = time.perf_counter()
    model = build_model(text_config(scale.text), work / "student", device, "float32" if dry else "bfloat16")
    out["build_seconds"] = round(time.perf_counter() - t0, 1)
    spec = job_spec(model, work, scale, dry)
    server = RolloutServer(spec, work, work / "rollout.log")
    http = BlockingClient(timeout=600)
    try:
        t0 = time.perf_counter()
        trainer = Trainer(spec)
        out["trainer_load_seconds"] = round(time.perf_counter() - t0, 1)
        out["packing"] = trainer.pack
        out["server_ready_seconds"] = round(server.wait_healthy(http, 300), 1)

        # 1. the engine's log-probs against the trainer's, on the same weights
        batch, seconds = sample(http, server.url, scale, scale.text.vocab, seed=1)
        batch.trainer_version = 0
        n_tokens = scale.gen_requests * scale.gen_tokens
        out["generate"] = {"seconds": round(seconds, 2), "tokens_per_second": round(n_tokens / seconds, 1)}
        out["logprobs_lag0_before_sync"] = lag0(trainer.train([batch.to_parts()])[-1])

        # 2. train steps
        peak = None if dry else peak_bf16_tflops(device_name)
        batches = [synthetic_batch(scale, scale.text.vocab, seed=10 + i) for i in range(scale.timed_steps + 1)]
        out["train"] = timed_steps(trainer, batches, scale.text, peak)

        # 3. the weight sync over NCCL, then checksums
        t0 = time.perf_counter()
        sender = WeightSender(spec, server.endpoints)
        out["group_seconds"] = round(time.perf_counter() - t0, 2)
        out["group_backend"] = sender.group.addr.backend
        version = 1
        syncs = []
        for _ in range(2):  # the second shows the steady state (the first pays NCCL's warm-up)
            stats = sender.sync(version, trainer)
            syncs.append(
                {
                    "seconds": round(stats.seconds, 3),
                    "gib": round(stats.bytes / 2**30, 3),
                    "gib_per_second": round(stats.bytes / 2**30 / stats.seconds, 2),
                }
            )
            version += 1
        out["sync"] = syncs
        out["checksums"] = served_weights_match(http, server, trainer)

        # 4. after the sync, the engine samples from the weights the trainer holds
        batch, _ = sample(http, server.url, scale, scale.text.vocab, seed=2)
        batch.trainer_version = version - 1
        out["logprobs_lag0_after_sync"] = lag0(trainer.train([batch.to_parts()])[-1])
        sender.close()
        trainer.close()
    finally:
        http.close()
        server.stop()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def part_lora(work: Path, scale: Scale, dry: bool, device_name: str) -> dict[str, Any]:
    from kubedistill.runtime.trainer import Trainer

    model = build_model(
        text_config(scale.text), work / "student", "cpu" if dry else "cuda", "float32" if dry else "bfloat16"
    )
    trainer = Trainer(job_spec(model, work, scale, dry, lora=True))
    trainable = sum(p.numel() for p in trainer.trainable)
    batches = [synthetic_batch(scale, scale.text.vocab, seed=20 + i) for i in range(scale.timed_steps + 1)]
    out = {
        "trainable_parameters": trainable,
        "train": timed_steps(trainer, batches, scale.text, None if dry else peak_bf16_tflops(device_name)),
    }
    out["adapter_tensors"] = len(trainer.weight_metas())
    trainer.close()
    return out


def part_vl(work: Path, scale: Scale, dry: bool, device_name: str) -> dict[str, Any]:
    import numpy as np

    from kubedistill.runtime.trainer import Trainer
    from kubedistill.runtime.wire.batch import SampleImages

    config = vl_config(scale.text, scale.vision)
    model = build_model(config, work / "student", "cpu" if dry else "cuda", "float32" if dry else "bfloat16")
    trainer = Trainer(job_spec(model, work, scale, dry))
    grid = scale.image_grid
    patch_dim = 3 * 2 * 16 * 16
    rng = np.random.default_rng(0)

    def images(i: int) -> tuple[list[int], SampleImages | None]:
        if i % 2:  # every other sample is text only: both kinds train in one step
            return [], None
        pads = [config.image_token_id] * (grid * grid // 4)
        img = SampleImages(
            pixel_values=rng.standard_normal((grid * grid, patch_dim), dtype=np.float32),
            grid_thw=np.array([[1, grid, grid]], dtype=np.int64),
        )
        return [config.vision_start_token_id, *pads, config.vision_end_token_id], img

    batches = [
        synthetic_batch(scale, scale.text.vocab, seed=30 + i, images=images) for i in range(scale.timed_steps + 1)
    ]
    out = {
        "image_tokens_per_image": grid * grid // 4,
        "train": timed_steps(trainer, batches, scale.text, None if dry else peak_bf16_tflops(device_name)),
    }
    trainer.close()
    return out


def small_scale(scale: Scale) -> Scale:
    """The scale of the parts on the small student (fixed, delta): its shape and step sizes."""
    return replace(
        scale, text=scale.small, samples=scale.small_samples, prompt=scale.small_prompt, response=scale.small_response
    )


def part_fixed(work: Path, scale: Scale, dry: bool, device_name: str) -> dict[str, Any]:
    """What a step costs beyond its model work, on the GPU (issue: a step's fixed costs stay host
    work when the model's own work shrinks): a SmolLM2-135M-shaped student, steps of many short
    samples (the quickstart's shape), each step's wall time against its compute, and weight syncs
    into the hf rollout server, split into the sender's four segments."""
    import statistics

    from kubedistill.runtime.trainer import Trainer
    from kubedistill.runtime.weight_sync.sender import WeightSender
    from kubedistill.runtime.wire.http import BlockingClient

    small = small_scale(scale)
    device = "cpu" if dry else "cuda"
    model = build_model(text_config(scale.small), work / "student", device, "float32" if dry else "bfloat16")
    spec = job_spec(model, work, small, dry)
    server = RolloutServer(spec, work, work / "rollout.log")
    http = BlockingClient(timeout=600)
    out: dict[str, Any] = {}
    try:
        trainer = Trainer(spec)
        server.wait_healthy(http, 300)
        batches = [synthetic_batch(small, scale.small.vocab, seed=40 + i) for i in range(scale.small_steps + 1)]
        trainer.train([batches[0]])  # warm-up
        walls, computes = [], []
        for b in batches[1:]:
            t0 = time.perf_counter()
            stats = trainer.train([b])[-1]
            walls.append(time.perf_counter() - t0)
            computes.append(stats.compute_seconds)
        out["train_step"] = {
            "tokens": sum(batches[1].lengths),
            "wall_ms": round(1000 * statistics.median(walls), 1),
            "compute_ms": round(1000 * statistics.median(computes), 1),
            "other_ms": round(1000 * statistics.median(w - c for w, c in zip(walls, computes)), 1),
        }
        sender = WeightSender(spec, server.endpoints)
        sender.sync(1, trainer)  # warm-up: NCCL's first collectives
        segments: dict[str, list[float]] = {"total": [], "pause": [], "transfer": [], "load": [], "resume": []}
        for version in range(2, 2 + scale.small_steps):
            t0 = time.perf_counter()
            stats = sender.sync(version, trainer)
            segments["total"].append(time.perf_counter() - t0)
            times = getattr(stats, "times", None)
            for name in ("pause", "transfer", "load", "resume"):
                if times is not None:
                    segments[name].append(getattr(times, name))
        out["sync_ms"] = {k: round(1000 * statistics.median(v), 1) for k, v in segments.items() if v}
        out["sync_gib"] = round(stats.bytes / 2**30, 3)
        sender.close()
        trainer.close()
    finally:
        http.close()
        server.stop()
    return out


DELTA_LR = 1e-6
"""The reference OPD job's learning rate (issue: delta syncs), where most bf16 weights do not change."""


def part_delta(work: Path, scale: Scale, dry: bool, device_name: str) -> dict[str, Any]:
    """Delta weight syncs (spec.weightSync.delta) where the sender's compare pass runs in GPU
    memory: the fixed part's SmolLM2-135M-shaped student, bf16 in the hf server, trained at lr
    1e-6 (AdamW on synthetic batches, float32 masters). Steps each synced as a delta, the
    server's weights then checked bit for bit, then as many steps each synced in full, all over
    NCCL's socket transport (the pods' path without RDMA). Reports bytes and seconds of a delta
    over a full sync (medians) and each delta's density."""
    import statistics

    from kubedistill.api.spec import DeltaMode
    from kubedistill.runtime.trainer import Trainer
    from kubedistill.runtime.weight_sync.sender import WeightSender
    from kubedistill.runtime.wire.http import BlockingClient

    small = small_scale(scale)
    device = "cpu" if dry else "cuda"
    model = build_model(text_config(scale.small), work / "student", device, "float32" if dry else "bfloat16")
    spec = job_spec(model, work, small, dry)
    spec.trainer.optim.lr = DELTA_LR
    server = RolloutServer(spec, work, work / "rollout.log")
    http = BlockingClient(timeout=600)
    out: dict[str, Any] = {"lr": DELTA_LR}
    try:
        trainer = Trainer(spec)
        server.wait_healthy(http, 300)
        sender = WeightSender(spec, server.endpoints)
        version = 0

        def synced(mode: DeltaMode) -> tuple[float, int]:
            nonlocal version
            sender.spec.weight_sync.delta.mode = mode
            version += 1
            t0 = time.perf_counter()
            stats = sender.sync(version, trainer)
            return time.perf_counter() - t0, stats.bytes

        synced(DeltaMode.never)  # NCCL's first collectives
        synced(DeltaMode.always)  # a full sync that starts the chain
        deltas, fulls, densities = [], [], []
        for i in range(scale.small_steps):
            trainer.train([synthetic_batch(small, scale.small.vocab, seed=60 + i)])
            deltas.append(synced(DeltaMode.always))
            densities.append(round(sender.last_delta.density, 5))
        out["checksums_after_deltas"] = served_weights_match(http, server, trainer)
        for i in range(scale.small_steps):
            trainer.train([synthetic_batch(small, scale.small.vocab, seed=80 + i)])
            fulls.append(synced(DeltaMode.never))
        full_s, full_bytes = statistics.median(s for s, _ in fulls), fulls[-1][1]
        out["full_sync_ms"] = round(1000 * full_s, 1)
        out["delta_sync_ms"] = [round(1000 * s, 1) for s, _ in deltas]
        out["density"] = densities
        out["bytes_over_full"] = round(statistics.median(b / full_bytes for _, b in deltas), 4)
        out["seconds_over_full"] = round(statistics.median(s / full_s for s, _ in deltas), 3)
        sender.close()
        trainer.close()
    finally:
        http.close()
        server.stop()
    return out


FORKED_ROLE = (
    "import time, torch, kubedistill.runtime.engines.factory\n"
    "t = torch.ones(1024, device={device!r}); print(float(t.sum()), time.time())\n"
)
"""What a role does first on its GPU: our engines' imports, then a tensor on the device."""


def part_fork(work: Path, scale: Scale, dry: bool, device_name: str) -> dict[str, Any]:
    """Whether a role forked from `kubedistill run`'s zygote can use CUDA (a fork after anything
    touched the CUDA driver cannot), and what the fork saves: the same first steps of a role as
    a fresh process and as a fork. While unchecked, roles on GPU machines start fresh
    (`forks_roles`, runtime/entrypoints/zygote.py)."""
    from kubedistill.runtime.entrypoints.zygote import PRELOAD, Zygote

    code = FORKED_ROLE.format(device="cpu" if dry else "cuda")
    env = dict(os.environ)
    t0 = time.perf_counter()
    fresh = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    fresh_s = time.perf_counter() - t0
    zygote = Zygote(("torch",) if dry else PRELOAD)  # the dry run checks the steps, not CUDA
    try:
        t0 = time.perf_counter()
        first = zygote.fork("ready", [sys.executable, "-c", "pass"], zygote.env, str(work), str(work / "ready.log"))
        ready = first is not None and first.wait(120) == 0
        ready_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        role = zygote.fork("role", [sys.executable, "-c", code], zygote.env, str(work), str(work / "role.log"))
        code_forked = role.wait(120) if role is not None else None
        forked_s = time.perf_counter() - t0
    finally:
        zygote.close()
    said = (work / "role.log").read_text(errors="replace") if (work / "role.log").exists() else ""
    if not ready or code_forked != 0:
        raise RuntimeError(f"a forked role failed (exit {code_forked}): {said[-1500:]}")
    if fresh.returncode != 0:
        raise RuntimeError(f"a fresh role failed (exit {fresh.returncode}): {fresh.stderr[-1500:]}")
    return {
        "forked_role_uses_device": True,
        "fresh_role_s": round(fresh_s, 2),
        "zygote_ready_s": round(ready_s, 2),
        "forked_role_s": round(forked_s, 2),
    }


PARTS = {
    "text": part_text,
    "lora": part_lora,
    "vl": part_vl,
    "fixed": part_fixed,
    "delta": part_delta,
    "fork": part_fork,
}
BUDGET_SECONDS = {"text": 150, "lora": 60, "vl": 80, "fixed": 60, "delta": 80, "fork": 45}
"""Each part's limit on the GPU; together under the 8 minutes a borrowed GPU's command allows."""


def run_part(name: str, work: Path, dry: bool, result: Path) -> None:
    """One part in this process; its JSON (or its error) into `result`."""
    import torch

    hide_absent_packages()
    os.environ.setdefault("NCCL_HOSTID", "kubedistill-check-trainer")
    os.environ.setdefault("NCCL_NET", "Socket")
    if dry:
        torch.set_num_threads(1)
    device_name = "cpu" if dry else torch.cuda.get_device_name(0)
    t0 = time.perf_counter()
    try:
        out = {"ok": True, **PARTS[name](work, TINY if dry else GPU, dry, device_name)}
    except Exception as e:
        import traceback

        traceback.print_exc()
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    result.write_text(json.dumps(out))
    # Past the check, the interpreter's own teardown has nothing left to prove: a clean exit of the
    # product's ranks is tested elsewhere, and a hang here would cost the borrowed GPU's minutes.
    sys.stdout.flush()
    os._exit(0)


def serve(config: str, port: int) -> None:
    """The rollout server process, with vLLM and Ray hidden like in the check's own processes."""
    hide_absent_packages()
    from kubedistill.cli import main

    args = ["--config", config, "--replica", "0", "--host", "127.0.0.1", "--port", str(port), "--debug-endpoints"]
    sys.exit(main(["role", "rollout", *args]))


def environment(dry: bool) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if not dry and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["device"] = torch.cuda.get_device_name(0)
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["peak_bf16_tflops"] = peak_bf16_tflops(env["device"])
    else:
        env["device"] = "cpu (dry run)"
    return env


def orchestrate(args: argparse.Namespace) -> int:
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"gpu_check: --parts: unknown {unknown} (allowed: {', '.join(PARTS)})", file=sys.stderr)
        return 2
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: torch sees no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
            return 2
    report: dict[str, Any] = {"dry_run": args.dry_run, "environment": environment(args.dry_run), "parts": {}}
    t_all = time.perf_counter()
    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kd-gpu-check-"))
    for name in parts:
        work = base / name
        work.mkdir(parents=True, exist_ok=True)
        result = work / "result.json"
        budget = BUDGET_SECONDS[name] * (3 if args.dry_run else 1)
        print(f"== gpu_check: {name} (limit {budget} s)", flush=True)
        cmd = [sys.executable, __file__, "part", name, str(work), str(result)] + (["--dry-run"] if args.dry_run else [])
        t0 = time.perf_counter()
        # A session of its own, so a part over its limit goes with its rollout server: an orphaned
        # server would keep its share of the GPU from the parts after it.
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            proc.wait(timeout=budget)
            if result.is_file():
                out = json.loads(result.read_text())
            else:
                out = {"ok": False, "error": f"the part's process exited with {proc.returncode} and no result"}
        except subprocess.TimeoutExpired:
            out = {"ok": False, "error": f"over its {budget} s limit"}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.setdefault("seconds", round(time.perf_counter() - t0, 1))
        report["parts"][name] = out
        print(json.dumps({name: out}, indent=1), flush=True)
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    report["ok"] = all(p["ok"] for p in report["parts"].values())
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    failed = [n for n, p in report["parts"].items() if not p["ok"]]
    verdict = "PASSED" if not failed else f"FAILED: {', '.join(failed)}"
    print(f"gpu_check: {verdict} in {report['seconds']} s on {report['environment']['device']}")
    return 0 if not failed else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "part":
        run_part(sys.argv[2], Path(sys.argv[3]), "--dry-run" in sys.argv, Path(sys.argv[4]))
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    p = argparse.ArgumentParser(description="the GPU check (docs/gpu.md)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (what CI runs)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--workdir", default=None, help="models and logs (default: a new temporary folder)")
    return orchestrate(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
