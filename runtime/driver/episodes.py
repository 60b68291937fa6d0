"""Multi-turn traces (spec.rollout.multiTurn): the student's turns, sampled on the rollout servers,
alternate with an environment server's observations in one Sample
(docs/design.md#multi-turn-rollouts-with-environments).

    episodes = Episodes(spec, tokenizer, open_episode, rewards)
    await episodes.run(sample, generate_turn)   # generate_turn: the driver's /generate loop

A trace opens an episode on the environment its row routes to, then repeats: a student turn (a
/generate continuation of the whole trace so far, ending on the turn's own stop, its
`sampling.maxTokens`, or the trace's `maxTraceTokens`), the decoded turn as the environment's
action, the observation rendered through the student's chat template and appended as tokens the
student did not sample (Sample.add_observation: they carry no loss). It ends when the environment
says done, after `maxTurns`, on the trace budget, or when the environment fails (the reason is
recorded on the sample and counted; the trace trains on the turns it has).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kubedistill.runtime.driver.samples import Sample
from kubedistill.runtime.environments.client import REASONS, EpisodeFailed

if TYPE_CHECKING:
    from kubedistill.api.spec import DistillationJobSpec
    from kubedistill.runtime.driver.data import Tokenizer
    from kubedistill.runtime.driver.rewards import RewardRegistry
    from kubedistill.runtime.metrics import RoleMetrics

log = logging.getLogger("kubedistill.driver")


class StepLike(Protocol):
    """What an environment's step returns (runtime/environments)."""

    @property
    def observation_text(self) -> str: ...
    @property
    def reward(self) -> float | None: ...
    @property
    def done(self) -> bool: ...


class EpisodeLike(Protocol):
    """One open episode on an environment server (its own session)."""

    async def step(self, text: str) -> StepLike: ...
    async def close(self) -> None: ...


class ReplicaLike(Protocol):
    """One environment server, as the driver waits for it."""

    @property
    def base_url(self) -> str: ...
    async def health(self) -> None: ...


class EnvironmentsLike(Protocol):
    """A job's environments (runtime/environments: Environments)."""

    async def open(self, name: str, seed: int | None) -> EpisodeLike:
        """An open episode on environment `name` (its own session)."""
        ...

    def replicas(self) -> Sequence[ReplicaLike]: ...


class TraceRestart(Exception):
    """A turn was interrupted and partial rollouts are off: the trace starts over, in a new episode."""


@dataclass(frozen=True)
class ObservationRenderer:
    """Turns an observation's text into the tokens that follow a student turn in the trace: the rest
    of the chat template's end of the assistant turn, the observation as a message of `role`, and
    the generation prompt of the next assistant turn, exactly as the template would render a
    conversation with those messages (so the student sees what a chat would show it)."""

    tokenizer: Tokenizer
    role: str
    eos_text: str | None = None
    """The decoded EOS token (when the student's turn ends with it, it is already in the trace)."""

    _MARK = "\x00kd-turn\x00"

    def _base(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "q"}, {"role": "assistant", "content": self._MARK}]

    def render(self, text: str, turn_ended_with_eos: bool) -> list[int]:
        base = self.tokenizer.apply_chat_template(self._base(), add_generation_prompt=False, tokenize=False)
        full = self.tokenizer.apply_chat_template(
            [*self._base(), {"role": self.role, "content": text}], add_generation_prompt=True, tokenize=False
        )
        if not full.startswith(base):
            raise ValueError(
                "the student's chat template renders a conversation's start differently once a message follows; "
                "multi-turn rollouts need a template that appends each message"
            )
        end_of_turn = base[base.index(self._MARK) + len(self._MARK) :]
        if turn_ended_with_eos and self.eos_text and end_of_turn.startswith(self.eos_text):
            end_of_turn = end_of_turn[len(self.eos_text) :]
        ids = self.tokenizer(end_of_turn + full[len(base) :], add_special_tokens=False)["input_ids"]
        return [int(t) for t in ids]


