"""Held-out evaluation during the job (spec.evaluation, docs/design.md#held-out-evaluation).

The driver evaluates the weights the rollout servers received at a sync: before the first step
(version 0), after every `everySteps`-th step and after the last one. An evaluation sends each of
the first `prompts` rows of spec.data.val, `samplesPerPrompt` times, to the rollout servers (the
same pool, least busy first, as training generation), scores each response with the training
reward functions, and, with `scoreWithTeachers`, sends it to its routed teacher. It runs beside
training generation; the driver holds the next weight sync until it is done, so every held-out
token comes from the weights of the step it reports (each response's token versions are checked).

What it reports is per data_source: the mean task reward (None when no reward function matches
the data_source), the mean response length, and the per-token reverse KL(student || teacher)
estimate `mean(log p_student(y) - log p_teacher(y))` at the response tokens y (an unbiased
estimate of the reverse KL when the responses are sampled at temperature 1, as the training
batches' KL is). The headline score is the mean of the data sources' scores.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kubedistill.api.status import HeldOutEvaluation, HeldOutSource
from kubedistill.runtime.driver.data import PromptItem
from kubedistill.runtime.driver.episodes import Episodes, TraceRestart
from kubedistill.runtime.driver.rewards import RewardRegistry
from kubedistill.runtime.driver.samples import Sample, call_seed
from kubedistill.runtime.wire.protocol import GenerateRequest, GenerateResponse, Sampling, ScoreRequest, ScoreResponse

if TYPE_CHECKING:
    from kubedistill.api.progress import TrainerProgress
    from kubedistill.api.spec import DistillationJobSpec, EvaluationSpec, SamplingSpec
    from kubedistill.runtime.driver.data import Tokenizer
    from kubedistill.runtime.metrics import RoleMetrics

log = logging.getLogger("kubedistill.driver.evaluation")

Generate = Callable[[GenerateRequest], Awaitable[GenerateResponse]]
"""One /generate on a rollout server, sent again on transport failures (the driver's)."""
Score = Callable[[str, str, ScoreRequest], Awaitable[tuple[str, ScoreResponse]]]
"""(routing value, data_source, request) -> (teacher name, its /score answer) (the driver's)."""


@dataclass(frozen=True)
class EvalSchedule:
    """When evaluations happen: a pure function of the step."""

    every_steps: int | None
    before_first_step: bool
    total_steps: int

    @classmethod
    def from_spec(cls, spec: DistillationJobSpec) -> EvalSchedule | None:
        e = spec.evaluation
        if e is None:
            return None
        return cls(e.every_steps, e.before_first_step, spec.trainer.total_steps)

    def due(self, step: int) -> bool:
        """Whether the weights after train step `step` are evaluated (step 0: the starting ones)."""
        if step == 0:
            return self.before_first_step
        return step == self.total_steps or (self.every_steps is not None and step % self.every_steps == 0)


@dataclass(frozen=True)
class HeldOutSample:
    """One held-out response, scored."""

    data_source: str
    teacher: str | None
    reward: float | None
    length: int
    log_ratio_sum: float | None = None
    """Sum over the response tokens of log p_student - log p_teacher (None: not scored)."""


@dataclass(frozen=True)
class SourceScores:
    """One data_source's results of one evaluation."""

    prompts: int
    samples: int
    score: float | None
    """Mean task reward (accuracy for 0/1 rewards); None: no reward function for the data_source."""
    response_length: float
    """Mean response tokens."""
    reverse_kl: float | None = None
    """Per-token reverse KL(student || teacher) estimate; None unless scoreWithTeachers."""
    teacher: str | None = None
    """The teacher its samples route to (None unless scoreWithTeachers)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "samples": self.samples,
            "score": self.score,
            "responseLength": self.response_length,
            "reverseKL": self.reverse_kl,
            "teacher": self.teacher,
        }


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the step whose weights it used and its scores per data_source."""

    step: int
    weight_version: int
    seconds: float
    sources: dict[str, SourceScores]

    @property
    def score(self) -> float | None:
        """The headline: the mean of the data sources' scores (None when none has one)."""
        scores = [s.score for s in self.sources.values() if s.score is not None]
        return sum(scores) / len(scores) if scores else None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "weightVersion": self.weight_version,
            "seconds": round(self.seconds, 3),
            "score": self.score,
            "sources": {name: s.to_json() for name, s in sorted(self.sources.items())},
        }


