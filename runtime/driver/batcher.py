"""The batcher: turns the groups one train step takes from the SampleBuffer into that step's
mini-batches. GRPO groups stay whole (miniBatchSize is a multiple of rollout.sampling.samplesPerPrompt), and a
sample the loss cannot use (no teacher scores when distilling, no reward when task rewards are
on, token arrays of unequal length) is refused with a message naming it.

Output: `StepSamples`, `requireBatches` mini-batches of `miniBatchSize` samples each, in group
order; `to_train_batch` turns samples into the trainer's TrainBatch (runtime/wire/batch.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from kubedistill.api.spec import DistillationJobSpec, LossMode
from kubedistill.runtime.driver.samples import Sample, SampleGroup
from kubedistill.runtime.wire.batch import TrainBatch

T = TypeVar("T")


@dataclass(frozen=True)
class BatchRequirements:
    """What every sample of a train batch must carry."""

    group_size: int
    mini_batch_size: int
    require_batches: int = 1
    teacher_scores: bool = True
    """Distillation on: teacher log-probs for every response token."""
    top_k: int = 0
    """forwardKLTopK: teacher top-k rows (1..top_k entries) at every position (0: not needed)."""
    rewards: bool = False
    """Task rewards in the loss: a reward on every sample."""
    rollout_top_k: int = 0
    """reverseKLTopK: the rollout's top-k ids at every position and the teacher's log-probs at
    them (0: not needed)."""

    @classmethod
    def from_spec(cls, spec: DistillationJobSpec) -> BatchRequirements:
        d = spec.algorithm.distillation
        a = spec.async_
        return cls(
            group_size=spec.rollout.sampling.samples_per_prompt,
            mini_batch_size=spec.trainer.mini_batch_size,
            require_batches=a.require_batches if a is not None else 1,
            teacher_scores=d.enabled,
            top_k=d.top_k if d.enabled and d.loss_mode is LossMode.forward_kl_top_k else 0,
            rewards=d.use_task_rewards,
            rollout_top_k=d.top_k if d.enabled and d.loss_mode is LossMode.reverse_kl_top_k else 0,
        )

    @property
    def step_samples(self) -> int:
        return self.mini_batch_size * self.require_batches


@dataclass
class StepSamples:
    """The samples of one train step, split into its mini-batches."""

    trainer_version: int
    minibatches: list[list[Sample]]

    @property
    def samples(self) -> list[Sample]:
        return [s for mb in self.minibatches for s in mb]

    def train_batches(self, req: BatchRequirements) -> list[TrainBatch]:
        """One TrainBatch per mini-batch."""
        return [to_train_batch(mb, req, self.trainer_version) for mb in self.minibatches]

    def staleness(self) -> list[int]:
        """trainer_version - min_version of each sample."""
        return [
            self.trainer_version - (s.min_version if s.min_version is not None else self.trainer_version)
            for s in self.samples
        ]


def check_sample(s: Sample, req: BatchRequirements) -> None:
    where = f"sample {s.sample_id} (data_source {s.data_source!r})"
    if not s.finished:
        raise ValueError(f"{where} is not finished (finish_reason {s.finish_reason!r})")
    t = len(s.response_ids)
    if t == 0:
        raise ValueError(f"{where} has an empty response")
    if len(s.logprobs) != t or len(s.versions) != t:
        raise ValueError(f"{where}: {t} tokens but {len(s.logprobs)} log-probs and {len(s.versions)} versions")
    if req.teacher_scores:
        if s.teacher_logprobs is None or len(s.teacher_logprobs) != t:
            got = None if s.teacher_logprobs is None else len(s.teacher_logprobs)
            raise ValueError(f"{where}: teacher log-probs for {got} of {t} response tokens")
        if req.top_k:
            _check_top_k(where, "teacher top-k", s.teacher_topk_ids, s.teacher_topk_logprobs, t, req.top_k)
        if req.rollout_top_k:
            _check_top_k(
                where,
                "rollout top-k",
                s.rollout_topk_ids,
                s.teacher_logprobs_at_rollout_topk,
                t,
                req.rollout_top_k,
            )
    if req.rewards and s.reward is None:
        raise ValueError(f"{where} has no task reward (useTaskRewards is on)")


def _check_top_k(
    where: str,
    what: str,
    ids: Sequence[Sequence[int]] | None,
    logprobs: Sequence[Sequence[float]] | None,
    tokens: int,
    k: int,
) -> None:
    if ids is None or logprobs is None or len(ids) != tokens or len(logprobs) != tokens:
        raise ValueError(f"{where}: {what} ids or teacher log-probs missing or not one row per response token")
    for i, (a, b) in enumerate(zip(ids, logprobs)):
        # A vocabulary smaller than topK gives shorter rows; TrainBatch masks the rest.
        if not 1 <= len(a) <= k or len(a) != len(b):
            raise ValueError(
                f"{where}: {what} row {i} has {len(a)} ids and {len(b)} log-probs (need 1..topK={k}, equal)"
            )


def assemble(groups: Sequence[SampleGroup], req: BatchRequirements, trainer_version: int) -> StepSamples:
    """One step's mini-batches from whole groups (as SampleBuffer.take returns them)."""
    for g in groups:
        if len(g) != req.group_size:
            raise ValueError(
                f"group {g.group_id} has {len(g)} samples, rollout.sampling.samplesPerPrompt is {req.group_size}"
            )
        for s in g.samples:
            check_sample(s, req)
    flat = [s for g in groups for s in g.samples]
    if len(flat) != req.step_samples:
        raise ValueError(f"a step needs requireBatches x miniBatchSize = {req.step_samples} samples, got {len(flat)}")
    mb = req.mini_batch_size
    return StepSamples(trainer_version, [flat[i : i + mb] for i in range(0, len(flat), mb)])


