"""hf engine throughput: continuous batching vs one request at a time (not run in CI).

On the tiny test models (kubedistill/demo/tiny.py), in this process, measures tokens/s for N
concurrent /generate requests of M new tokens each (temperature 1, ignore_eos, prompts of 8-24
tokens), and sequences/s for N concurrent /score requests, for:
  old      the engine before continuous batching (runtime/engines/hf.py at commit OLD_COMMIT,
           read with `git show`): one thread per request, one batch-1 forward per token
  seqs=1   the batching engine with max_num_seqs=1 (requests decode one after the other)
  batched  the batching engine (all requests in one batch, one forward per step)
Median of --repeats runs each. Last line: the batched/old tokens/s ratio on the student.

    .venv/bin/python bench/hf_engine.py --requests 64 --tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubedistill.runtime.engines.base import Engine

Rate = Callable[["Engine", list[list[int]], int], Awaitable[float]]
"""A measurement: (engine, prompts, new tokens per request) -> rate."""

ROOT = Path(__file__).resolve().parent.parent
OLD_COMMIT = "f0c303becd6485f6d59ea8a89b3c54860c62dcca"


def old_engine_class(work: Path) -> type[Engine] | None:
    """HFEngine as it was before continuous batching, or None without git history."""
    try:
        src = subprocess.run(
            ["git", "show", f"{OLD_COMMIT}:runtime/engines/hf.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"# the old engine is unavailable ({e}); comparing with max_num_seqs=1 only", flush=True)
        return None
    path = work / "hf_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kubedistill_bench_hf_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HFEngine


async def generate_rate(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    from kubedistill.runtime.wire.protocol import GenerateRequest, Sampling

    sampling = Sampling(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(
            engine.generate(GenerateRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=sampling))
            for i, p in enumerate(prompts)
        )
    )
    seconds = time.perf_counter() - t0
    assert all(len(o.token_ids) == tokens for o in outs)
    return sum(len(o.token_ids) for o in outs) / seconds


async def score_rate(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    from kubedistill.runtime.wire.protocol import ScoreRequest

    rng = random.Random(1)
    reqs = [
        ScoreRequest(token_ids=p + [rng.randrange(4, 16) for _ in range(tokens)], prompt_len=len(p), top_k=4)
        for p in prompts
    ]
    t0 = time.perf_counter()
    await asyncio.gather(*(engine.score(r) for r in reqs))
    return len(reqs) / (time.perf_counter() - t0)


async def measure(make: Callable[[], Engine], run: Rate, prompts: list[list[int]], tokens: int, repeats: int) -> float:
    engine = make()
    await engine.start()
    await run(engine, prompts[:2], 2)  # warm-up
    rates = [await run(engine, prompts, tokens) for _ in range(repeats)]
    await engine.shutdown()
    return statistics.median(rates)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: what the tests use)")
    args = ap.parse_args()

    import torch

    sys.path.insert(0, str(ROOT))
    from kubedistill.demo.tiny import build_tiny_model, char_tokenizer
    from kubedistill.runtime.engines.hf import HFEngine

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench-hf-engine-"))
    tok = char_tokenizer("0123456789+=")
    models = {  # the shapes of tests/conftest.py's tiny_models
        "student": build_tiny_model(work / "student", tok, seed=0, num_layers=2),
        "teacher": build_tiny_model(work / "teacher", tok, seed=1, num_layers=4, intermediate_size=512),
    }
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(4, 16) for _ in range(rng.randint(7, 23))] for _ in range(args.requests)]
    Old = old_engine_class(work)
    print(
        f"# {args.requests} concurrent requests x {args.tokens} new tokens, prompts 8-24 tokens, "
        f"{args.threads} torch thread(s), median of {args.repeats}",
        flush=True,
    )

    results: dict[tuple[str, str, str], float] = {}
    for name, path in models.items():
        for label, run, unit in (("generate", generate_rate, "tokens/s"), ("score", score_rate, "seqs/s")):
            engines = {
                "batched": lambda path=path: HFEngine(str(path), dtype="float32"),
                "seqs=1": lambda path=path: HFEngine(str(path), dtype="float32", max_num_seqs=1),
            }
            if Old is not None:
                engines["old"] = lambda path=path: Old(str(path), dtype="float32")
            for kind, make in engines.items():
                if label == "score" and kind == "seqs=1":
                    continue  # max_num_seqs bounds generation only
                rate = await measure(make, run, prompts, args.tokens, args.repeats)
                results[(name, label, kind)] = rate
                print(f"{name:8s} {label:9s} {kind:8s} {rate:10.1f} {unit}", flush=True)
    base = "old" if Old is not None else "seqs=1"
    for name in models:
        for label in ("generate", "score"):
            if (name, label, base) in results:
                ratio = results[(name, label, "batched")] / results[(name, label, base)]
                print(f"{name:8s} {label:9s} batched/{base}: {ratio:.2f}x", flush=True)
    ratio = results[("student", "generate", "batched")] / results[("student", "generate", base)]
    print(
        f"speed-up, {args.requests} concurrent rollouts of {args.tokens} tokens (student, tokens/s batched/{base}): "
        f"{ratio:.1f}x"
    )


if __name__ == "__main__":
    asyncio.run(main())