def summarize(samples: Sequence[HeldOutSample], prompts: dict[str, int]) -> dict[str, SourceScores]:
    """Per data_source: mean reward over the samples that have one, mean length, and the
    token-weighted mean log ratio (the per-token KL estimate, as the quickstart's evaluate())."""
    out: dict[str, SourceScores] = {}
    for source in sorted({s.data_source for s in samples}):
        mine = [s for s in samples if s.data_source == source]
        rewards = [s.reward for s in mine if s.reward is not None]
        tokens = sum(s.length for s in mine)
        scored = [s for s in mine if s.log_ratio_sum is not None]
        kl = None
        if scored:
            scored_tokens = sum(s.length for s in scored)
            kl = sum(s.log_ratio_sum or 0.0 for s in scored) / scored_tokens if scored_tokens else 0.0
        teachers = {s.teacher for s in scored if s.teacher is not None}
        out[source] = SourceScores(
            prompts=prompts.get(source, 0),
            samples=len(mine),
            score=sum(rewards) / len(rewards) if rewards else None,
            response_length=tokens / len(mine),
            reverse_kl=kl,
            teacher=",".join(sorted(teachers)) if teachers else None,
        )
    return out


class Evaluator:
    """Runs one evaluation at a time in the background; the driver awaits `settle()` before a
    weight sync (and at the end), and reads each finished result through `on_result`."""

    def __init__(
        self,
        spec: EvaluationSpec,
        items: Sequence[PromptItem],
        *,
        sampling: SamplingSpec,
        tokenizer: Tokenizer,
        rewards: RewardRegistry,
        generate: Generate,
        score: Score | None,
        on_result: Callable[[EvalResult], None],
        clock: Callable[[], float] = time.monotonic,
        episodes: Episodes | None = None,
    ):
        """`episodes`: a multi-turn job's traces (spec.rollout.multiTurn): each held-out answer is
        a trace against the row's environment, as in training, and scored on it."""
        if not items:
            raise ValueError("spec.data.val: no held-out prompt fits spec.data.maxPromptLength")
        self.spec = spec
        self.items = list(items)
        self.sampling = sampling
        """spec.rollout.sampling: its maxTokens where spec.evaluation sets none, and where a held-out
        answer ends and how its tokens are drawn (stop, stopTokenIds, repetitionPenalty, topK, topP),
        as in training; the temperature and the seeds are the evaluation's own."""
        self.max_tokens = spec.max_tokens or sampling.max_tokens
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.generate = generate
        self.score = score if spec.score_with_teachers else None
        self.on_result = on_result
        self.clock = clock
        self.episodes = episodes
        self._task: asyncio.Task[None] | None = None
        self.results: list[EvalResult] = []
        self._prompts: dict[str, int] = {}
        for item in self.items:
            self._prompts[item.data_source] = self._prompts.get(item.data_source, 0) + 1

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, step: int, version: int) -> None:
        """Evaluate the weights the rollout servers serve as `version` (those after `step`)."""
        if self.running:
            raise RuntimeError("an evaluation is still running: settle() it before the next sync")
        self._task = asyncio.create_task(self._evaluate(step, version))

    async def settle(self) -> float:
        """Wait for the running evaluation (raising its error); returns the seconds waited."""
        if self._task is None:
            return 0.0
        t0 = self.clock()
        task, self._task = self._task, None
        await task
        return self.clock() - t0

    async def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _evaluate(self, step: int, version: int) -> None:
        t0 = self.clock()
        n = self.spec.samples_per_prompt
        jobs = [self._sample(item, i, step, version) for item in self.items for i in range(n)]
        samples = await asyncio.gather(*jobs)
        result = EvalResult(step, version, self.clock() - t0, summarize(samples, self._prompts))
        self.results.append(result)
        log.info(
            "held-out evaluation at step %d (weight version %d): score %s in %.1f s",
            step,
            version,
            "n/a" if result.score is None else f"{result.score:.4f}",
            result.seconds,
        )
        self.on_result(result)

    def _request(
        self, rid: str, prompt: list[int], prefix: list[int], max_tokens: int, seed: int, images: Any
    ) -> GenerateRequest:
        return GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            prefix_token_ids=prefix,
            images=images,
            sampling=Sampling(
                max_tokens=max_tokens,
                temperature=self.spec.temperature,
                top_p=self.sampling.top_p,
                top_k=self.sampling.top_k or 0,
                repetition_penalty=self.sampling.repetition_penalty,
                stop=self.sampling.stop,
                stop_token_ids=self.sampling.stop_token_ids,
                seed=seed,
            ),
        )

    async def _sample(self, item: PromptItem, index: int, step: int, version: int) -> HeldOutSample:
        if self.episodes is not None:
            return await self._trace(item, index, step, version, self.episodes)
        images = item.images_base64()
        attempt = 0
        while True:
            attempt += 1
            # Distinct seeds per sample and evaluation, so several samples of a prompt differ.
            rid, seed = f"eval-{step}-{item.uid}-{index}-{attempt}", call_seed(step, item.uid, index)
            out = await self.generate(self._request(rid, list(item.prompt_ids), [], self.max_tokens, seed, images))
            # An abort (a server drained mid-request) ends a response early: draw it again.
            if out.finish_reason != "abort":
                break
        stale = {v for v in out.versions if v != version}
        if stale:
            raise RuntimeError(
                f"held-out evaluation of step {step}: tokens from weight versions {sorted(stale)}, not {version}"
            )
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        reward = self.rewards.score(item.data_source, text, item.ground_truth, item.reward_fn)
        teacher, ratio = None, None
        if self.score is not None and out.token_ids:
            sreq = ScoreRequest(
                token_ids=[*item.prompt_ids, *out.token_ids], prompt_len=len(item.prompt_ids), top_k=0, images=images
            )
            teacher, scored = await self.score(item.route_value, item.data_source, sreq)
            ratio = sum(s - t for s, t in zip(out.logprobs, scored.logprobs, strict=True))
        return HeldOutSample(item.data_source, teacher, reward, len(out.token_ids), ratio)

    async def _trace(self, item: PromptItem, index: int, step: int, version: int, episodes: Episodes) -> HeldOutSample:
        """A held-out trace: turns against the row's environment, as in training. Its length and
        reverse KL count the student's own tokens only."""
        s = Sample(
            group_id=item.uid,
            index=index,
            prompt_ids=list(item.prompt_ids),
            max_tokens=episodes.trace_tokens,
            data_source=item.data_source,
            route_value=item.route_value,
            ground_truth=item.ground_truth,
            reward_fn=item.reward_fn,
        )

        async def turn(s: Sample) -> None:
            while not s.finished:
                c = s.continuation()
                rid, seed = f"eval-{step}-{c.request_id}", call_seed(step, item.uid, index, s.requests)
                out = await self.generate(
                    self._request(rid, c.prompt_token_ids, c.prefix_token_ids, c.max_tokens, seed, None)
                )
                if out.finish_reason == "abort":  # a server drained mid-turn: the trace starts over
                    raise TraceRestart(s.sample_id)
                s.extend(out)

        await episodes.run(s, turn, call_seed(step, item.uid, index))
        stale = {v for v in s.versions if v != version}
        if stale:
            raise RuntimeError(
                f"held-out evaluation of step {step}: tokens from weight versions {sorted(stale)}, not {version}"
            )
        mask = s.loss_mask() or [True] * len(s.response_ids)
        teacher, ratio = None, None
        if self.score is not None and s.response_ids:
            ids, prompt_len = s.score_input()
            teacher, scored = await self.score(
                s.route_value, s.data_source, ScoreRequest(token_ids=ids, prompt_len=prompt_len, top_k=0)
            )
            ratio = sum(a - b for a, b, own in zip(s.logprobs, scored.logprobs, mask, strict=True) if own)
        return HeldOutSample(item.data_source, teacher, s.reward, sum(mask), ratio)


