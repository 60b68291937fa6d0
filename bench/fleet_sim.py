"""A fleet simulator: trainer rank 0's real driver fed by fake rollout and teacher servers the
size of a real GPU job (docs/design.md#at-scale). bench/scale.py sweeps it.

What is real: the driver (runtime/driver/loop.py) with its batcher, buffer, routing and HTTP
clients, over real HTTP on loopback; the wire shapes (runtime/wire/protocol.py, streams.py: the
fakes parse every request with the product's models and answer in its frames); the weight
sender (runtime/weight_sync/sender.py) with its control messages (POST and GET /weights/group,
POST /weights/begin with the manifest of an 8B model, GET /version?at_least), only the
broadcast and the closing all-reduce replaced by sleeps of a set length; a real byte-level BPE
tokenizer decoding every answer for its reward.

What is not: the servers answer from answers built before the run (no model), at a set token
rate per rollout server; the trainer's step is a stand-in of a set length that lays the batch out
as rank 0 does (BatchParts.to_tensors) and sleeps the rest of it.

The fakes are cheap: every answer body is made once (per length, and per weight version for the
rollout's), and one process serves many ports with aiohttp; a ticker every few milliseconds
completes the requests whose time has come. A rollout server runs `slots` requests at once, each
at `request_rate` tokens/s (so `rate = slots x request_rate` tokens/s when full), queueing the
rest; a weight sync freezes its requests (partialRollout inflight) for the sync's transfer and
load. A teacher answers after `teacher_latency` + its tokens at `teacher_rate`.

    .venv/bin/python bench/fleet_sim.py --rollouts 8 --top-k 64 --seconds 20

The command prints one point's result as JSON (bench/scale.py runs each point in a fresh process,
so peak RSS is the point's own).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import heapq
import itertools
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VOCAB = 151_936
"""Top-k ids are drawn from a Qwen-sized vocabulary (what the driver stores, the wire carries)."""
TEXT_VOCAB = 512
"""The sampled tokens come from the tokenizer's own vocabulary (the driver decodes them)."""


@dataclass
class FleetShape:
    """The simulated servers."""

    rollouts: int = 8
    teachers: int = 0
    """Teacher servers (0: half the rollout servers, at least one)."""
    rate: float = 31_250.0
    """Output tokens/s of one rollout server when full: 32 servers x 31,250 = 1M tokens/s."""
    request_rate: float = 4_000.0
    """Tokens/s of one request; slots = rate / request_rate requests run at once per server."""
    median_tokens: int = 1024
    p99_tokens: int = 8192
    top_k: int = 64
    prompt_tokens: int = 256
    teacher_rate: float = 400_000.0
    """Scored (prompt + response) tokens/s of one teacher request: a prefill."""
    teacher_latency: float = 0.02
    transfer_seconds: float = 0.2
    """A weight sync's broadcast (8B in bf16 over NCCL is ~16 GB: ~0.2-1 s)."""
    load_seconds: float = 0.1
    pool: int = 48
    """Distinct answer lengths built before the run (quantiles of the length distribution)."""
    seed: int = 0
    fake_procs: int = 2
    """Processes serving the fakes (each serves many ports)."""

    @property
    def teacher_count(self) -> int:
        return self.teachers or max(1, math.ceil(self.rollouts / 2))

    @property
    def slots(self) -> int:
        return max(1, round(self.rate / self.request_rate))

    def lengths(self) -> list[int]:
        """The answer lengths: `pool` quantiles of a log-normal with this median and p99."""
        from statistics import NormalDist

        sigma = math.log(self.p99_tokens / self.median_tokens) / NormalDist().inv_cdf(0.99)
        z = [NormalDist().inv_cdf((i + 0.5) / self.pool) for i in range(self.pool)]
        return [max(1, round(self.median_tokens * math.exp(sigma * x))) for x in z]

    @property
    def mean_tokens(self) -> float:
        ls = self.lengths()
        return sum(ls) / len(ls)

    @property
    def samples_per_second(self) -> float:
        """What the rollout fleet produces when full."""
        return self.rollouts * self.rate / self.mean_tokens


