"""The training driver (trainer rank 0): one asyncio loop for the three modes of docs/design.md#modes.

Two sides share a SampleBuffer:

* generation — takes prompts from the PromptSource, reserves each group in the buffer (which
  waits while the mode's staleness bound or the in-flight cap would be exceeded), sends every
  sample to the least busy rollout server, resumes a sample aborted by a weight sync from the
  tokens it already has (partialRollout), sends each finished sample to its teacher right away
  (scoring overlaps the other generations), computes its task reward and puts the group back;
* training — takes `requireBatches x miniBatchSize` samples, runs the trainer step in a worker
  thread (generation and scoring continue meanwhile), syncs weights every
  `triggerParameterSyncStep` steps and tells the buffer, checkpoints;
* rollout membership — while the job scales, follows the servers the job wants: a new one joins
  the weight-sync group at a sync, a removed one is drained first (runtime/driver/fleet.py);
* failures — a request whose connection fails or times out (runtime/wire/http.py's
  TRANSPORT_ERRORS) is sent again. Failures are counted per server: MAX_TRANSPORT_FAILURES in a
  row take a server out of rotation (its role's other servers take the requests) until a probe
  finds it answering /health again; the run fails only when a role would have no server left
  (runtime/driver/routing.py).

The modes differ only in the staleness rule (StalenessPolicy): sync allows one batch under the
current weights (generate, train, sync), oneStepOff two (batch k+1 generates while k trains),
fullyAsync the spec's bound. All trainer calls run on one dedicated thread, in order.

A vision-language student (its config.json has a vision_config) gets its processor loaded here,
and image rows become prompts of processor-expanded ids with their images
(runtime/driver/multimodal.py); every /generate of such a prompt carries its images, a resumed
one too, and so does its /score. Before the run starts the driver refuses, in one line, image
rows for a text student and image rows routed to a text teacher (runtime/driver/routing.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kubedistill.api.progress import TrainerProgress
from kubedistill.api.spec import DistillationJobSpec
from kubedistill.runtime.checkpoint import checkpoint_due
from kubedistill.runtime.driver.batcher import BatchRequirements, assemble, prepare
from kubedistill.runtime.driver.best import BestKeeper
from kubedistill.runtime.driver.buffer import BufferClosed, SampleBuffer
from kubedistill.runtime.driver.clients import HttpClients, RolloutClientLike, ServerClients, TeacherClientLike
from kubedistill.runtime.driver.data import PromptSource, Tokenizer
from kubedistill.runtime.driver.episodes import EnvironmentsLike, Episodes, ReplicaLike, TraceRestart
from kubedistill.runtime.driver.evaluation import EvalResult, EvalSchedule, Evaluator, publish
from kubedistill.runtime.driver.fleet import PROBE_SECONDS, ROLLOUT_POLL_SECONDS, Fleet
from kubedistill.runtime.driver.history import HistoryWriter
from kubedistill.runtime.driver.membership import RolloutMembership
from kubedistill.runtime.driver.multimodal import load_student_processor, reads_images
from kubedistill.runtime.driver.phases import StepClock, sync_parts
from kubedistill.runtime.driver.report import StepReporter, StepStatsLike, SyncOutcomeLike, TrainedStep
from kubedistill.runtime.driver.rewards import RewardRegistry
from kubedistill.runtime.driver.routing import (
    EndpointPool,
    ImagesToTextTeacher,
    TeacherRouter,
    images_to_text_teacher,
)
from kubedistill.runtime.driver.samples import Sample, SampleGroup, call_seed
from kubedistill.runtime.driver.staleness import StalenessPolicy
from kubedistill.runtime.metrics import RoleMetrics
from kubedistill.runtime.wire.batch import BatchParts
from kubedistill.runtime.wire.http import TRANSPORT_ERRORS, ServerError, new_session, until_healthy
from kubedistill.runtime.wire.protocol import (
    GenerateRequest,
    GenerateResponse,
    LoraAdapter,
    ScoreRequest,
    ScoreResponse,
    TensorMeta,
)

log = logging.getLogger("kubedistill.driver")

DRIVER_STATE_FORMAT = 1
EXPORT_DIR = "student-hf"


T = TypeVar("T")


class TrainerLike(Protocol):
    """runtime/trainer's Trainer, as rank 0's driver calls it (tensors are torch's)."""

    def train(self, batches: Sequence[BatchParts]) -> Sequence[StepStatsLike]: ...
    def weight_metas(self) -> list[TensorMeta]: ...
    def named_full_weights(self) -> Iterator[tuple[str, Any]]: ...
    def lora_adapter(self) -> LoraAdapter | None: ...
    def frozen_prefixes(self) -> list[str]: ...
    def save_checkpoint(self, step: int, weight_version: int, driver_state: bytes) -> Path: ...
    def export_hf(self, out_dir: str | Path) -> Path | None: ...


class SenderLike(Protocol):
    """runtime/weight_sync's WeightSender."""

    members: list[str]
    """The rollout servers in the group, in rank order."""

    def sync(self, version: int, weights: TrainerLike) -> SyncOutcomeLike: ...
    def set_members(self, urls: list[str]) -> None: ...


def request_seed(base: int | None, sample: Sample) -> int | None:
    """The seed of the sample's next /generate call (none without rollout.sampling.seed)."""
    return None if base is None else call_seed(base, sample.group_id, sample.index, sample.requests)


class Driver:
    def __init__(
        self,
        spec: DistillationJobSpec,
        *,
        trainer: TrainerLike,
        sender: SenderLike | None,
        rollout_urls: list[str],
        teacher_urls: dict[str, list[str]],
        tokenizer: Tokenizer,
        metrics: RoleMetrics | None = None,
        history: HistoryWriter | None = None,
        status: TrainerProgress | None = None,
        clock: Callable[[], float] = time.monotonic,
        rollout_source: Callable[[], list[str]] | None = None,
        clients: ServerClients | None = None,
        rollout_poll_seconds: float = ROLLOUT_POLL_SECONDS,
        probe_seconds: float = PROBE_SECONDS,
        environments: EnvironmentsLike | None = None,
    ):
        self.spec = spec
        self.trainer = trainer
        self.sender = sender
        """None until the weight-sync group is formed (the trainer builds the driver first)."""
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.history = history or HistoryWriter()
        self.status = status or TrainerProgress(total_steps=spec.trainer.total_steps)
        """What GET /status serves."""
        self.clock = clock
        self.staleness_policy = StalenessPolicy.from_spec(spec)
        self.buffer = SampleBuffer(self.staleness_policy, metrics)
        self.requirements = BatchRequirements.from_spec(spec)
        self.processor = load_student_processor(spec)
        """The student's processor when it is a vision-language model (None: a text student)."""
        self.src = PromptSource.from_spec(spec, tokenizer, processor=self.processor)
        self.rewards = RewardRegistry.for_spec(spec)
        # Multi-turn traces (spec.rollout.multiTurn) against the environments' servers; text only.
        self.episodes = Episodes.for_job(
            spec, tokenizer, environments, self.rewards, metrics, clock, bool(self.processor)
        )
        self.fleet = Fleet(
            pool=EndpointPool("rollout", rollout_urls),
            rollouts=RolloutMembership(list(rollout_urls)),
            status=self.status,
            spawn=self._spawn,
            leave_group=lambda url: self._on_trainer(self._leave_group, url),
            version=lambda: self.version,
            partial_rollout=self.staleness_policy.partial_rollout,
            rollout_source=rollout_source,
            rollout_poll_seconds=rollout_poll_seconds,
            probe_seconds=probe_seconds,
        )
        """The servers: rollout membership while the job scales, probing (runtime/driver/fleet.py)."""
        self.pool = self.fleet.pool
        self.rollouts = self.fleet.rollouts
        self.status.rollout_servers = self.rollouts.held()
        self.clients = clients
        """Makes the clients of the servers; None: HTTP over the run's aiohttp session."""
        self.router = TeacherRouter(spec, teacher_urls, {t.name: reads_images(t.model) for t in spec.teachers})
        self._check_image_rows()
        self._teacher_urls = [u for urls in teacher_urls.values() for u in urls]
        self.step = self.version = 0  # train steps done; the weight version the rollouts serve
        self._pending_cursor: dict[str, Any] | None = None
        """Data cursor before a prompt drawn but not yet reserved in the buffer (a checkpoint
        taken then must not skip it)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.requests_by_server: dict[str, int] = {}
        """/generate calls answered, per rollout server (this driver process)."""
        self._error: BaseException | None = None
        self._trainer_thread = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        self.frozen = threading.Event()  # set: trainer work goes on again after freeze()
        self.run_id = uuid.uuid4().hex[:12]
        """Names the driver process in every history line (runtime/driver/report.py)."""
        self.step_clock = StepClock(clock)
        """The training side's timeline, cut into each step's phases (runtime/driver/phases.py)."""
        self._resumed_groups: list[SampleGroup] = []
        self._set_up_evaluation(spec)

    def _set_up_evaluation(self, spec: DistillationJobSpec) -> None:
        self.eval_schedule = EvalSchedule.from_spec(spec)
        self.evaluator = self._evaluator() if spec.evaluation is not None else None
        """Held-out evaluation (runtime/driver/evaluation.py); None without spec.evaluation."""
        self._evaluations: list[dict[str, Any]] = []
        """Evaluations finished since the last history line (the next line carries them)."""
        self.best = BestKeeper(spec.checkpoint.path) if spec.evaluation and spec.evaluation.keep_best else None
        """spec.evaluation.keepBest: each evaluated student's export, the best one kept."""

    def _evaluator(self) -> Evaluator:
        assert self.spec.evaluation is not None
        val = PromptSource.from_spec(self.spec, self.tokenizer, split="val", processor=self.processor)
        return Evaluator(
            self.spec.evaluation,
            val.first_items(self.spec.evaluation.prompts),
            sampling=self.spec.rollout.sampling,
            tokenizer=self.tokenizer,
            rewards=RewardRegistry(strict=False),  # an unknown data_source gets no score, not an error
            generate=self._generate_until_answered,
            score=self._score_request,
            on_result=self._evaluated,
            clock=self.clock,
            episodes=self._held_out_episodes(),
        )

    def _held_out_episodes(self) -> Episodes | None:
        """Held-out traces (a multi-turn job): as in training, with evaluation's turn budget and
        its lenient rewards; not counted in the training's trace metrics."""
        if self.episodes is None or self.spec.evaluation is None:
            return None
        return Episodes(
            self.spec,
            self.tokenizer,
            self.episodes.environments,
            RewardRegistry(strict=False),
            turn_tokens=self.spec.evaluation.max_tokens,
        )

    def _evaluated(self, result: EvalResult) -> None:
        self._evaluations.append(result.to_json())
        publish(result, self.status, self.metrics, self.spec)
        if self.best is not None:
            self.best.finished(result)

    async def _evaluate(self, step: int) -> None:
        """Start the evaluation of the weights synced after `step` (keepBest: export them first,
        while the trainer still holds them)."""
        assert self.evaluator is not None
        if self.best is not None:
            await self._on_trainer(self.trainer.export_hf, self.best.candidate(step))
        self.evaluator.start(step, self.version)

    def _check_image_rows(self) -> None:
        """Refuse, before anything runs, image rows that a text student or a text teacher would
        get (one line naming the first such row and how many there are)."""
        rows = list(self.src.image_rows())
        if not rows:
            return
        if self.processor is None:
            more = f" and {len(rows) - 1} more row(s)" if len(rows) > 1 else ""
            raise ValueError(
                f"{rows[0][0]}{more}: images, but the student {self.spec.student.model} is not a vision-language "
                "model (no vision_config in its config.json), so it cannot see them; distill a vision-language "
                "student or drop the images from the data"
            )
        if not self.requirements.teacher_scores:
            return
        by_route: dict[tuple[str, str], list[str]] = {}
        for where, data_source, route_value in rows:
            by_route.setdefault((data_source, route_value), []).append(where)
        for (data_source, route_value), wheres in by_route.items():
            more = f" and {len(wheres) - 1} more row(s)" if len(wheres) > 1 else ""
            self.router.refuse_images(route_value, data_source, wheres[0] + more)

    # ---- checkpoint state ------------------------------------------------------------------
    def driver_state(self) -> bytes:
        """Data cursor + every sample generated but not trained on (buffered or in flight)."""
        cursor = self._pending_cursor if self._pending_cursor is not None else self.src.state_dict()
        return pickle.dumps(
            {
                "format": DRIVER_STATE_FORMAT,
                "step": self.step,
                "version": self.version,
                "data": cursor,
                "buffer": self.buffer.to_bytes(),
            }
        )

    def restore(self, step: int, weight_version: int, driver_state: object) -> None:
        """Continue from a checkpoint: `driver_state` as driver_state() made it (or unpickled)."""
        state = pickle.loads(driver_state) if isinstance(driver_state, (bytes, bytearray)) else driver_state
        if not isinstance(state, dict) or state.get("format") != DRIVER_STATE_FORMAT:
            raise ValueError(f"checkpoint driver state has an unknown format (want {DRIVER_STATE_FORMAT})")
        self.src.load_state_dict(state["data"])
        self.buffer.load_bytes(state["buffer"])
        self.step, self.version = step, weight_version
        self.status.step, self.status.weight_version = step, weight_version
        for g in self.buffer.in_flight_groups():
            if not self.staleness_policy.partial_rollout:
                for s in g.samples:
                    if not s.finished:
                        s.restart()
            self._resumed_groups.append(g)
        log.info(
            "resumed at step %d, weight version %d: %d groups buffered, %d in flight",
            step,
            weight_version,
            len(self.buffer.ready_groups()),
            len(self._resumed_groups),
        )

    # ---- trainer thread --------------------------------------------------------------------
    def freeze(self) -> None:
        """Start no more trainer work (train steps, syncs, checkpoints; the one running finishes):
        the process is ending (SIGTERM), and a checkpoint written meanwhile would hold steps that
        no history line or tracker recorded."""
        self._trainer_thread.submit(self.frozen.wait)

    async def _on_trainer(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._trainer_thread, fn, *args)

    def _sync_blocking(self, version: int, joiners: Sequence[str] = ()) -> SyncOutcomeLike:
        if self.sender is None:
            raise RuntimeError("no weight sender: the weight-sync group is not formed")
        if joiners:  # the sync re-forms the group with them, so they start at this version
            self.sender.set_members([*self.sender.members, *(u for u in joiners if u not in self.sender.members)])
        # The trainer itself: the sender lays out the manifest from its metadata and draws the
        # gathered tensors bucket by bucket once every server is ready to receive.
        return self.sender.sync(version, self.trainer)

    def _leave_group(self, url: str) -> None:
        if self.sender is not None and url in self.sender.members:
            self.sender.set_members([u for u in self.sender.members if u != url])

    async def sync_weights(self, version: int) -> SyncOutcomeLike:
        """Sync the trainer's weights to every rollout server as `version`; returns what the
        sender reports of it (its segments, bytes and plan)."""
        joiners = list(self.rollouts.ready)
        outcome = await self._on_trainer(self._sync_blocking, version, joiners)
        self.fleet.joined(joiners, version)
        self.version = version
        self.status.weight_version = version
        await self.buffer.synced(version)
        return outcome

    # ---- the run ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Train until totalSteps, then the final checkpoint and the HF export."""
        total = self.spec.trainer.total_steps
        self.status.set_phase("running")
        reporter = StepReporter(self.status, self.metrics, self.history, self.run_id)
        # A generation may wait out a weight sync (and its timeout) before it is aborted.
        async with new_session(timeout=float(self.spec.weight_sync.timeout_seconds) + 600.0) as http:
            servers = self.fleet.servers = self.clients if self.clients is not None else HttpClients(http)
            self.fleet.rollout = {u: servers.rollout(u) for u in self.rollouts.members}
            self.fleet.teacher = {u: servers.teacher(u) for u in self._teacher_urls}
            environments = self.episodes.environments.replicas() if self.episodes is not None else []
            await self._wait_healthy([*self.fleet.rollout.values(), *self.fleet.teacher.values(), *environments])
            reporter.started = self.clock()
            self.step_clock.start(reporter.started)
            for g in self._resumed_groups:
                self._spawn(self._generate_group(g))
            self._resumed_groups = []
            producer = asyncio.create_task(self._produce())
            producer.add_done_callback(functools.partial(self._task_done, "generation"))
            if self.evaluator is not None and self.step == 0 and self.eval_schedule and self.eval_schedule.due(0):
                await self._evaluate(0)
            watcher = (
                asyncio.create_task(self.fleet.follow_rollouts()) if self.fleet.rollout_source is not None else None
            )
            try:
                while self.step < total:
                    line = reporter.report(await self._train_one(), self.clock(), *self._counts())
                    if self.step >= total and self.evaluator is not None:
                        self.step_clock.lap("driver")
                        await self.evaluator.settle()  # the last line carries the final evaluation
                        self.step_clock.lap("eval")
                    self.step_clock.lap("driver")
                    if self._evaluations:
                        line["evaluations"], self._evaluations = self._evaluations, []
                        line["evaluation"] = self.status.to_json()["evaluation"]  # the status part, made earlier
                    reporter.end_step(line, self.step_clock.close(), self.step_clock.mark)
                    # After the line: a trainer stopped during the checkpoint has logged the step
                    # (a resume from the previous checkpoint replays it under a new runId). Its
                    # time is the next step's `checkpoint` phase.
                    if checkpoint_due(self.step, self.spec.checkpoint.every_steps, total):
                        await self._checkpoint()
                        self.step_clock.lap("checkpoint")
            finally:
                if self.evaluator is not None:
                    await self.evaluator.cancel()
                producer.cancel()
                others = [watcher] if watcher is not None else []
                for t in [*others, *self._tasks]:
                    t.cancel()
                await asyncio.gather(producer, *others, *self._tasks, return_exceptions=True)
                await self.buffer.close()
        if self.spec.checkpoint.export_hf:
            out = Path(self.spec.checkpoint.path) / EXPORT_DIR
            await self._on_trainer(self.trainer.export_hf, out)
            log.info("exported the student to %s", out)
        self._trainer_thread.shutdown(wait=True)
        self.status.set_phase("done")

    async def _served_versions(self, version: int, wait: float = 10.0) -> list[int | None]:
        """GET /version of every rollout server, waiting briefly until each reports `version`
        (an engine may finish bookkeeping just after the sync's last collective). None for a
        server that does not answer: it went away after the sync, which its requests will find."""

        async def served_by(client: RolloutClientLike) -> int | None:
            try:
                return await client.version()
            except TRANSPORT_ERRORS:
                return None

        deadline = self.clock() + wait
        while True:
            clients = [self.fleet.rollout[u] for u in self.rollouts.members]
            served = list(await asyncio.gather(*(served_by(c) for c in clients)))
            if all(v is None or v >= version for v in served) or self.clock() > deadline:
                return served
            await asyncio.sleep(0.05)

    async def _wait_healthy(self, clients: Sequence[RolloutClientLike | TeacherClientLike | ReplicaLike]) -> None:
        """Every server answers /health (teachers and environments may still be starting when the
        rollout servers have already joined the weight-sync group)."""
        deadline = self.clock() + float(self.spec.weight_sync.timeout_seconds)
        for c in clients:
            try:
                await until_healthy(c.health, every=0.5, deadline=deadline, clock=self.clock)
            except Exception as e:
                raise RuntimeError(
                    f"{c.base_url} is not healthy after {self.spec.weight_sync.timeout_seconds} s: {e!r}"
                ) from e

    async def _checkpoint(self) -> None:
        state = self.driver_state()  # a consistent snapshot: taken on the loop thread
        path = await self._on_trainer(self.trainer.save_checkpoint, self.step, self.version, state)
        self.status.last_checkpoint = str(path) if path is not None else None
        log.info("checkpoint %s", path)

    async def _train_one(self) -> TrainedStep:
        """One train step (and the sync after it); the run reports it (runtime/driver/report.py)
        once the step's checkpoint, if any, is done."""
        clock = self.step_clock
        clock.lap("driver")  # the previous step's history line and metrics, the loop around
        try:
            groups = await self.buffer.take(self.requirements.step_samples)
        except BufferClosed:
            raise self._error or RuntimeError("the sample buffer closed before totalSteps") from None
        waited = clock.lap("wait")
        trainer_version = self.version
        step_samples = assemble(groups, self.requirements, trainer_version)
        batches = step_samples.train_batches(self.requirements)
        clock.lap("train_other")  # the batch's arrays and checks, on the loop
        stats = await self._on_trainer(lambda: self.trainer.train(batches))
        clock.lap("train_other", {"train_compute": sum(mb.compute_seconds for mb in stats)})
        self.step += 1
        self.status.step = self.step
        served: list[int | None] | None = None
        sync_seconds = 0.0
        outcome: SyncOutcomeLike | None = None
        # An evaluation due after this step needs its weights on the rollout servers: the last
        # step, otherwise never synced, gets a sync too.
        eval_due = self.eval_schedule is not None and self.eval_schedule.due(self.step)
        if (
            self.step % self.staleness_policy.trigger_parameter_sync_step == 0
            and self.step < self.spec.trainer.total_steps
        ) or eval_due:
            clock.lap("driver")
            if self.evaluator is not None:
                await self.evaluator.settle()  # the running evaluation's tokens all come from its weights
                clock.lap("eval")
            outcome = await self.sync_weights(self.version + 1)
            # The sender knows what a server that serves a load before the sync ends (hf) serves;
            # the others (vLLM's API process learns of the load a moment later) are asked: a round
            # trip through two event loops busy with the resumed generation (its cost:
            # docs/design.md, "Smaller measurements").
            urls = self.rollouts.members
            known = outcome.served
            served = (
                [known[u] for u in urls] if all(u in known for u in urls) else await self._served_versions(self.version)
            )
            # What the sender does not report (the driver's thread hop, the served versions and
            # the buffer's new version) is the last of the resume.
            sync_seconds = clock.lap("sync_resume", sync_parts(outcome.times))
            if eval_due and self.evaluator is not None:
                await self._evaluate(self.step)
                clock.lap("eval")
        return TrainedStep(
            step=self.step,
            trainer_version=trainer_version,
            version=self.version,
            groups=groups,
            samples=step_samples.samples,
            staleness=step_samples.staleness(),
            stats=stats,
            waited=waited,
            sync=outcome,
            served=served,
            sync_seconds=sync_seconds,
        )

    def _counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """The run's sample counters and /generate calls per rollout server, for the step's report."""
        return dict(self.buffer.counters), dict(self.requests_by_server)

    # ---- generation ------------------------------------------------------------------------
    async def _produce(self) -> None:
        n, max_tokens = self.spec.rollout.sampling.samples_per_prompt, self.spec.rollout.sampling.max_tokens
        if self.episodes is not None:  # a trace's budget: every turn and observation
            max_tokens = self.episodes.trace_tokens
        while True:
            self._pending_cursor = self.src.state_dict()
            group = SampleGroup.from_prompt(self.src.next(), n, max_tokens)
            await self.buffer.reserve(group)
            self._pending_cursor = None
            self._spawn(self._generate_group(group))

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str = "generation") -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._task_done, what))

    def _task_done(self, what: str, task: asyncio.Task[None]) -> None:
        """A background task ended: an error in it ends the run (the buffer closes)."""
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, BufferClosed) and self._error is None:
            log.error("%s failed: %r", what, exc)
            self._error = exc
            asyncio.get_running_loop().create_task(self.buffer.close())

    async def _generate_group(self, group: SampleGroup) -> None:
        if len(group.samples) == 1:  # one sample per prompt: no task and gather of its own
            await self._generate_sample(group, group.samples[0])
        else:
            await asyncio.gather(*(self._generate_sample(group, s) for s in group.samples))
        prepare(group, self.requirements)
        await self.buffer.put(group)

    async def _generate_sample(self, group: SampleGroup, s: Sample) -> None:
        t0 = self.clock()
        if self.episodes is not None:
            seed = request_seed(self.spec.rollout.sampling.seed, s)
            await self.episodes.run(s, functools.partial(self._generate_turn, group), seed)
        else:
            await self._generate_turn(group, s)
        await self.buffer.sample_finished()
        self._observe("gen", self.clock() - t0)
        if self.requirements.teacher_scores and not s.scored:
            await self._score(group, s)
        if s.reward is None:
            text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
            self.rewards.score_sample(s, text)

    async def _generate_turn(self, group: SampleGroup, s: Sample) -> None:
        """/generate continuations of `s` until its turn (a single-turn sample's only one) ends."""
        from kubedistill.runtime.wire.protocol import Sampling

        sp = self.spec.rollout.sampling
        while not s.finished:
            if s.needs_resume and not self.staleness_policy.partial_rollout:
                if self.episodes is not None:  # a trace's episode cannot go back: it starts over
                    raise TraceRestart(s.sample_id)
                s.restart()
            c = s.continuation()
            req = GenerateRequest(
                request_id=c.request_id,
                prompt_token_ids=c.prompt_token_ids,
                prefix_token_ids=c.prefix_token_ids,
                images=group.images,  # every request of an image prompt, a resumed one too
                sampling=Sampling(
                    max_tokens=c.max_tokens,
                    temperature=sp.temperature,
                    top_p=sp.top_p,
                    top_k=sp.top_k or 0,
                    repetition_penalty=sp.repetition_penalty,
                    stop=sp.stop,
                    stop_token_ids=sp.stop_token_ids,
                    seed=request_seed(sp.seed, s),
                    top_k_ids=self.requirements.rollout_top_k,
                ),
            )
            out = await self._generate_once(req)
            if out is None:
                continue  # the sample is unchanged: send it again (under a new request id)
            s.extend(out)

    async def _generate_once(self, req: GenerateRequest) -> GenerateResponse | None:
        """/generate on the least busy rollout server; None when the connection failed (the server
        closed it as the request went out, or is gone): the caller sends it again."""
        url = self.pool.acquire()
        try:
            out = await self.fleet.rollout[url].generate(req)
        except TRANSPORT_ERRORS as e:
            self.fleet.transport_failure(self.pool, url, f"generate on {url}", e)
            return None
        finally:
            self.pool.release(url)
        self.pool.succeeded(url)
        self.requests_by_server[url] = self.requests_by_server.get(url, 0) + 1
        return out

    async def _generate_until_answered(self, req: GenerateRequest) -> GenerateResponse:
        while True:
            out = await self._generate_once(req)
            if out is not None:
                return out

    async def _score(self, group: SampleGroup, s: Sample) -> None:
        t0 = self.clock()
        if group.images:  # checked for every row before the run; this covers restored samples too
            self.router.refuse_images(s.route_value, s.data_source, f"sample {s.sample_id}")
        ids, prompt_len = s.score_input()
        req = ScoreRequest(
            token_ids=ids,
            prompt_len=prompt_len,
            top_k=self.requirements.teacher_top_k,
            images=group.images,
            gather_ids=self.requirements.gather_ids(s),
        )
        name, out = await self._score_request(s.route_value, s.data_source, req, f"sample {s.sample_id}")
        s.set_scores(name, out)
        self._observe("score", self.clock() - t0)

    async def _score_request(
        self, route_value: str, data_source: str, req: ScoreRequest, what: str = "a held-out sample"
    ) -> tuple[str, ScoreResponse]:
        """/score on a replica of the teacher `route_value` routes to; (its name, the answer)."""
        while True:
            name, url = self.router.acquire(route_value)
            replicas = self.router.pools[name]
            try:
                out = await self.fleet.teacher[url].score(req)
            except TRANSPORT_ERRORS as e:
                self.fleet.transport_failure(replicas, url, f"score on {url}", e)
                continue
            except ServerError as e:
                if req.images and e.status == 400 and "text-only" in e.message:
                    why = f"whose server {url} answered that its model is text-only ({e.message})"
                    raise ImagesToTextTeacher(images_to_text_teacher(data_source, name, why, what)) from e
                raise
            finally:
                self.router.release(name, url)
            replicas.succeeded(url)
            return name, out

    def _observe(self, phase: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics["step_seconds"].labels(phase=phase).observe(seconds)
