"""Trainer throughput on CPU: tokens/s of one train step (forward, forwardKLTopK loss, backward,
AdamW) for a tiny model and SmolLM2-135M, with 1 and 2 gloo ranks (FSDP2).

    .venv/bin/python bench/trainer.py [--steps 3] [--samples 8] [--prompt 32] [--response 96]

Every configuration runs in fresh processes (one per rank, 1 torch thread each). Prints one line
per configuration, the 2-rank/1-rank ratios, and last the SmolLM2-135M single-rank tokens/s.
Not run in CI. On a 2-core machine multi-rank CPU runs check correctness, not speed.
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
            batch = _batch(trainer.hf_config.vocab_size, samples, prompt, response)
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=96)
    p.add_argument("--cache", default=str(ROOT / ".kubedistill" / "bench-models"))
    args = p.parse_args()

    from kubedistill.runtime.models.smollm import smollm2_hf_dir
    from kubedistill.runtime.models.tiny import build_tiny_bpe_model

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