@dataclass
class JobShape:
    """The job the driver runs (fullyAsync, partialRollout inflight: the fakes freeze requests
    across a sync)."""

    step_seconds: float = 2.0
    """The trainer stand-in's step."""
    required: int = 0
    """Samples per step (0: 90 % of what the fleet makes in a step, so a driver that keeps up
    leaves the trainer no wait)."""
    max_required: int = 2048
    """With required 0, the most samples a step takes; the step is shortened to match."""
    n: int = 4
    staleness: float = 4.0
    oversample: float = 2.0
    seconds: float = 20.0
    """The measured window."""
    warmup: float = 6.0
    rss_limit_mb: float = 10000.0
    """A point whose driver grows past this ends early (reported)."""

    def plan(self, fleet: FleetShape) -> tuple[int, float]:
        """(samples per step, step seconds)."""
        if self.required:
            return self.required, self.step_seconds
        want = 0.9 * fleet.samples_per_second * self.step_seconds
        required = max(self.n, min(self.max_required, round(want / self.n) * self.n))
        step = self.step_seconds * required / want if want > 0 else self.step_seconds
        return required, step


# ---- answers built before the run -----------------------------------------------------------------


class Answers:
    """Every body a fake sends, made once with the product's response models."""

    RID = "@@request-id@@"

    def __init__(self, fleet: FleetShape):
        import numpy as np

        self.fleet = fleet
        self.lengths = fleet.lengths()
        rng = np.random.default_rng(fleet.seed)
        self._ids = [rng.integers(4, TEXT_VOCAB, n).tolist() for n in self.lengths]
        # Real log-probs: float32 values, printed as the servers print them (float64 reprs).
        self._lps = [(-rng.exponential(1.0, n)).astype(np.float32).astype(float).tolist() for n in self.lengths]
        self._rollout: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        self._score: dict[int, bytes] = {}
        self._rng = rng

    def rollout(self, i: int, version: int, request_id: str) -> bytes:
        """Answer `i` of the pool under `version`, for `request_id`."""
        from kubedistill.runtime.wire.protocol import GenerateResponse

        key = (i, version)
        parts = self._rollout.get(key)
        if parts is None:
            n = self.lengths[i]
            body = GenerateResponse(
                request_id=self.RID,
                token_ids=self._ids[i],
                logprobs=self._lps[i],
                versions=[version] * n,
                finish_reason="length",
            ).model_dump_json()
            head, tail = body.split(json.dumps(self.RID), 1)
            parts = self._rollout[key] = (head.encode(), tail.encode())
            for old in [k for k in self._rollout if k[1] < version - 4]:
                del self._rollout[old]
        return parts[0] + json.dumps(request_id).encode() + parts[1]

    def score(self, tokens: int, top_k: int) -> bytes:
        """A teacher's answer for a response of `tokens` tokens with rows of `top_k`."""
        import numpy as np

        from kubedistill.runtime.wire.protocol import ScoreResponse
        from kubedistill.runtime.wire.rows import Rows

        body = self._score.get(tokens * 1000 + top_k)
        if body is None:
            k = min(top_k, 256)
            rng = np.random.default_rng(tokens)
            lps = (-rng.exponential(1.0, tokens)).astype(np.float32).astype(float).tolist()
            ids = rng.integers(0, VOCAB, (tokens, k))
            tlps = np.sort(-rng.exponential(2.0, (tokens, k)).astype(np.float32), axis=1)[:, ::-1]
            body = (
                ScoreResponse(logprobs=lps, topk_ids=Rows.of(ids, "int32"), topk_logprobs=Rows.of(tlps, "float32"))
                .model_dump_json()
                .encode()
            )
            self._score[tokens * 1000 + top_k] = body
        return body

    def prebuild(self, role: str) -> None:
        if role == "teacher":
            for n in set(self.lengths):
                self.score(n, self.fleet.top_k)
        else:
            for i in range(len(self.lengths)):
                self.rollout(i, 0, "x")


# ---- the fake servers -----------------------------------------------------------------------------


class _Stream:
    """One batch's answers as they finish: what its handler writes next."""

    def __init__(self, count: int):
        self.left = count
        self.ready: list[tuple[int, int, bytes]] = []
        self.wake = asyncio.Event()
        self.closed = False

    def put(self, index: int, status: int, body: bytes) -> None:
        if self.closed:
            return
        self.ready.append((index, status, body))
        self.left -= 1
        self.wake.set()


@dataclass(order=True)
class _Job:
    due: float
    seq: int
    stream: _Stream = field(compare=False)
    index: int = field(compare=False)
    answer: int = field(compare=False)
    """The pool index (rollout) or the response length (teacher)."""
    request_id: str = field(compare=False, default="")
    version: int = field(compare=False, default=0)
    cancelled: bool = field(compare=False, default=False)


