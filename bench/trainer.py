"""Trainer throughput on CPU: tokens/s of one train step (forward, forwardKLTopK loss, backward,
AdamW) for a tiny model and SmolLM2-135M, with 1 and 2 gloo ranks (FSDP2).

    .venv/bin/python bench/trainer.py [--steps 3] [--samples 8] [--prompt 32] [--response 96]
    .venv/bin/python bench/trainer.py --overhead [--reps 21]

Every configuration runs in fresh processes (one per rank, 1 torch thread each). Prints one line
per configuration, the 2-rank/1-rank ratios, and last the SmolLM2-135M single-rank tokens/s.
Not run in CI. On a 2-core machine multi-rank CPU runs check correctness, not speed.

--overhead (no model): a step's 64 samples x (128 + 1,024) tokens with top-k 32 signals, from
the samples as the buffer holds them to every rank's micro-batch tensors, on 2 gloo ranks, against
one raw broadcast of the same bytes (median of interleaved runs); last line that ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # smollm: the SmolLM2 test model
BEFORE = 110.0
"""--overhead's ratio with TrainBatch as nested lists pickled to every rank (1,609 ms against a
14.6 ms raw broadcast), measured once before batches travelled as tensors."""


def _spec(model: Path, ckpt: Path):
    from kubedistill.api.spec import DistillationJobSpec

    return DistillationJobSpec.model_validate(
        {
            "device": "cpu",
            "student": {"model": str(model)},
            "teachers": [{"name": "t", "model": str(model)}],
            "data": {"train": ["unused.jsonl"]},
            "trainer": {"mixedPrecision": "float32", "optim": {"lr": 1e-5}, "microBatchTokens": 4096},
            "algorithm": {"distillation": {"lossMode": "forwardKLTopK", "topK": 32}},
            "checkpoint": {"path": str(ckpt)},
        }
    )


def _batch(vocab: int, samples: int, prompt: int, response: int, k: int = 32):
    import torch

    from kubedistill.runtime.wire.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, vocab, (prompt + response,), generator=g).tolist() for _ in range(samples)]
    k = min(k, vocab - 4)
    return TrainBatch(
        token_ids=ids,
        prompt_lens=[prompt] * samples,
        rollout_logprobs=[[-1.0] * response for _ in range(samples)],
        signals={
            "teacher_logprobs": [[-1.0] * response for _ in range(samples)],
            "teacher_topk_ids": [
                [torch.randperm(vocab - 4, generator=g)[:k].add(4).tolist()] * response for _ in range(samples)
            ],
            "teacher_topk_logprobs": [
                [sorted((-torch.rand(k, generator=g) * 5).tolist(), reverse=True)] * response for _ in range(samples)
            ],
        },
    )


def worker(rank: int, world: int, port: int, model: str, steps: int, samples: int, prompt: int, response: int) -> None:
    import torch
    import torch.distributed as dist

    from kubedistill.runtime.trainer import Trainer

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    with tempfile.TemporaryDirectory() as ckpt:
        trainer = Trainer(_spec(Path(model), Path(ckpt)))
        if rank != 0:
            trainer.follow()
        else:
            batch = _batch(trainer.hf_config.vocab_size, samples, prompt, response).to_parts()
            trainer.step(batch)  # warm-up
            rates = []
            for _ in range(steps):
                t0 = time.perf_counter()
                stats = trainer.step(batch)
                rates.append(stats.tokens / (time.perf_counter() - t0))
            trainer.close()
            print(json.dumps({"tokens_per_second": statistics.median(rates), "tokens": stats.tokens}), flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _samples(n: int, prompt: int, response: int, k: int, vocab: int = 49152, seed: int = 0) -> list:
    """A step's scored samples as the buffer holds them (plain lists, as /generate and /score fill
    them): n samples of `prompt` + `response` tokens with forwardKLTopK's signals."""
    import random

    from kubedistill.runtime.driver.samples import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(response)]
        s = Sample(group_id=i, index=0, prompt_ids=[rng.randrange(vocab) for _ in range(prompt)], max_tokens=response)
        s.response_ids, s.versions, s.finish_reason = ids, [0] * response, "stop"
        s.logprobs = [-rng.random() for _ in range(response)]
        s.signals = {
            "teacher_logprobs": [-rng.random() for _ in range(response)],
            "teacher_topk_ids": [[rng.randrange(vocab) for _ in range(k)] for _ in range(response)],
            "teacher_topk_logprobs": [
                sorted((-5 * rng.random() for _ in range(k)), reverse=True) for _ in range(response)
            ],
        }
        out.append(s)
    return out


def _ready(samples, req, rank: int, ranks, buffers, micro_tokens: int) -> int:
    """What a train step does from its samples to every rank's micro-batch tensors (as
    Trainer.step): rank 0 takes the samples' arrays (made as they entered the buffer), lays them
    out in the step's plan order while broadcasting a header and the flat tensors; every rank
    slices its micro-batches. Returns this rank's response tokens."""
    from kubedistill.api.losses import TEACHER_TOP_K
    from kubedistill.runtime.driver.batcher import to_train_batch
    from kubedistill.runtime.trainer import losses as L
    from kubedistill.runtime.trainer.microbatch import collate, plan_order, plan_step
    from kubedistill.runtime.wire.batch import TensorBatch

    if rank == 0:
        parts = to_train_batch(samples, req)
        parts.validate(req.contract)
        order, plan = plan_order(plan_step(parts.lengths, ranks.world, micro_tokens, pack=True))
        header = parts.header(order, plan)
        ranks.broadcast_object(header)
        carved = buffers.take(header)
        full, filled = parts.layout(header, order, into=carved.tensors)
        sent = ranks.broadcast_tensors(carved.sent(filled), wait=False)  # rank 0 reads its copy meanwhile
    else:
        header = ranks.broadcast_object(None)
        carved = buffers.take(header)
        full = carved.tensors
        sent = ranks.broadcast_tensors(carved.received())
    batch = TensorBatch.from_wire(header, full)
    w = L.token_weights(batch.response_lens, "tokenMean") * ranks.world
    tokens = sum(collate(batch, rows, w, None, 0, top_k=TEACHER_TOP_K).targets.numel() for rows in batch.plan[rank])
    sent()
    return tokens