def scores_line(result: EvalResult) -> str:
    """A short text of one evaluation for logs and `kubedistill run`'s progress line."""
    parts = []
    for name, s in sorted(result.sources.items()):
        bits = [f"{s.score:.3f}" if s.score is not None else "n/a"]
        if s.reverse_kl is not None:
            bits.append(f"KL {s.reverse_kl:.4f}")
        parts.append(f"{name} {' '.join(bits)}")
    return f"held-out@{result.step}: " + ", ".join(parts)


def status_of(result: EvalResult) -> HeldOutEvaluation:
    """The result as GET /status and the job's status carry it."""
    return HeldOutEvaluation(
        step=result.step,
        weight_version=result.weight_version,
        score=result.score,
        sources={
            name: HeldOutSource.model_validate(
                {"score": s.score, "responseLength": s.response_length, "reverseKL": s.reverse_kl, "teacher": s.teacher}
            )
            for name, s in sorted(result.sources.items())
        },
    )


def routed_teacher(spec: DistillationJobSpec, data_source: str) -> str:
    """The teacher a data_source's samples route to ("" when none does), for the metrics' label.
    The routing key may be another column than data_source: then the label names the teacher
    only where the data_source value itself routes."""
    try:
        return spec.teacher_for(data_source).name
    except LookupError:
        return ""


def publish(
    result: EvalResult, status: TrainerProgress, metrics: RoleMetrics | None, spec: DistillationJobSpec
) -> None:
    """Put a finished evaluation in GET /status and the trainer's gauges."""
    status.evaluation = status_of(result)
    if metrics is None:
        return
    metrics["eval_step"].set(result.step)
    for name, s in result.sources.items():
        teacher = s.teacher or routed_teacher(spec, name)
        labels = {"data_source": name, "teacher": teacher}
        if s.score is not None:
            metrics["eval_score"].labels(**labels).set(s.score)
        metrics["eval_response_length"].labels(**labels).set(s.response_length)
        if s.reverse_kl is not None:
            metrics["eval_reverse_kl"].labels(**labels).set(s.reverse_kl)