class FakeServer:
    """One fake rollout or teacher server (see the module docstring for the timing)."""

    def __init__(self, role: str, fleet: FleetShape, answers: Answers, index: int):
        self.role, self.fleet, self.answers, self.index = role, fleet, answers, index
        self.version = 0
        self.epoch: str | None = None
        self.heap: list[_Job] = []
        self.waiting: deque[_Job] = deque()
        self.active = 0
        self.slots = fleet.slots if role == "rollout" else 1 << 30
        self.paused_at: float | None = None
        self.paused_total = 0.0
        self.version_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self.rng = random.Random(fleet.seed * 1000 + index)
        self.seq = itertools.count()
        self.requests = 0
        self.tokens = 0

    def vclock(self) -> float:
        """Time as the requests see it: stopped while weights load."""
        now = time.monotonic()
        if self.paused_at is not None:
            now = self.paused_at
        return now - self.paused_total

    # rollout
    def submit_generate(self, stream: _Stream, index: int, req: Any) -> None:
        self.requests += 1
        budget = req.sampling.max_tokens - len(req.prefix_token_ids)
        lengths = self.answers.lengths
        pick = self.rng.randrange(len(lengths))
        if lengths[pick] > budget:  # the pool is built under maxTokens: this is a resumed request
            pick = min(range(len(lengths)), key=lambda i: lengths[i] if lengths[i] <= budget else 1 << 30)
        job = _Job(0.0, next(self.seq), stream, index, pick, req.request_id)
        if self.active < self.slots and self.paused_at is None:
            self._start(job)
        else:
            self.waiting.append(job)

    def _start(self, job: _Job) -> None:
        self.active += 1
        job.version = self.version
        job.due = self.vclock() + self.answers.lengths[job.answer] / self.fleet.request_rate
        heapq.heappush(self.heap, job)

    # teacher
    def submit_score(self, stream: _Stream, index: int, req: Any) -> None:
        self.requests += 1
        tokens = len(req.token_ids) - req.prompt_len
        due = self.vclock() + self.fleet.teacher_latency + len(req.token_ids) / self.fleet.teacher_rate
        heapq.heappush(self.heap, _Job(due, next(self.seq), stream, index, tokens, version=req.top_k))

    def tick(self) -> None:
        now = self.vclock()
        heap = self.heap
        while heap and heap[0].due <= now:
            job = heapq.heappop(heap)
            if self.role == "rollout":
                self.active -= 1
            if job.cancelled:
                continue
            if self.role == "rollout":
                body = self.answers.rollout(job.answer, job.version, job.request_id)
                self.tokens += self.answers.lengths[job.answer]
            else:
                body = self.answers.score(job.answer, job.version)
                self.tokens += job.answer
            job.stream.put(job.index, 200, body)
        while self.waiting and self.active < self.slots and self.paused_at is None:
            job = self.waiting.popleft()
            if not job.cancelled:
                self._start(job)

    def cancel(self, stream: _Stream) -> None:
        stream.closed = True
        for job in itertools.chain(self.heap, self.waiting):
            if job.stream is stream:
                job.cancelled = True

    # weight sync
    def begin(self, version: int) -> None:
        self.paused_at = time.monotonic()
        pause = self.fleet.transfer_seconds + self.fleet.load_seconds
        asyncio.get_running_loop().call_later(pause, self._loaded, version)

    def _loaded(self, version: int) -> None:
        assert self.paused_at is not None
        self.paused_total += time.monotonic() - self.paused_at
        self.paused_at = None
        self.version = max(self.version, version)
        for want, fut in self.version_waiters:
            if self.version >= want and not fut.done():
                fut.set_result(None)
        self.version_waiters = [(w, f) for w, f in self.version_waiters if not f.done()]
        self.tick()

    async def served(self, at_least: int | None) -> int:
        if at_least is not None and self.version < at_least:
            fut = asyncio.get_running_loop().create_future()
            self.version_waiters.append((at_least, fut))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, 30)
        return self.version


