"""In-process fakes of what the driver (runtime/driver/loop.py) talks to, so its real loop runs in
milliseconds: rollout and teacher servers that answer as the wire protocol says
(runtime/wire/protocol.py), a weight sender that loads each version into the fake rollout
servers, and a trainer that records the batches it is given.

The fakes keep the protocol's promises that the driver relies on: every generated token carries
the weight version that sampled it and that version's log-prob; a weight load pauses generation
the way the spec's pause mode says (finish, abort with the tokens so far, or freeze); a resumed
request continues after its prefix; a server that is down refuses connections, and one that dies
drops the requests it was serving. Tokens depend only on the prompt and their position, so a
response resumed across syncs holds exactly the tokens an uninterrupted one would.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp

from batch_lists import to_lists
from e2e_jobs import write_prompts
from kubedistill.api.spec import DistillationJobSpec, PartialRolloutStrategy
from kubedistill.runtime.driver.clients import ServerError
from kubedistill.runtime.driver.loop import Driver
from kubedistill.runtime.weight_sync.times import SyncTimes
from kubedistill.runtime.wire.batch import BatchParts, TrainBatch
from kubedistill.runtime.wire.protocol import (
    AbortResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    ScoreRequest,
    ScoreResponse,
    TensorMeta,
)
from kubedistill.runtime.wire.rows import Rows

ALPHABET = "0123456789+="
VOCAB = len(ALPHABET)
PauseMode = Literal["wait", "keep", "abort"]


class CharTokenizer:
    """One token per character of ALPHABET (the data's prompts are digit arithmetic)."""

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool, tokenize: bool
    ) -> str:
        return "".join(str(m["content"]) for m in conversation)

    def __call__(self, text: str, *, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": [ALPHABET.index(c) for c in text if c in ALPHABET]}

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return "".join(ALPHABET[i] for i in token_ids)


def token_at(prompt_ids: Sequence[int], position: int) -> int:
    """The response token at `position`: the same whichever request (first or resumed) samples it."""
    return (sum(prompt_ids) + 7 * position) % VOCAB


def logprob_of(version: int) -> float:
    """Each weight version has its own log-prob, so a test can tell which version sampled a token."""
    return -1.0 - 0.125 * version


def versions_of(logprobs: Sequence[float]) -> list[int]:
    """The weight version that sampled each token, read back from its log-prob (logprob_of)."""
    return [round((-1.0 - lp) / 0.125) for lp in logprobs]


def pause_for(spec: DistillationJobSpec) -> PauseMode:
    """What a weight load does to requests in flight: runtime/servers/rollout.py's pause_mode
    (not imported: that module pulls in torch)."""
    a = spec.async_
    if a is None or not a.partial_rollout:
        return "wait"
    return "abort" if a.partial_rollout_strategy is PartialRolloutStrategy.resume else "keep"


def refused(url: str) -> aiohttp.ClientConnectionError:
    return aiohttp.ClientConnectionError(f"cannot connect to {url}: connection refused")


class _FakeServer:
    """Up or down. Down: every call is refused (after `refuse_seconds`, as a connect attempt
    takes); dying drops the connections of the requests in flight."""

    role = "server"

    def __init__(self, url: str, *, alive: bool, refuse_seconds: float):
        self.base_url = url
        self.alive = alive
        self.refuse_seconds = refuse_seconds
        self.weight_version = 0
        self.refused = 0
        """Requests (not health checks) refused while down."""
        self.dropped = 0
        """Requests whose connection dropped because the server died while serving them."""
        self.health_checks = 0
        self.die_at_request: int | None = None
        """Die when the request with this 1-based number arrives (it is refused)."""
        self._calls = 0
        self._incarnation = 0
        """Bumped by every death: a request that began in an earlier one lost its connection."""

    def kill(self) -> None:
        self.alive = False
        self._incarnation += 1

    def revive(self, *, fresh: bool = False) -> None:
        """Up again: the same process reachable again, or (fresh) a replacement pod, which starts
        with the initial weights (version 0) outside any weight-sync group."""
        self.alive = True
        if fresh:
            self.weight_version = 0

    async def health(self) -> HealthResponse:
        self.health_checks += 1
        await self._connect()
        return HealthResponse(role=self.role, engine="fake", version=self.weight_version, weight_sync="ready")

    async def _request(self) -> int:
        """Connect for one request; returns the incarnation serving it."""
        self._calls += 1
        if self._calls == self.die_at_request:
            self.kill()
        try:
            await self._connect()
        except aiohttp.ClientConnectionError:
            self.refused += 1
            raise
        return self._incarnation

    async def _connect(self) -> None:
        if not self.alive:
            await asyncio.sleep(self.refuse_seconds)
            raise refused(self.base_url)
        await asyncio.sleep(0)  # a round trip: the caller's loop runs other tasks meanwhile

    def _check_connected(self, incarnation: int) -> None:
        if incarnation != self._incarnation:
            self.dropped += 1
            raise aiohttp.ServerDisconnectedError(f"{self.base_url} went away mid-request")

    @property
    def failed(self) -> int:
        """Requests that failed in transport: refused or dropped."""
        return self.refused + self.dropped


@dataclass
class _Generation:
    request: GenerateRequest
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    topk_ids: list[list[int]] | None = None
    aborted: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def response(self, finish_reason: Literal["stop", "length", "abort"]) -> GenerateResponse:
        return GenerateResponse(
            request_id=self.request.request_id,
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason="abort" if self.aborted else finish_reason,
            topk_ids=Rows.of(self.topk_ids, "int32") if self.topk_ids is not None else None,
        )


class FakeRolloutServer(_FakeServer):
    """/generate one token per `token_seconds`, /abort, /version, /health, and the weight loads a
    sync makes (`load`). Records every request it took and every answer it gave."""

    role = "rollout"

    def __init__(self, url: str, *, alive: bool = True, token_seconds: float = 0.002, refuse_seconds: float = 0.001):
        super().__init__(url, alive=alive, refuse_seconds=refuse_seconds)
        self.token_seconds = token_seconds
        self.requests: list[GenerateRequest] = []
        """Every /generate the server took (not the refused ones), in arrival order."""
        self.answers: list[GenerateResponse] = []
        """Every /generate answered, in order."""
        self.loads: list[int] = []
        """Weight versions loaded, in order."""
        self.die_after_load: int | None = None
        """Die right after loading this weight version."""
        self._running: dict[str, _Generation] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = asyncio.Event()
        """Cleared while weights load: new requests wait for the load."""
        self._accepting.set()
        self._unfrozen = asyncio.Event()
        """Cleared while weights load under pause mode keep: running requests wait before their next token."""
        self._unfrozen.set()
        self.answering = asyncio.Event()
        """Cleared: requests are taken but wait, outside the engine, until it is set again."""
        self.answering.set()

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        incarnation = await self._request()
        if req.request_id in self._running:
            raise ServerError(self.base_url + "/generate", 409, f"request_id {req.request_id!r} is already in flight")
        first = len(req.prefix_token_ids)
        if req.sampling.max_tokens - first < 1:
            raise ServerError(self.base_url + "/generate", 400, "prefix_token_ids leaves no token budget")
        self.requests.append(req)
        await self.answering.wait()
        await self._accepting.wait()
        self._check_connected(incarnation)
        g = _Generation(req, topk_ids=[] if req.sampling.top_k_ids else None)
        self._running[req.request_id] = g
        self._idle.clear()
        try:
            for position in range(first, req.sampling.max_tokens):
                await asyncio.sleep(self.token_seconds)
                await self._unfrozen.wait()
                self._check_connected(incarnation)
                if g.aborted:
                    break
                token = token_at(req.prompt_token_ids, position)
                g.token_ids.append(token)
                g.logprobs.append(logprob_of(self.weight_version))
                g.versions.append(self.weight_version)
                if g.topk_ids is not None:
                    k = min(req.sampling.top_k_ids, VOCAB)
                    g.topk_ids.append([(token + j) % VOCAB for j in range(k)])
        finally:
            del self._running[req.request_id]
            g.done.set()
            if not self._running:
                self._idle.set()
        out = g.response("length")
        self.answers.append(out)
        return out

    async def abort(self, request_ids: Sequence[str] | None = None) -> AbortResponse:
        await self._request()
        ids = list(self._running) if request_ids is None else [r for r in request_ids if r in self._running]
        running = [self._running[r] for r in ids]
        for g in running:
            g.aborted = True
        await asyncio.gather(*(g.done.wait() for g in running))
        return AbortResponse(aborted=ids, outputs={g.request.request_id: g.response("abort") for g in running})

    async def version(self) -> int:
        await self._request()
        return self.weight_version

    async def load(self, version: int, pause: PauseMode) -> None:
        """Receive and load weight `version` as the engine does at a sync: new requests wait;
        running ones finish first (wait), end now with their tokens so far (abort), or are frozen
        and go on under the new weights (keep)."""
        if not self.alive:
            raise refused(self.base_url)
        self._accepting.clear()
        try:
            if pause == "abort":
                for g in self._running.values():
                    g.aborted = True
            if pause == "keep":
                self._unfrozen.clear()
            else:
                await self._idle.wait()
            self.weight_version = version
            self.loads.append(version)
        finally:
            self._unfrozen.set()
            self._accepting.set()
        if self.die_after_load == version:
            self.kill()

    def generated_versions(self) -> list[int]:
        """The weight version of every token this server generated."""
        return [v for out in self.answers for v in out.versions]


class FakeTeacherServer(_FakeServer):
    """/score and /health: a log-prob per response token and top-k rows, after `score_seconds`."""

    role = "teacher"

    def __init__(self, url: str, *, alive: bool = True, score_seconds: float = 0.001, refuse_seconds: float = 0.001):
        super().__init__(url, alive=alive, refuse_seconds=refuse_seconds)
        self.score_seconds = score_seconds
        self.scored: list[ScoreRequest] = []
        """Every /score answered."""

    async def score(self, req: ScoreRequest) -> ScoreResponse:
        incarnation = await self._request()
        await asyncio.sleep(self.score_seconds)
        self._check_connected(incarnation)
        response = req.token_ids[req.prompt_len :]
        k = min(req.top_k, VOCAB)
        self.scored.append(req)
        return ScoreResponse(
            logprobs=[-0.5] * len(response),
            topk_ids=Rows.of([[(t + j) % VOCAB for j in range(k)] for t in response], "int32"),
            topk_logprobs=Rows.of([[-0.5 - 0.25 * j for j in range(k)] for _ in response], "float32"),
            gather_logprobs=(
                Rows.of([[-0.75] * len(row) for row in req.gather_ids], "float32")
                if req.gather_ids is not None
                else None
            ),
        )


class FakeCluster:
    """The servers of one job, as the driver's ServerClients: the client of a URL is its server.
    A rollout URL no server listens on yet gets one that is down (a pod not started)."""

    def __init__(self, rollouts: Sequence[FakeRolloutServer], teachers: Mapping[str, Sequence[FakeTeacherServer]]):
        self.rollouts = {s.base_url: s for s in rollouts}
        self.teachers = {name: list(servers) for name, servers in teachers.items()}
        self._teacher_by_url = {s.base_url: s for servers in teachers.values() for s in servers}

    def rollout(self, url: str) -> FakeRolloutServer:
        if url not in self.rollouts:
            self.rollouts[url] = FakeRolloutServer(url, alive=False)
        return self.rollouts[url]

    def teacher(self, url: str) -> FakeTeacherServer:
        return self._teacher_by_url[url]

    @property
    def teacher_urls(self) -> dict[str, list[str]]:
        return {name: [s.base_url for s in servers] for name, servers in self.teachers.items()}


class FakeSender:
    """The weight sender as the driver sees it (SenderLike): sync(version) loads `version` into
    every member, on the event loop the fake servers live on (the driver calls it from its
    trainer thread). Like WeightSender, a member that cannot be reached fails the sync (the real
    one first waits weightSync.timeoutSeconds for it to come back)."""

    def __init__(self, cluster: FakeCluster, members: Sequence[str], pause: PauseMode, loop: asyncio.AbstractEventLoop):
        self.cluster = cluster
        self.members = list(members)
        self.pause = pause
        self.loop = loop
        self.syncs: list[tuple[int, list[str]]] = []
        """(version, members) of every sync that succeeded."""
        self.segment_seconds = SyncTimes()
        """How long each segment of a sync takes (slept), beside the fake servers' own load."""
        self.times: list[SyncTimes] = []
        """The segments of every sync that succeeded, as measured (what the driver is told)."""

    def sync(self, version: int, weights: Any) -> FakeSyncOutcome:
        marks = [time.perf_counter()]
        time.sleep(self.segment_seconds.pause)
        marks.append(time.perf_counter())
        tensors = list(weights.named_full_weights())  # the sender draws every tensor
        assert [n for n, _ in tensors] == [m.name for m in weights.weight_metas()]
        time.sleep(self.segment_seconds.transfer)
        marks.append(time.perf_counter())
        servers = [self.cluster.rollouts[u] for u in self.members]
        try:
            asyncio.run_coroutine_threadsafe(_load_all(servers, version, self.pause), self.loop).result(timeout=30)
        except aiohttp.ClientConnectionError as e:
            raise RuntimeError(f"weight sync of version {version}: {e}") from e
        time.sleep(self.segment_seconds.load)
        marks.append(time.perf_counter())
        time.sleep(self.segment_seconds.resume)
        marks.append(time.perf_counter())
        self.syncs.append((version, list(self.members)))
        self.times.append(SyncTimes(*(b - a for a, b in zip(marks, marks[1:]))))
        return FakeSyncOutcome(self.times[-1])

    def set_members(self, urls: list[str]) -> None:
        if len(set(urls)) != len(urls) or not urls:
            raise ValueError(f"weight-sync members must be distinct and at least one: {urls}")
        self.members = list(urls)


@dataclass(frozen=True)
class FakeSyncOutcome:
    times: SyncTimes
    bytes: int = 0
    plan: str = "full"
    density: float = 1.0
    served: Mapping[str, int] = field(default_factory=dict)  # unknown: the driver asks the servers


async def _load_all(servers: Sequence[FakeRolloutServer], version: int, pause: PauseMode) -> None:
    await asyncio.gather(*(s.load(version, pause) for s in servers))


@dataclass(frozen=True)
class FakeStepStats:
    loss_total: float = 0.0
    loss_distill: float = 0.0
    loss_pg: float = 0.0
    grad_norm: float = 0.0
    lr: float = 1e-3
    kl: float | None = None
    seconds: float = 0.0
    compute_seconds: float = 0.0
    off_policy: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    step: int
    weight_version: int
    driver_state: bytes


class FakeTrainer:
    """TrainerLike: records every step's batches and every checkpoint; a step takes
    `step_seconds` (the trainer's compute, during which generation goes on). Batches are kept in
    their list form, for tests to read."""

    def __init__(self, step_seconds: float = 0.0):
        self.step_seconds = step_seconds
        self.steps: list[list[TrainBatch]] = []
        self.checkpoints: list[Checkpoint] = []
        self.exported: list[Path] = []
        self._holds: dict[int, threading.Event] = {}

    def hold(self, step: int) -> threading.Event:
        """Train step `step` (1-based) waits until the returned event is set."""
        return self._holds.setdefault(step, threading.Event())

    def release_all(self) -> None:
        for gate in self._holds.values():
            gate.set()

    def train(self, batches: Sequence[BatchParts]) -> list[FakeStepStats]:
        gate = self._holds.get(len(self.steps) + 1)
        if gate is not None and not gate.wait(timeout=30):
            raise TimeoutError(f"train step {len(self.steps) + 1} was held and never released")
        t0 = time.perf_counter()
        time.sleep(self.step_seconds)
        compute = time.perf_counter() - t0
        self.steps.append([to_lists(b) for b in batches])
        return [FakeStepStats(seconds=compute, compute_seconds=compute / len(batches)) for _ in batches]

    def weight_metas(self) -> list[TensorMeta]:
        return [TensorMeta(name="w", dtype="float32", shape=[1])]

    def named_full_weights(self) -> Iterator[tuple[str, Any]]:
        yield "w", [float(len(self.steps))]

    def lora_adapter(self) -> None:
        return None

    def frozen_prefixes(self) -> list[str]:
        return []

    def save_checkpoint(self, step: int, weight_version: int, driver_state: bytes) -> Path:
        self.checkpoints.append(Checkpoint(step, weight_version, driver_state))
        return Path(f"step-{step}")

    def export_hf(self, out_dir: str | Path) -> Path | None:
        self.exported.append(Path(out_dir))
        return Path(out_dir)

    def trained(self) -> list[tuple[int, list[int]]]:
        """(trainer version, each sample's oldest token version) of every mini-batch trained."""
        return [(b.trainer_version or 0, list(b.weight_versions)) for step in self.steps for b in step]


def job_spec(
    tmp_path: Path,
    *,
    mode: str = "sync",
    steps: int = 4,
    mini_batch: int = 4,
    n: int = 2,
    max_tokens: int = 6,
    asyncspec: dict[str, Any] | None = None,
    **extra: Any,
) -> DistillationJobSpec:
    """A small job over 16 arithmetic prompts; the model paths are never read."""
    spec: dict[str, Any] = {
        "mode": mode,
        "device": "cpu",
        "student": {"model": str(tmp_path / "student")},
        "teachers": [{"name": "arith", "model": str(tmp_path / "teacher")}],
        "rollout": {"sampling": {"samplesPerPrompt": n, "maxTokens": max_tokens, "seed": 3}},
        "trainer": {"miniBatchSize": mini_batch, "totalSteps": steps},
        "data": {"train": [str(write_prompts(tmp_path / "train.jsonl", 16))]},
        "checkpoint": {"path": str(tmp_path / "ckpt"), "exportHf": False},
        **extra,
    }
    if asyncspec is not None:
        spec["async"] = asyncspec
    return DistillationJobSpec.model_validate(spec)


@dataclass
class Rig:
    """A Driver wired to fakes (build it inside the test's event loop)."""

    driver: Driver
    cluster: FakeCluster
    trainer: FakeTrainer
    sender: FakeSender

    async def run(self, timeout: float = 15.0) -> None:
        """The driver's whole run; a test never waits longer than `timeout` for it."""
        try:
            await asyncio.wait_for(self.driver.run(), timeout)
        finally:
            self.trainer.release_all()


def rig(
    spec: DistillationJobSpec,
    *,
    rollouts: int | Sequence[FakeRolloutServer] = 2,
    teachers: int | Sequence[FakeTeacherServer] | Mapping[str, Sequence[FakeTeacherServer]] = 1,
    trainer: FakeTrainer | None = None,
    rollout_source: Callable[[], list[str]] | None = None,
    tokenizer: Any = None,
    **driver_args: Any,
) -> Rig:
    """`teachers`: the servers of the one teacher `arith` (a count or the servers), or the
    servers of each teacher by name. `tokenizer`: the student's (default: CharTokenizer)."""
    rollout_servers = (
        [FakeRolloutServer(f"http://rollout-{i}") for i in range(rollouts)] if isinstance(rollouts, int) else rollouts
    )
    if isinstance(teachers, Mapping):
        by_name = {name: list(servers) for name, servers in teachers.items()}
    elif isinstance(teachers, int):
        by_name = {"arith": [FakeTeacherServer(f"http://arith-{i}") for i in range(teachers)]}
    else:
        by_name = {"arith": list(teachers)}
    cluster = FakeCluster(rollout_servers, by_name)
    trainer = trainer or FakeTrainer()
    urls = [s.base_url for s in rollout_servers]
    sender = FakeSender(cluster, urls, pause_for(spec), asyncio.get_running_loop())
    driver = Driver(
        spec,
        trainer=trainer,
        sender=sender,
        rollout_urls=urls,
        teacher_urls=cluster.teacher_urls,
        tokenizer=tokenizer if tokenizer is not None else CharTokenizer(),
        rollout_source=rollout_source,
        clients=cluster,
        **driver_args,
    )
    return Rig(driver, cluster, trainer, sender)


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait (polling every 2 ms) until `condition()` holds; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        await asyncio.sleep(0.002)