def overhead_worker(
    rank: int, world: int, port: int, reps: int, samples: int, prompt: int, response: int, k: int
) -> None:
    """One rank of --overhead: the step's samples to ready micro-batch tensors on every rank,
    against one raw broadcast of as many bytes."""
    import torch
    import torch.distributed as dist

    from kubedistill.api.losses import CONTRACTS
    from kubedistill.api.spec import Device, LossMode
    from kubedistill.runtime.driver.batcher import BatchRequirements, prepare
    from kubedistill.runtime.driver.samples import SampleGroup
    from kubedistill.runtime.trainer.distributed import Ranks
    from kubedistill.runtime.wire.batch import BatchBuffers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    req = BatchRequirements(
        group_size=1, mini_batch_size=samples, contract=CONTRACTS[LossMode.forward_kl_top_k], top_k=k
    )
    ranks = Ranks(Device.cpu)
    buffers = BatchBuffers()  # as the trainer keeps them from step to step
    data, pack_s = None, 0.0
    if rank == 0:
        data = _samples(samples, prompt, response, k)
        t0 = time.perf_counter()
        for i, s in enumerate(data):  # as each group enters the buffer, before any step
            prepare(SampleGroup(i, [s]), req)
        pack_s = time.perf_counter() - t0

    # The bytes of the step as tensors: ids int64, log-probs float32, top-k ids int64 + log-probs float32.
    tokens = samples * response
    nbytes = samples * (prompt + response) * 8 + tokens * (4 + 4) + tokens * k * (8 + 4)
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    path_s, raw_s = [], []
    for _ in range(reps + 1):  # the first of each is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        _ready(data, req, rank, ranks, buffers, 16384)
        dist.barrier()
        path_s.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(raw, src=0)
        dist.barrier()
        raw_s.append(time.perf_counter() - t0)
    if rank == 0:
        path, raw_med = statistics.median(path_s[1:]), statistics.median(raw_s[1:])
        print(json.dumps({"path": path, "raw": raw_med, "bytes": nbytes, "pack": pack_s}))
    dist.barrier()
    dist.destroy_process_group()


def overhead(args: argparse.Namespace) -> None:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [str(a) for a in (port, args.reps, 64, 128, 1024, 32)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--overhead-worker", str(r), "2", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = [p.communicate() for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"overhead rank {r} failed:\n{err[-3000:]}")
    r = json.loads(outs[0][0].strip().splitlines()[-1])
    print(f"batch of 64 x (128 + 1024) tokens, top-k 32, 2 gloo ranks: {r['bytes'] / 1e6:.1f} MB as tensors")
    print(f"arrays made as the 64 samples entered the buffer (not in a step): {r['pack'] * 1e3:.1f} ms")
    print(f"samples -> ready micro-batch tensors on every rank: {r['path'] * 1e3:.1f} ms")
    print(f"one raw broadcast of the same bytes: {r['raw'] * 1e3:.1f} ms")
    print(f"before, pickled lists (measured once, docs/design.md#performance-targets): {BEFORE:.0f}")
    print(f"batch transfer overhead / raw broadcast: {r['path'] / r['raw']:.2f}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: Path, world: int, args: argparse.Namespace) -> dict:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(r),
                str(world),
                str(port),
                str(model),
                str(args.steps),
                str(args.samples),
                str(args.prompt),
                str(args.response),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    outs = [p.communicate() for p in procs]
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"rank {r} of {model.name} x{world} failed:\n{err[-3000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(int(a[0]), int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]), int(a[6]), int(a[7]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--overhead-worker":
        overhead_worker(*(int(x) for x in sys.argv[2:]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=96)
    p.add_argument("--cache", default=str(ROOT / ".kubedistill" / "bench-models"))
    p.add_argument("--overhead", action="store_true", help="only the batch transfer overhead (no model)")
    p.add_argument("--reps", type=int, default=21, help="--overhead repetitions (median)")
    args = p.parse_args()
    if args.overhead:
        overhead(args)
        return

    from kubedistill.demo.tiny import build_tiny_bpe_model
    from smollm import smollm2_hf_dir

    cache = Path(args.cache)
    tiny = cache / "tiny-llama"
    if not (tiny / "config.json").is_file():
        build_tiny_bpe_model(
            tiny, arch="llama", vocab_size=512, hidden_size=256, num_heads=4, num_layers=4, intermediate_size=768
        )
    models = {"tiny": tiny, "smollm2-135m": smollm2_hf_dir(cache)}
    results = {}
    for name, path in models.items():
        for world in (1, 2):
            r = run(path, world, args)
            results[(name, world)] = r["tokens_per_second"]
            print(
                f"{name:14s} ranks={world} tokens/step={r['tokens']} tokens/s={r['tokens_per_second']:.1f}", flush=True
            )
    for name in models:
        print(f"{name:14s} 2-rank / 1-rank tokens/s ratio: {results[(name, 2)] / results[(name, 1)]:.2f}")
    print(f"smollm2-135m single-rank train tokens/s: {results[('smollm2-135m', 1)]:.1f}")


if __name__ == "__main__":
    main()