def app_for(server: FakeServer) -> Any:
    """The server's aiohttp app: the product's routes, request models and frames."""
    from aiohttp import web

    from kubedistill.runtime.wire.protocol import (
        GenerateRequest,
        HealthResponse,
        ScoreRequest,
        VersionResponse,
        WeightsBeginRequest,
        WeightsBeginResponse,
        WeightsGroupRequest,
        WeightsGroupResponse,
    )
    from kubedistill.runtime.wire.streams import FRAMES_MEDIA_TYPE, GenerateBatch, ScoreBatch, frame

    def model(m: Any, status: int = 200) -> web.Response:
        return web.Response(body=m.model_dump_json(exclude_none=True).encode(), status=status,
                            content_type="application/json")  # fmt: skip

    def error(message: str, status: int) -> web.Response:
        return web.Response(
            body=json.dumps({"error": message}).encode(), status=status, content_type="application/json"
        )

    async def stream(request: web.Request, requests: Sequence[Any], submit: Any) -> web.StreamResponse:
        s = _Stream(len(requests))
        for i, r in enumerate(requests):
            submit(s, i, r)
        resp = web.StreamResponse(headers={"Content-Type": FRAMES_MEDIA_TYPE})
        await resp.prepare(request)
        try:
            while s.left or s.ready:
                if not s.ready:
                    s.wake.clear()
                    await s.wake.wait()
                ready, s.ready = s.ready, []
                await resp.write(b"".join(frame(*r) for r in ready))
            await resp.write_eof()
        except ConnectionError:  # the driver went away (aiohttp's reset errors are ConnectionErrors)
            pass
        finally:
            server.cancel(s)
        return resp

    async def health(request: web.Request) -> web.Response:
        state = "ready" if server.epoch is not None or server.role == "teacher" else "none"
        return model(HealthResponse(role=server.role, engine="fake", version=server.version, weight_sync=state))

    async def generate_batch(request: web.Request) -> web.StreamResponse:
        batch = GenerateBatch.model_validate_json(await request.read())
        return await stream(request, batch.requests, server.submit_generate)

    async def single(request: web.Request, model: Any, submit: Any) -> web.Response:
        """One request of its own endpoint: a batch of one, answered as a plain body."""
        s = _Stream(1)
        submit(s, 0, model.model_validate_json(await request.read()))
        await s.wake.wait()
        return web.Response(body=s.ready[0][2], content_type="application/json")

    async def generate(request: web.Request) -> web.Response:
        return await single(request, GenerateRequest, server.submit_generate)

    async def score_batch(request: web.Request) -> web.StreamResponse:
        batch = ScoreBatch.model_validate_json(await request.read())
        return await stream(request, batch.requests, server.submit_score)

    async def score(request: web.Request) -> web.Response:
        return await single(request, ScoreRequest, server.submit_score)

    def group_doc() -> Any:
        return WeightsGroupResponse(epoch=server.epoch, state="ready" if server.epoch else "none", dtype="bfloat16")

    async def weights_group(request: web.Request) -> web.Response:
        req = WeightsGroupRequest.model_validate_json(await request.read())
        server.epoch = req.epoch
        return model(group_doc(), status=202)

    async def weights_group_status(request: web.Request) -> web.Response:
        return model(group_doc())

    async def weights_begin(request: web.Request) -> web.Response:
        req = WeightsBeginRequest.model_validate_json(await request.read())
        if req.group_epoch is not None and req.group_epoch != server.epoch:
            return error(f"this server is in weight-sync group epoch {server.epoch}, not {req.group_epoch}", 503)
        server.begin(req.version)
        return model(WeightsBeginResponse(version=req.version))

    async def version(request: web.Request) -> web.Response:
        at_least = request.query.get("at_least")
        return model(VersionResponse(version=await server.served(int(at_least) if at_least else None)))

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/health", health)
    if server.role == "rollout":
        app.router.add_post("/generate/batch", generate_batch)
        app.router.add_post("/generate", generate)
        app.router.add_get("/version", version)
        app.router.add_post("/weights/group", weights_group)
        app.router.add_get("/weights/group", weights_group_status)
        app.router.add_post("/weights/begin", weights_begin)
    else:
        app.router.add_post("/score/batch", score_batch)
        app.router.add_post("/score", score)
    return app


async def serve_fakes(fleet: FleetShape, roles: list[tuple[str, int]], tick: float = 0.004) -> None:
    """Serve `roles` ((role, index) each) on ephemeral ports; print one JSON line of their URLs,
    then tick until stdin closes."""
    from aiohttp import web

    answers = Answers(fleet)
    for role in {r for r, _ in roles}:
        answers.prebuild(role)
    servers = [FakeServer(role, fleet, answers, i) for role, i in roles]
    urls = []
    runners = []
    for s in servers:
        runner = web.AppRunner(app_for(s), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        urls.append(f"http://127.0.0.1:{port}")
        runners.append(runner)
    print(json.dumps({"urls": urls}), flush=True)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), lambda: done.set() if not sys.stdin.buffer.read1(1 << 16) else None)
    while not done.is_set():
        for s in servers:
            if s.heap or s.waiting:
                s.tick()
        await asyncio.sleep(tick)
    stats = {"requests": sum(s.requests for s in servers), "tokens": sum(s.tokens for s in servers)}
    print(json.dumps(stats), flush=True)
    for r in runners:
        await r.cleanup()