def to_train_batch(samples: Sequence[Sample], req: BatchRequirements, trainer_version: int | None = None) -> TrainBatch:
    """The trainer's batch of these samples: prompt + response ids, behaviour log-probs, the
    teacher scores and rewards the loss needs, and each sample's oldest weight version."""
    for s in samples:
        check_sample(s, req)
    batch = TrainBatch(
        token_ids=[list(s.prompt_ids) + list(s.response_ids) for s in samples],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        rollout_logprobs=[list(s.logprobs) for s in samples],
        teacher_logprobs=(
            [list(_checked(s.teacher_logprobs, s, "teacher log-probs")) for s in samples]
            if req.teacher_scores
            else None
        ),
        teacher_topk_ids=(
            [list(_checked(s.teacher_topk_ids, s, "teacher top-k")) for s in samples] if req.top_k else None
        ),
        teacher_topk_logprobs=(
            [list(_checked(s.teacher_topk_logprobs, s, "teacher top-k")) for s in samples] if req.top_k else None
        ),
        rollout_topk_ids=(
            [list(_checked(s.rollout_topk_ids, s, "rollout top-k")) for s in samples] if req.rollout_top_k else None
        ),
        teacher_logprobs_at_rollout_topk=(
            [list(_checked(s.teacher_logprobs_at_rollout_topk, s, "teacher scores of the top-k")) for s in samples]
            if req.rollout_top_k
            else None
        ),
        rewards=[float(_checked(s.reward, s, "task reward")) for s in samples] if req.rewards else None,
        group_ids=[s.group_id for s in samples] if req.rewards else None,
        weight_versions=[_checked(s.min_version, s, "tokens") for s in samples],
        trainer_version=trainer_version,
    )
    batch.validate()
    return batch


def _checked(value: T | None, s: Sample, what: str) -> T:
    """A field check_sample found present (it raises first, with the full story)."""
    if value is None:
        raise ValueError(f"sample {s.sample_id} (data_source {s.data_source!r}) has no {what}")
    return value