class Episodes:
    """Runs a Sample as a multi-turn trace against its environment (module docstring)."""

    def __init__(
        self,
        spec: DistillationJobSpec,
        tokenizer: Tokenizer,
        environments: EnvironmentsLike,
        rewards: RewardRegistry,
        metrics: RoleMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        turn_tokens: int | None = None,
    ):
        """`turn_tokens`: one turn's budget where it is not sampling.maxTokens (held-out
        evaluation's maxTokens)."""
        multi = spec.rollout.multi_turn
        if multi is None:
            raise ValueError("Episodes needs spec.rollout.multiTurn")
        self.spec = spec
        self.max_turns = multi.max_turns
        self.turn_tokens = turn_tokens or spec.rollout.sampling.max_tokens
        self.trace_tokens = spec.max_trace_tokens
        """The response budget of a whole trace (Sample.max_tokens of its samples)."""
        self.tokenizer = tokenizer
        self.environments = environments
        self.rewards = rewards
        self.metrics = metrics
        self.clock = clock
        eos_id = getattr(tokenizer, "eos_token_id", None)
        self.eos_id: int | None = eos_id
        eos_text = getattr(tokenizer, "eos_token", None)
        self.renderer = ObservationRenderer(tokenizer, multi.observation_role.value, eos_text)
        if metrics is not None:  # every series exported from the start, at 0 until it happens
            for env in spec.environments:
                for reason in REASONS:
                    metrics["env_errors"].labels(environment=env.name, reason=reason).inc(0)
            for kind in ("student", "observation"):
                metrics["loss_tokens"].labels(kind=kind).inc(0)

    @classmethod
    def for_job(
        cls,
        spec: DistillationJobSpec,
        tokenizer: Tokenizer,
        environments: EnvironmentsLike | None,
        rewards: RewardRegistry,
        metrics: RoleMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        vision: bool = False,
    ) -> Episodes | None:
        """The job's traces; None for a single-turn job. `vision`: the student reads images."""
        if spec.rollout.multi_turn is None:
            return None
        if vision:  # observations are rendered as text, and held-out traces carry no images
            raise ValueError(
                f"spec.rollout.multiTurn: multi-turn traces are text-only, and the student {spec.student.model} "
                "is a vision-language model; distill it single-turn"
            )
        if environments is None:
            raise ValueError("spec.rollout.multiTurn needs the environments' endpoints (endpoints.environments)")
        return cls(spec, tokenizer, environments, rewards, metrics, clock)

    async def run(self, s: Sample, generate_turn: Callable[[Sample], Awaitable[None]], seed: int | None) -> None:
        """Generate `s` as a trace; sets its reward (the environment's, else the row's reward
        function on the final turn). `generate_turn` runs /generate continuations until the turn
        ends and raises TraceRestart when the trace must start over."""
        env = self.spec.environment_for(s.route_value)
        while True:
            if s.response_ids:  # a trace restored from a checkpoint: its episode is gone
                s.restart()
            try:
                await self._trace(s, env.name, generate_turn, seed)
                break
            except TraceRestart:
                s.restart()
        self._count(s, env.name)
        if s.env_reward is not None:
            s.reward = s.env_reward
        else:
            self.rewards.score_sample(s, self._decode(s, self._last_turn(s)))

    async def _trace(
        self, s: Sample, env: str, generate_turn: Callable[[Sample], Awaitable[None]], seed: int | None
    ) -> None:
        episode = await self._call(s, env, lambda: self.environments.open(env, seed))
        if episode is None:  # no episode: the student's first turn is the whole trace
            s.turn_end = min(self.turn_tokens, s.max_tokens)
            await generate_turn(s)
            s.turns, s.turn_end = 1, None
            return
        try:
            while True:
                s.turn_end = min(len(s.response_ids) + self.turn_tokens, s.max_tokens)
                start = len(s.response_ids)
                await generate_turn(s)
                s.turns += 1
                if len(s.response_ids) >= s.max_tokens or s.turns >= self.max_turns:
                    return
                turn = s.response_ids[start:]
                action = self._decode(s, (start, len(s.response_ids)))
                step = await self._call(s, env, functools.partial(episode.step, action))
                if step is None:
                    return
                if step.reward is not None:
                    s.env_reward = (s.env_reward or 0.0) + float(step.reward)
                if step.done:
                    return
                ended_with_eos = bool(turn) and turn[-1] == self.eos_id
                ids = self.renderer.render(step.observation_text, ended_with_eos)
                if len(s.response_ids) + len(ids) >= s.max_tokens:  # no room for another turn
                    return
                s.add_observation(ids)
        finally:
            s.turn_end = None
            await self._close(episode)

    async def _call(self, s: Sample, env: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        """An environment call, timed; None (the reason recorded on the sample) when it failed."""
        t0 = self.clock()
        try:
            return await fn()
        except EpisodeFailed as e:
            s.env_error = e.reason
            log.warning("environment %s ended trace %s: %s", env, s.sample_id, e)
            if self.metrics is not None:
                self.metrics["env_errors"].labels(environment=env, reason=e.reason).inc()
            return None
        finally:
            if self.metrics is not None:
                self.metrics["env_call_seconds"].labels(environment=env).observe(self.clock() - t0)

    async def _close(self, episode: EpisodeLike) -> None:
        try:
            await episode.close()
        except EpisodeFailed as e:  # the trace is complete; a session that fails to close is the server's
            log.debug("closing an episode failed: %s", e)

    def _count(self, s: Sample, env: str) -> None:
        if self.metrics is None:
            return
        self.metrics["env_turns"].labels(environment=env).observe(s.turns)
        own = len(s.response_ids) - sum(end - start for start, end in s.observation_spans)
        self.metrics["loss_tokens"].labels(kind="student").inc(own)
        self.metrics["loss_tokens"].labels(kind="observation").inc(len(s.response_ids) - own)

    @staticmethod
    def _last_turn(s: Sample) -> tuple[int, int]:
        start = s.observation_spans[-1][1] if s.observation_spans else 0
        return start, len(s.response_ids)

    def _decode(self, s: Sample, span: tuple[int, int]) -> str:
        return self.tokenizer.decode(s.response_ids[span[0] : span[1]], skip_special_tokens=True)