@contextlib.contextmanager
def fakes(fleet: FleetShape) -> Iterator[tuple[list[str], list[str], list[int]]]:
    """Start the fakes in `fleet.fake_procs` processes: (rollout URLs, teacher URLs, pids)."""
    roles = [("rollout", i) for i in range(fleet.rollouts)] + [("teacher", i) for i in range(fleet.teacher_count)]
    procs = max(1, min(fleet.fake_procs, len(roles)))
    shares = [roles[p::procs] for p in range(procs)]
    children = []
    try:
        for share in shares:
            cmd = [sys.executable, __file__, "--serve", json.dumps({"fleet": asdict(fleet), "roles": share})]
            children.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        by_role: dict[tuple[str, int], str] = {}
        for share, child in zip(shares, children):
            assert child.stdout is not None
            line = child.stdout.readline()
            if not line:
                raise RuntimeError("a fake server process ended before serving")
            by_role.update(zip(share, json.loads(line)["urls"]))
        rollouts = [by_role[("rollout", i)] for i in range(fleet.rollouts)]
        teachers = [by_role[("teacher", i)] for i in range(fleet.teacher_count)]
        yield rollouts, teachers, [c.pid for c in children]
    finally:
        for child in children:
            if child.stdin is not None:
                with contextlib.suppress(OSError):
                    child.stdin.close()
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


# ---- the trainer side -----------------------------------------------------------------------------


def qwen3_8b_metas() -> list[Any]:
    """The tensors of a Qwen3-8B, as a weight sync's manifest lists them (bf16)."""
    from kubedistill.runtime.wire.protocol import TensorMeta

    h, inter, layers, heads, kv, hd = 4096, 12288, 36, 32, 8, 128
    metas = [TensorMeta(name="model.embed_tokens.weight", dtype="bfloat16", shape=[VOCAB, h])]
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (
            ("self_attn.q_proj.weight", [heads * hd, h]),
            ("self_attn.k_proj.weight", [kv * hd, h]),
            ("self_attn.v_proj.weight", [kv * hd, h]),
            ("self_attn.o_proj.weight", [h, heads * hd]),
            ("self_attn.q_norm.weight", [hd]),
            ("self_attn.k_norm.weight", [hd]),
            ("mlp.gate_proj.weight", [inter, h]),
            ("mlp.up_proj.weight", [inter, h]),
            ("mlp.down_proj.weight", [h, inter]),
            ("input_layernorm.weight", [h]),
            ("post_attention_layernorm.weight", [h]),
        ):
            metas.append(TensorMeta(name=p + name, dtype="bfloat16", shape=shape))
    metas.append(TensorMeta(name="model.norm.weight", dtype="bfloat16", shape=[h]))
    metas.append(TensorMeta(name="lm_head.weight", dtype="bfloat16", shape=[VOCAB, h]))
    return metas


@dataclass(frozen=True)
class StandInStats:
    loss_total: float = 0.0
    loss_distill: float = 0.0
    loss_pg: float = 0.0
    grad_norm: float = 0.0
    lr: float = 1e-6
    kl: float | None = None
    seconds: float = 0.0
    compute_seconds: float = 0.0
    off_policy: dict[str, float] = field(default_factory=dict)


class StandInTrainer:
    """TrainerLike and the sender's WeightSource: a step lays each mini-batch out as rank 0
    does, then sleeps the rest of `step_seconds`."""

    def __init__(self, step_seconds: float):
        self.step_seconds = step_seconds
        self.steps: list[tuple[float, float, int, int]] = []
        """(start, end, samples, response tokens) of every step."""
        self.layout_seconds = 0.0

    def train(self, batches: Sequence[Any]) -> list[StandInStats]:
        t0 = time.monotonic()
        samples = tokens = 0
        for b in batches:
            b.to_tensors()
            samples += len(b)
            tokens += sum(len(p.rollout_logprobs) for p in b.parts)
        laid = time.monotonic()
        self.layout_seconds += laid - t0
        time.sleep(max(0.0, self.step_seconds - (laid - t0)))
        end = time.monotonic()
        self.steps.append((t0, end, samples, tokens))
        return [StandInStats(seconds=end - t0, compute_seconds=(end - t0) / len(batches)) for _ in batches]

    def weight_metas(self) -> list[Any]:
        return qwen3_8b_metas()

    def named_full_weights(self) -> Iterator[tuple[str, Any]]:
        raise RuntimeError("the simulated broadcast draws no tensors")

    def lora_adapter(self) -> None:
        return None

    def frozen_prefixes(self) -> list[str]:
        return []

    def save_checkpoint(self, step: int, weight_version: int, driver_state: bytes) -> Path:
        return Path(f"step-{step}")

    def export_hf(self, out_dir: str | Path) -> Path | None:
        return None


