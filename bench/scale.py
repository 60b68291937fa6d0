"""Scale benchmark (docs/design.md#at-scale): how far one driver (trainer rank 0) keeps a fleet the
size of a real GPU job fed, and how a weight sync's time grows with its receivers.

Every driver point is bench/fleet_sim.py in a fresh process: the real driver, batcher, buffer and
HTTP clients against fake rollout and teacher servers that speak the real protocol from answers
built before the run (each rollout server makes `--rate` output tokens/s when full; 32 x 31,250 =
1M tokens/s), a trainer stand-in of a set step, and the weight sender's real control messages. A
step takes 90 % of what the fleet makes in it (at most --max-required samples), so a driver that
keeps up leaves the trainer no wait. Sweeps, each a table:

* servers: rollout servers 1 -> 64 (teachers: half as many), at top-k 0 and 64: samples/s and
  scored tokens/s the trainer got, CPU per sample and per 1k tokens, the trainer's wait;
* top-k: the teacher's top-k 0 -> 64 at --fixed-servers;
* length: the answers' median 256 -> 4096 tokens (p99 8x the median);
* staleness: peak RSS against the staleness bound (a slow trainer, so the buffer fills to it);
* fan-out: a full weight sync of a small model to 1, 2, 4, 8 real hf rollout servers on gloo
  (bench/weight_sync.py's servers), against one raw broadcast of the same bytes.

    .venv/bin/python bench/scale.py               # everything (~40 min on 2 busy cores)
    .venv/bin/python bench/scale.py --quick       # a few points of each (~5 min)
    .venv/bin/python bench/scale.py --sweeps servers --servers 1,8,32 --plot docs/scale.png

Prints the tables; the last line is the sustained scored tokens/s at top-64 (the best servers
point) over 1M tokens/s. The machine's load is printed with every point: on a shared machine the
rates are lower bounds, CPU per token is the steadier number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "tests"))  # bench/weight_sync.py's server fixtures

from _common import fmt, table  # noqa: E402

TARGET_TOKENS = 1_000_000.0
"""The reference fleet: 32 rollout GPUs at ~31k output tokens/s each."""
SWEEPS = ("servers", "top_k", "length", "staleness", "fanout")


def point(args: argparse.Namespace, **over: Any) -> dict[str, Any]:
    """One fleet_sim run in a fresh process; its JSON result (or the failure)."""
    opts = {
        "seconds": args.seconds,
        "warmup": args.warmup,
        "max_required": args.max_required,
        "step_seconds": args.step_seconds,
        "rate": args.rate,
        **over,
    }
    cmd = [sys.executable, str(HERE / "fleet_sim.py")]
    for k, v in opts.items():
        if isinstance(v, bool):
            cmd += ["--" + k.replace("_", "-")] if v else []
        else:
            cmd += ["--" + k.replace("_", "-"), str(v)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = "\n".join(r.stderr.strip().splitlines()[-5:])
        print(f"# point {over} failed ({r.returncode}):\n{tail}", flush=True)
        return {"failed": True, **over}
    out = json.loads(lines[-1])
    out["wall_s"] = time.monotonic() - t0
    return out


HEAD = ("servers", "teachers", "top-k", "median", "fleet tok/s", "samples/s", "scored tok/s", "of fleet",
        "trainer wait", "CPU ms/sample", "CPU ms/1k tok", "loop CPU", "fakes CPU", "peak RSS MB", "load")  # fmt: skip


def row(p: dict[str, Any]) -> list[str]:
    if p.get("failed"):
        return [str(p.get(k, "")) for k in ("rollouts", "teachers", "top_k", "median_tokens")] + ["failed"] + [""] * 10
    f = p["fleet"]
    return [
        str(f["rollouts"]),
        str(f["teachers"] or max(1, -(-f["rollouts"] // 2))),
        str(f["top_k"]),
        str(f["median_tokens"]),
        f"{p['fleet_tokens_per_s']:,.0f}",
        fmt(p["trained_samples_per_s"], ".1f"),
        f"{p['trained_tokens_per_s']:,.0f}",
        fmt(p["trained_tokens_per_s"] / p["fleet_tokens_per_s"], ".2f"),
        fmt(p["wait_fraction"], ".0%") + (f" ({p['ended']})" if p["ended"] else ""),
        fmt(p["cpu_ms_per_sample"], ".1f"),
        fmt(p["cpu_ms_per_1k_tokens"], ".1f"),
        fmt(p["loop_cpu_per_s"], ".2f"),
        fmt(p["fake_cpu_per_s"], ".2f"),
        fmt(p["peak_rss_mb"], ".0f"),
        fmt(p["load1"], ".1f"),
    ]


def show(title: str, points: list[dict[str, Any]]) -> None:
    print(f"\n## {title}")
    print(table(HEAD, [row(p) for p in points]), flush=True)


def fed(points: list[dict[str, Any]], top_k: int) -> int | None:
    """The largest fleet (rollout servers) whose trainer waited at most 5 % of its steps."""
    ok = [p["fleet"]["rollouts"] for p in points
          if not p.get("failed") and p["fleet"]["top_k"] == top_k and p["wait_fraction"] <= 0.05]  # fmt: skip
    return max(ok) if ok else None


# ---- weight-sync fan-out ------------------------------------------------------------------------


def small_model(work: Path) -> Path:
    from kubedistill.demo.tiny import build_tiny_model, char_tokenizer

    out = work / "fanout-model"
    if (out / "config.json").exists():
        return out
    tok = char_tokenizer("0123456789+=abcdefghijklmnopqrstuvwxyz ")
    return build_tiny_model(
        out,
        tok,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1536,
        max_position_embeddings=512,
    )


def fanout(receivers: list[int], repeats: int, bucket_mb: int) -> list[dict[str, Any]]:
    """Per receiver count: median seconds of one raw broadcast and of our full sync (pack,
    broadcast, unpack, load into every engine, closing all-reduce) of the same model."""
    import torch
    import weight_sync as ws
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    cache = HERE.parent / ".kubedistill" / "bench" / "scale"
    cache.mkdir(parents=True, exist_ok=True)
    mdir = small_model(cache)
    model = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(f"\n## fan-out: {nbytes / 2**20:.0f} MiB fp32, bucket {bucket_mb} MB, {repeats} repeats", flush=True)
    out = []
    for n in receivers:
        ns = argparse.Namespace(engine="hf", receivers=n, buckets_mb=str(bucket_mb))
        work = Path(tempfile.mkdtemp(prefix="kd-scale-fanout-"))
        with ws.rollout_servers(mdir, work, ns) as (sender, _urls), ws.raw_peers(sender) as peers:
            raw, ours = [], []
            for v in range(1, repeats + 1):
                raw.append(peers.broadcast(nbytes))
                t = time.perf_counter()
                sender.sync(v, named, bucket_bytes=bucket_mb * 2**20)
                ours.append(time.perf_counter() - t)
        r = {"receivers": n, "bytes": nbytes, "raw_s": statistics.median(raw), "sync_s": statistics.median(ours),
             "load1": os.getloadavg()[0]}  # fmt: skip
        print(f"# {n} receivers: raw {r['raw_s']:.3f} s, sync {r['sync_s']:.3f} s (load {r['load1']:.1f})", flush=True)
        out.append(r)
    return out


def show_fanout(rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    print(table(
        ("receivers", "raw broadcast s", "full sync s", "sync / 1 receiver", "GB/s to each", "load"),
        [(r["receivers"], fmt(r["raw_s"]), fmt(r["sync_s"]), fmt(r["sync_s"] / base["sync_s"], ".2f"),
          fmt(r["bytes"] / r["sync_s"] / 1e9, ".2f"), fmt(r["load1"], ".1f")) for r in rows],
    ))  # fmt: skip


# ---- plots --------------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(18, 3.8))
    ok = lambda ps: [p for p in ps if not p.get("failed")]  # noqa: E731
    servers = ok(results.get("servers", []))
    for k in sorted({p["fleet"]["top_k"] for p in servers}):
        ps = sorted((p for p in servers if p["fleet"]["top_k"] == k), key=lambda p: p["fleet"]["rollouts"])
        ax[0].plot([p["fleet"]["rollouts"] for p in ps], [p["trained_tokens_per_s"] for p in ps], "o-",
                   label=f"driver, top-{k}")  # fmt: skip
    if servers:
        xs = sorted({p["fleet"]["rollouts"] for p in servers})
        ax[0].plot(xs, [x * servers[0]["fleet"]["rate"] for x in xs], "--", color="grey", label="fleet makes")
        ax[0].axhline(TARGET_TOKENS, color="red", lw=0.8, ls=":", label="1M tokens/s")
    ax[0].set(xscale="log", yscale="log", xlabel="rollout servers", ylabel="scored tokens/s trained",
              title="throughput against fleet size")  # fmt: skip
    ax[0].legend(fontsize=7)
    tk = sorted(ok(results.get("top_k", [])), key=lambda p: p["fleet"]["top_k"])
    if tk:
        ax[1].plot([p["fleet"]["top_k"] for p in tk], [p["cpu_ms_per_1k_tokens"] for p in tk], "o-")
    ax[1].set(xlabel="teacher top-k", ylabel="driver CPU ms per 1k tokens", title="CPU against top-k")
    st = sorted(ok(results.get("staleness", [])), key=lambda p: p["job"]["staleness"])
    if st:
        bound = [p["required"] * (p["job"]["staleness"] + 1) for p in st]
        ax[2].plot(bound, [p["peak_rss_mb"] for p in st], "o-")
    ax[2].set(xlabel="staleness bound (samples)", ylabel="driver peak RSS (MB)", title="memory against the bound")
    fo = results.get("fanout", [])
    if fo:
        ax[3].plot([r["receivers"] for r in fo], [r["sync_s"] for r in fo], "o-", label="full sync")
        ax[3].plot([r["receivers"] for r in fo], [r["raw_s"] for r in fo], "s--", label="raw broadcast")
        ax[3].legend(fontsize=7)
    ax[3].set(xlabel="receivers (hf, gloo, loopback)", ylabel="seconds", title="weight sync fan-out")
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"# wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few points of each sweep, shorter windows")
    ap.add_argument("--sweeps", default=",".join(SWEEPS), help=f"which of {', '.join(SWEEPS)}")
    ap.add_argument("--servers", default="1,2,4,8,16,32,64")
    ap.add_argument("--servers-top-ks", default="0,64", help="top-k of the servers sweep's curves")
    ap.add_argument("--top-ks", default="0,8,16,32,64")
    ap.add_argument("--lengths", default="256,1024,4096", help="answer medians (p99 = 8x)")
    ap.add_argument("--length-top-k", type=int, default=16)
    ap.add_argument("--staleness", default="0.5,1,2,4")
    ap.add_argument("--fixed-servers", type=int, default=8, help="rollout servers of the top-k and length sweeps")
    ap.add_argument("--rate", type=float, default=31_250.0, help="output tokens/s of one rollout server")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window per point")
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--step-seconds", type=float, default=2.0)
    ap.add_argument("--max-required", type=int, default=2048)
    ap.add_argument("--fanout", default="1,2,4,8", help="receiver counts of the fan-out sweep")
    ap.add_argument("--repeats", type=int, default=3, help="syncs per fan-out row")
    ap.add_argument("--json", help="write every point here")
    ap.add_argument("--plot", help="write the curves here (e.g. docs/scale.png)")
    ap.add_argument("--plot-only", help="no runs: plot the points in these --json files (comma-separated, later wins)")
    args = ap.parse_args()
    if args.quick:
        args.servers, args.top_ks, args.lengths, args.staleness = "1,4,16", "0,64", "256,1024", "0.5,2"
        args.fanout, args.repeats, args.seconds, args.warmup = "1,2", 2, 10.0, 6.0
    if args.plot_only:
        merged: dict[str, Any] = {}
        for f in args.plot_only.split(","):
            merged.update(json.loads(Path(f).read_text()))
        plot(merged, Path(args.plot or "docs/scale.png"))
        return 0
    sweeps = args.sweeps.split(",")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    print(
        f"# {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at start; {args.seconds:.0f} s per point", flush=True
    )
    results: dict[str, Any] = {}
    if "servers" in sweeps:
        results["servers"] = [point(args, rollouts=n, top_k=k) for k in ints(args.servers_top_ks)
                              for n in ints(args.servers)]  # fmt: skip
        show("servers (median 1024, p99 8192 tokens)", results["servers"])
    if "top_k" in sweeps:
        results["top_k"] = [point(args, rollouts=args.fixed_servers, top_k=k) for k in ints(args.top_ks)]
        show(f"top-k ({args.fixed_servers} rollout servers)", results["top_k"])
        # The driver before this page's changes (top-k rows held as per-number lists, Python's own
        # collector settings), at top-0 and top-64, in the same run as the points above.
        after = {p["fleet"]["top_k"]: p for p in results["top_k"] if not p.get("failed")}
        results["before"] = [
            point(args, rollouts=args.fixed_servers, top_k=k, copy_rows=True, python_gc=True)
            for k in (0, 64)
            if k in after
        ]
        show("the driver before (rows as per-number lists, Python's collector settings)", results["before"])
        for b in results["before"]:
            a = after[b["fleet"]["top_k"]] if not b.get("failed") else None
            if a is not None:
                print(
                    f"top-{b['fleet']['top_k']}: driver CPU per 1k tokens before / after: "
                    f"{b['cpu_ms_per_1k_tokens'] / a['cpu_ms_per_1k_tokens']:.2f}; ingested tokens/s after / before: "
                    f"{a['ingested_tokens_per_s'] / b['ingested_tokens_per_s']:.2f}",
                    flush=True,
                )
    if "length" in sweeps:
        results["length"] = [
            point(args, rollouts=args.fixed_servers, top_k=args.length_top_k, median_tokens=m, p99_tokens=8 * m)
            for m in ints(args.lengths)
        ]
        show(f"length (top-{args.length_top_k}, {args.fixed_servers} rollout servers)", results["length"])
    if "staleness" in sweeps:
        # A trainer slower than the driver (64 samples per 8 s step), so the buffer fills to the bound.
        results["staleness"] = [
            point(args, rollouts=2, top_k=64, staleness=s, required=64, step_seconds=8.0)
            for s in [float(x) for x in args.staleness.split(",")]
        ]
        print("\n## staleness (top-64, 2 rollout servers, 64 samples per 8 s step)")
        print(table(
            ("stalenessThreshold", "bound (samples)", "peak RSS MB", "RSS at start MB", "MB per bound sample", "load"),
            [(p["job"]["staleness"], int(p["required"] * (p["job"]["staleness"] + 1)), fmt(p["peak_rss_mb"], ".0f"),
              fmt(p["rss0_mb"], ".0f"),
              fmt((p["peak_rss_mb"] - p["rss0_mb"]) / (p["required"] * (p["job"]["staleness"] + 1)), ".1f"),
              fmt(p["load1"], ".1f")) for p in results["staleness"] if not p.get("failed")],
        ), flush=True)  # fmt: skip
    if "fanout" in sweeps:
        results["fanout"] = fanout(ints(args.fanout), args.repeats, 64)
        show_fanout(results["fanout"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, Path(args.plot))
    servers = [p for p in results.get("servers", []) if not p.get("failed")]
    for k in sorted({p["fleet"]["top_k"] for p in servers}):
        n = fed(servers, k)
        print(f"largest fleet kept fed (trainer wait <= 5 %), top-{k}: "
              f"{n if n is not None else 'none of the sizes tried'} rollout servers")  # fmt: skip
    best = max((p for p in servers if p["fleet"]["top_k"] == 64), key=lambda p: p["trained_tokens_per_s"], default=None)
    if best is None:
        print("sustained scored tokens/s at top-64 / 1M tokens/s: — (no top-64 servers point)")
        return 1
    per_core = 1e6 / best["cpu_ms_per_1k_tokens"] if best["cpu_ms_per_1k_tokens"] else float("nan")
    print(f"one driver core at top-64 would ingest {per_core:,.0f} tokens/s "
          f"({best['cpu_ms_per_1k_tokens']:.1f} CPU ms per 1k tokens)")  # fmt: skip
    print(
        f"sustained scored tokens/s at top-64 / 1M tokens/s: {best['trained_tokens_per_s'] / TARGET_TOKENS:.3f} "
        f"({best['trained_tokens_per_s']:,.0f} tokens/s, {best['fleet']['rollouts']} rollout servers, "
        f"load {best['load1']:.1f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