@contextlib.contextmanager
def simulated_broadcast(fleet: FleetShape) -> Iterator[None]:
    """The weight sender with its transport replaced while inside: the group is a stand-in whose
    broadcast and closing all-reduce take the fleet's transfer and load times; every HTTP message
    is real."""
    import torch

    from kubedistill.runtime.weight_sync import sender as module
    from kubedistill.runtime.weight_sync.transfer import TransferStats

    class SimGroup:
        device = torch.device("cpu")

        def __init__(self, addr: Any, store: Any = None):
            self.addr = addr

        def all_reduce_sum(self, value: int) -> int:
            time.sleep(fleet.load_seconds)
            return value

        def close(self) -> None:
            pass

    def send(group: Any, manifest: Any, tensors: Any) -> TransferStats:
        time.sleep(fleet.transfer_seconds)
        return TransferStats(bytes=manifest.total_bytes, seconds=fleet.transfer_seconds)

    saved = module.open_store, module.WeightSyncGroup, module.send
    module.open_store = lambda addr: None  # type: ignore[assignment]
    module.WeightSyncGroup = SimGroup  # type: ignore[assignment,misc]
    module.send = send  # type: ignore[assignment]
    try:
        yield
    finally:
        module.open_store, module.WeightSyncGroup, module.send = saved  # type: ignore[assignment,misc]


@contextlib.contextmanager
def rows_copied(on: bool) -> Iterator[None]:
    """With `on`, the driver as it held a /score answer's top-k rows before they came as arrays
    (runtime/wire/rows.py): each row a list of Python numbers, copied element by element as
    Sample.set_scores once did. The JSON parse of the lists is not replayed (the protocol has
    one form), so this before understates the old cost by that parse (~10 ms a top-64 answer)."""
    from kubedistill.api.losses import Signal
    from kubedistill.runtime.driver.samples import Sample

    kept = Sample.set_scores

    def set_scores(self: Sample, teacher: str, out: Any) -> None:
        kept(self, teacher, out)
        for name, kind in ((Signal.teacher_topk_ids, int), (Signal.teacher_topk_logprobs, float)):
            rows = self.signals.get(name.value)
            if rows is not None:
                self.signals[name.value] = [list(map(kind, row)) for row in rows]

    if on:
        Sample.set_scores = set_scores  # type: ignore[method-assign]
    try:
        yield
    finally:
        Sample.set_scores = kept  # type: ignore[method-assign]


def tokenizer(cache: Path) -> Any:
    """A byte-level BPE tokenizer (512 ids) trained here once, as the student's."""
    from transformers import PreTrainedTokenizerFast

    from kubedistill.demo.tiny import bpe_tokenizer, tiny_corpus

    out = cache / "tokenizer"
    if not (out / "tokenizer.json").exists():
        bpe_tokenizer(tiny_corpus(400), vocab_size=TEXT_VOCAB, out_dir=out)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


def write_prompts(path: Path, count: int, words: int, seed: int = 0) -> Path:
    from kubedistill.demo.tiny import tiny_corpus

    vocab = " ".join(tiny_corpus(50, seed)).split()
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(count):
            text = " ".join(rng.choices(vocab, k=words))
            row = {
                "data_source": "gsm8k",
                "prompt": [{"role": "user", "content": text}],
                "reward_model": {"ground_truth": str(i % 97)},
            }
            f.write(json.dumps(row) + "\n")
    return path


def job_spec(fleet: FleetShape, job: JobShape, work: Path, required: int) -> Any:
    from kubedistill.api.spec import DistillationJobSpec

    distillation: dict[str, Any] = (
        {"lossMode": "forwardKLTopK", "topK": fleet.top_k} if fleet.top_k else {"lossMode": "k3"}
    )
    return DistillationJobSpec.model_validate(
        {
            "mode": "fullyAsync",
            "device": "cpu",
            "student": {"model": str(work / "student")},
            "teachers": [{"name": "teacher", "model": str(work / "teacher"), "replicas": fleet.teacher_count}],
            "rollout": {
                "replicas": fleet.rollouts,
                "sampling": {"samplesPerPrompt": job.n, "maxTokens": max(fleet.lengths())},
            },
            "trainer": {"miniBatchSize": required, "totalSteps": 1_000_000},
            "algorithm": {"distillation": distillation},
            "async": {
                "stalenessThreshold": job.staleness,
                "triggerParameterSyncStep": 1,
                "partialRollout": True,
                "partialRolloutStrategy": "inflight",
                "oversample": job.oversample,
            },
            "data": {
                "train": [str(write_prompts(work / "train.jsonl", 2048, fleet.prompt_tokens))],
                "maxPromptLength": 4 * fleet.prompt_tokens + 16,
            },  # fmt: skip
            "checkpoint": {"path": str(work / "ckpt"), "everySteps": 1_000_000, "exportHf": False},
        }
    )


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def run_point(
    fleet: FleetShape,
    job: JobShape,
    trace: bool = False,
    cache: Path | None = None,
    copy_rows: bool = False,
    profile: str | None = None,
    python_gc: bool = False,
) -> dict[str, Any]:
    """One driver against one fleet for `job.warmup` + `job.seconds`; the window's numbers.
    `cache`: where the tokenizer is kept between runs; `copy_rows`: the driver before
    (rows_copied); `profile`: write the event loop's cProfile over the window there;
    `python_gc`: leave Python's collector as it is (the driver before settle_gc)."""
    import cProfile

    profiler = cProfile.Profile(time.thread_time) if profile else None  # the loop thread's CPU, not the wall
    from kubedistill.api.roleconfig import Endpoints
    from kubedistill.runtime.driver.history import HistoryWriter
    from kubedistill.runtime.driver.loop import Driver
    from kubedistill.runtime.entrypoints.trainer import settle_gc
    from kubedistill.runtime.weight_sync.sender import WeightSender

    cache = cache or REPO / ".kubedistill" / "bench" / "scale"
    cache.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(cache)
    required, step_seconds = job.plan(fleet)
    work = Path(tempfile.mkdtemp(prefix="kd-scale-"))
    cleanup = contextlib.ExitStack()
    cleanup.callback(shutil.rmtree, work, True)
    spec = job_spec(fleet, job, work, required)
    loop = asyncio.get_running_loop()
    thresholds = gc.get_threshold()
    with (
        simulated_broadcast(fleet),
        rows_copied(copy_rows),
        fakes(fleet) as (rollouts, teachers, pids),
        contextlib.ExitStack() as restore,
    ):
        restore.enter_context(cleanup)
        restore.callback(gc.set_threshold, *thresholds)
        restore.callback(gc.unfreeze)
        endpoints = Endpoints(trainer="http://127.0.0.1:1", master_addr="127.0.0.1", rollout=rollouts,
                              teachers={"teacher": teachers})  # fmt: skip
        sender = await loop.run_in_executor(None, lambda: WeightSender(spec, endpoints))
        trainer = StandInTrainer(step_seconds)
        history = HistoryWriter()
        driver = Driver(spec, trainer=trainer, sender=sender, rollout_urls=rollouts,
                        teacher_urls={"teacher": teachers}, tokenizer=tok, history=history)  # fmt: skip
        ingested = {"samples": 0, "tokens": 0}
        put = driver.buffer.put

        async def counted_put(group: Any) -> bool:
            ingested["samples"] += len(group.samples)
            ingested["tokens"] += sum(len(s.response_ids) for s in group.samples)
            return await put(group)

        driver.buffer.put = counted_put  # type: ignore[method-assign]
        if not python_gc:
            settle_gc()  # as rank 0 does before driver.run()
        rss0 = _rss_mb()
        peak = [rss0]
        task = asyncio.create_task(driver.run())
        marks: dict[str, dict[str, float]] = {}

        def mark(name: str) -> None:
            counters = driver.buffer.counters
            marks[name] = {
                "t": time.monotonic(),
                "cpu": sum(os.times()[:2]),
                "sys_cpu": os.times()[1],
                "loop_cpu": time.thread_time(),
                "fake_cpu": sum(_proc_cpu(p) for p in pids),
                "samples": ingested["samples"],
                "tokens": ingested["tokens"],
                "dropped": counters.get("dropped_stale", 0),
            }

        ended = ""
        t_start = time.monotonic()
        traced = [0.0]
        for phase, length in (("warm", job.warmup), ("end", job.seconds)):
            deadline = time.monotonic() + length
            while time.monotonic() < deadline and not task.done():
                await asyncio.sleep(0.1)
                peak[0] = max(peak[0], _rss_mb())
                if trace and time.monotonic() - traced[0] >= 1.0:
                    traced[0] = time.monotonic()
                    buf = driver.buffer
                    gen = driver.pool.outstanding()
                    sco = sum(p.outstanding() for p in driver.router.pools.values())
                    print(
                        f"t={time.monotonic() - t_start:6.1f} bound={buf.stale_count} in_flight={buf.in_flight} "
                        f"generating={buf.generating} buffered={buf.buffered} steps={len(trainer.steps)} "
                        f"gen_req={gen} score_req={sco} ingested={ingested['samples']} rss={peak[0]:.0f} "
                        f"cpu={sum(os.times()[:2]):.1f}",
                        file=sys.stderr,
                        flush=True,
                    )
                if peak[0] > job.rss_limit_mb:
                    ended = f"RSS over {job.rss_limit_mb:.0f} MB"
                    break
            mark(phase)
            if profiler is not None:
                profiler.enable() if phase == "warm" else profiler.disable()
            if ended or task.done():
                break
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(profile))
        if "end" not in marks and not ended:
            raise RuntimeError(f"the driver ended early: {task.exception() if not task.cancelled() else 'cancelled'}")
        sender.close()
    a, b = marks["warm"], marks.get("end", marks["warm"])
    window = b["t"] - a["t"]
    lines = [ln for ln in history.lines if a["t"] - t_start <= ln["time"] <= b["t"] - t_start]
    steps = [s for s in trainer.steps if s[0] >= a["t"] and s[1] <= b["t"]]
    wall = sum(ln["phases"].get("wait", 0.0) for ln in lines)
    step_wall = sum(sum(ln["phases"].values()) for ln in lines)
    samples = b["samples"] - a["samples"]
    tokens = b["tokens"] - a["tokens"]
    cpu = b["cpu"] - a["cpu"]
    trained_samples = sum(s[2] for s in steps)
    trained_tokens = sum(s[3] for s in steps)
    # With few or no steps in the window, the trainer waited for (nearly) all of it.
    wait_fraction = wall / step_wall if len(lines) >= 2 else 1.0 - len(lines) * step_seconds / max(window, 1e-9)
    return {
        "fleet": asdict(fleet),
        "job": asdict(job),
        "required": required,
        "step_seconds": step_seconds,
        "fleet_samples_per_s": fleet.samples_per_second,
        "fleet_tokens_per_s": fleet.rollouts * fleet.rate,
        "mean_tokens": fleet.mean_tokens,
        "window_s": window,
        "ingested_samples_per_s": samples / window if window else 0.0,
        "ingested_tokens_per_s": tokens / window if window else 0.0,
        "trained_samples_per_s": trained_samples / window if window else 0.0,
        "trained_tokens_per_s": trained_tokens / window if window else 0.0,
        "steps": len(lines),
        "wait_fraction": max(0.0, min(1.0, wait_fraction)),
        "cpu_s": cpu,
        "cpu_per_s": cpu / window if window else 0.0,
        "loop_cpu_per_s": (b["loop_cpu"] - a["loop_cpu"]) / window if window else 0.0,
        "sys_cpu_share": (b["sys_cpu"] - a["sys_cpu"]) / cpu if cpu else 0.0,
        "cpu_ms_per_sample": 1e3 * cpu / samples if samples else None,
        "cpu_ms_per_1k_tokens": 1e6 * cpu / tokens if tokens else None,
        "fake_cpu_per_s": (b["fake_cpu"] - a["fake_cpu"]) / window if window else 0.0,
        "dropped_stale": b["dropped"] - a["dropped"],
        "rss0_mb": rss0,
        "peak_rss_mb": max(peak[0], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "ended": ended,
        "synced_version": driver.version,
        "copy_rows": copy_rows,
        "python_gc": python_gc,
        "load1": os.getloadavg()[0],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help="print the buffer's state every second (stderr)")
    ap.add_argument("--copy-rows", action="store_true", help="the driver before: top-k rows as per-number lists")
    ap.add_argument("--profile", help="write the event loop's cProfile over the window to this file")
    ap.add_argument("--python-gc", action="store_true", help="the driver before: Python's own collector settings")
    for f in FleetShape.__dataclass_fields__.values():
        ap.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, dest="fleet_" + f.name
        )  # noqa: E501
    for f in JobShape.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, dest="job_" + f.name)
    args = ap.parse_args()
    if args.serve:
        doc = json.loads(args.serve)
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
        asyncio.run(serve_fakes(FleetShape(**doc["fleet"]), [tuple(r) for r in doc["roles"]]))
        return 0
    fleet = FleetShape(**{k[6:]: v for k, v in vars(args).items() if k.startswith("fleet_")})
    job = JobShape(**{k[4:]: v for k, v in vars(args).items() if k.startswith("job_")})
    print(
        json.dumps(
            asyncio.run(
                run_point(
                    fleet, job, args.trace, copy_rows=args.copy_rows, profile=args.profile, python_gc=args.python_gc
                )
            )
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
