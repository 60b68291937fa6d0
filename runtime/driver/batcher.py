"""The batcher: turns the groups one train step takes from the SampleBuffer into that step's
mini-batches. GRPO groups stay whole (miniBatchSize is a multiple of rollout.sampling.samplesPerPrompt), and a
sample the loss cannot use (lacking a signal of the loss contract when distilling, no reward when
task rewards are on, token arrays of unequal length) is refused with a message naming it, once,
as its TrainBatch is built.

Output: `StepSamples`, `requireBatches` mini-batches of `miniBatchSize` samples each, in group
order; `to_train_batch` turns samples into the trainer's BatchParts (runtime/wire/batch.py): each
sample's arrays, made once as its group entered the buffer (`prepare`). A group with images (a
vision-language student) gets its image arrays there too, once for all its samples, through the
student's image processor (runtime/driver/pixels.py); a group restored from a checkpoint gets
them when its step is assembled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from kubedistill.api.losses import CONTRACTS, SIGNAL_NAMES, TOKEN_SIGNALS, LossContract, active_contract
from kubedistill.api.spec import DistillationJobSpec, LossMode
from kubedistill.runtime.driver.pixels import StudentImages
from kubedistill.runtime.driver.samples import Sample, SampleGroup, SignalValues
from kubedistill.runtime.wire.batch import BatchParts, SampleArrays, SampleImages, pack_sample
from kubedistill.runtime.wire.rows import Rows, row_lengths

T = TypeVar("T")


@dataclass(frozen=True)
class BatchRequirements:
    """What every sample of a train batch must carry."""

    group_size: int
    mini_batch_size: int
    require_batches: int = 1
    contract: LossContract | None = CONTRACTS[LossMode.k3]
    """The loss contract whose signals every sample carries; None with distillation disabled."""
    top_k: int = 32
    """The widest top-k row the contract's top-k pair may have (algorithm.distillation.topK)."""
    rewards: bool = False
    """Task rewards in the loss: a reward on every sample."""
    images: StudentImages | None = field(default=None, compare=False, repr=False)
    """The student's image processor, for samples with images (None: such samples are refused)."""

    @classmethod
    def from_spec(cls, spec: DistillationJobSpec) -> BatchRequirements:
        d = spec.algorithm.distillation
        return cls(
            group_size=spec.rollout.sampling.samples_per_prompt,
            mini_batch_size=spec.trainer.mini_batch_size,
            require_batches=spec.async_settings.require_batches,
            contract=active_contract(d),
            top_k=d.top_k,
            rewards=d.use_task_rewards,
            images=StudentImages(spec.student.model, spec.student.trust_remote_code),
        )

    @property
    def teacher_scores(self) -> bool:
        """Every sample goes to a teacher."""
        return self.contract is not None

    @property
    def rollout_top_k(self) -> int:
        """The top-k ids a /generate request asks the rollout for (0: none)."""
        return self.contract.rollout_k(self.top_k) if self.contract is not None else 0

    @property
    def teacher_top_k(self) -> int:
        """The top-k rows a /score request asks the teacher for (0: the sampled tokens' only)."""
        return self.contract.teacher_k(self.top_k) if self.contract is not None else 0

    def gather_ids(self, s: Sample) -> Rows | None:
        """The ids a /score request asks the teacher to score at each position (None: none)."""
        c = self.contract
        if c is None or not c.teacher_gather or c.top_k is None:
            return None
        rows = s.signal(c.top_k.ids)
        return None if rows is None else Rows.of(rows, "int32")

    @property
    def step_samples(self) -> int:
        return self.mini_batch_size * self.require_batches


@dataclass
class StepSamples:
    """The samples of one train step, split into its mini-batches."""

    trainer_version: int
    minibatches: list[list[Sample]]
    images: dict[int, list[str]] = field(default_factory=dict)
    """The base64 images of the groups that have any, by group id."""

    @property
    def samples(self) -> list[Sample]:
        return [s for mb in self.minibatches for s in mb]

    def train_batches(self, req: BatchRequirements) -> list[BatchParts]:
        """One batch per mini-batch."""
        return [to_train_batch(mb, req, self.trainer_version, self.images) for mb in self.minibatches]

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
    c = req.contract
    if c is not None:
        for name in c.signals:
            values = s.signal(name)
            if name in TOKEN_SIGNALS and (values is None or len(values) != t):
                got = None if values is None else len(values)
                raise ValueError(f"{where}: {SIGNAL_NAMES[name]} for {got} of {t} response tokens")
        if c.top_k is not None:
            ids, logprobs = s.signal(c.top_k.ids), s.signal(c.top_k.logprobs)
            if ids is None or logprobs is None or len(ids) != t or len(logprobs) != t:
                raise ValueError(
                    f"{where}: {c.top_k.label} ids or teacher log-probs missing or not one row per response token"
                )
    if req.rewards and s.reward is None:
        raise ValueError(f"{where} has no task reward (useTaskRewards is on)")


def _check_top_k_rows(
    where: str,
    what: str,
    ids: Sequence[Sequence[int]] | np.ndarray,
    logprobs: Sequence[Sequence[float]] | np.ndarray,
    k: int,
) -> None:
    """Every top-k row has 1..k ids and as many log-probs: a check per row, so it runs once per
    sample, as its arrays are made (sample_arrays), not at every step."""
    # A vocabulary smaller than topK gives shorter rows; the trainer masks the rest.
    a, b = row_lengths(ids), row_lengths(logprobs)
    bad = np.flatnonzero((a < 1) | (a > k) | (a != b))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: {what} row {i} has {a[i]} ids and {b[i]} log-probs (need 1..topK={k}, equal)")


def assemble(groups: Sequence[SampleGroup], req: BatchRequirements, trainer_version: int) -> StepSamples:
    """One step's mini-batches from whole groups (as SampleBuffer.take returns them); each sample
    is checked as its batch is built (to_train_batch)."""
    for g in groups:
        if len(g) != req.group_size:
            raise ValueError(
                f"group {g.group_id} has {len(g)} samples, rollout.sampling.samplesPerPrompt is {req.group_size}"
            )
    flat = [s for g in groups for s in g.samples]
    if len(flat) != req.step_samples:
        raise ValueError(f"a step needs requireBatches x miniBatchSize = {req.step_samples} samples, got {len(flat)}")
    mb = req.mini_batch_size
    images = {g.group_id: g.images for g in groups if g.images}
    return StepSamples(trainer_version, [flat[i : i + mb] for i in range(0, len(flat), mb)], images)


def sample_arrays(s: Sample, req: BatchRequirements, images: SampleImages | None = None) -> SampleArrays:
    """The arrays of what the trainer reads of `s` (ids, behaviour log-probs, the contract's
    signals, its `images` when it has any), made once and kept on the sample until its token data
    changes; its top-k rows are checked as they are made. Call after check_sample."""
    c = req.contract
    names = [n.value for n in c.signals] if c is not None else []
    a = s.arrays
    if images is None and a is not None:
        images = a.images  # the prompt, hence its images, never changes with the token data
    if a is None or a.response_len != len(s.response_ids) or list(a.signals) != names:
        signals = {n: _signal(s, n) for n in names}
        if c is not None and c.top_k is not None:
            where = f"sample {s.sample_id} (data_source {s.data_source!r})"
            pair = c.top_k
            _check_top_k_rows(where, pair.label, signals[pair.ids.value], signals[pair.logprobs.value], req.top_k)
        a = s.arrays = pack_sample(
            s.prompt_ids,
            len(s.prompt_ids),
            s.logprobs,
            signals,
            response_ids=s.response_ids,
            weight_version=s.min_version,
            loss_mask=s.loss_mask(),
        )
    if images is not None:
        a.images = images
    return a


def image_arrays(s: Sample, images: Sequence[str], req: BatchRequirements) -> SampleImages:
    """The arrays of a sample's images (base64), checked against its prompt's image pad tokens."""
    where = f"sample {s.sample_id} (data_source {s.data_source!r})"
    if req.images is None:
        raise ValueError(f"{where} has images but the batch has no image processor (BatchRequirements.images)")
    return req.images.encode(images, s.prompt_ids, where)


def prepare(group: SampleGroup, req: BatchRequirements) -> None:
    """Make the arrays of a group's samples as it enters the buffer, so a train step only
    concatenates them. A sample the loss cannot use is left alone: to_train_batch refuses it
    with the whole story. The group's images are processed once, for all its samples."""
    images: SampleImages | None = None
    for s in group.samples:
        try:
            check_sample(s, req)
            if group.images and images is None:
                images = image_arrays(s, group.images, req)
            sample_arrays(s, req, images)
        except ValueError:
            continue


def to_train_batch(
    samples: Sequence[Sample],
    req: BatchRequirements,
    trainer_version: int | None = None,
    images: Mapping[int, Sequence[str]] | None = None,
) -> BatchParts:
    """The trainer's batch of these samples: prompt + response ids, behaviour log-probs, the
    signals of the loss contract and the rewards the loss needs, each sample's oldest weight
    version, and the image arrays of the samples whose group has `images` (base64 by group id;
    made here for a sample that missed `prepare`, e.g. restored from a checkpoint). The one check
    of the samples (check_sample); the batch is consistent by construction."""
    for s in samples:
        check_sample(s, req)
    made: dict[int, SampleImages] = {}
    arrays = []
    for s in samples:
        group_images = images.get(s.group_id) if images is not None else None
        mine = None
        if group_images and (s.arrays is None or s.arrays.images is None):
            if s.group_id not in made:
                made[s.group_id] = image_arrays(s, group_images, req)
            mine = made[s.group_id]
        arrays.append(sample_arrays(s, req, mine))
    return BatchParts(
        arrays,
        rewards=[float(_checked(s.reward, s, "task reward")) for s in samples] if req.rewards else None,
        group_ids=[s.group_id for s in samples] if req.rewards else None,
        weight_versions=[_checked(a.weight_version, s, "tokens") for a, s in zip(arrays, samples)],
        trainer_version=trainer_version,
    )


def _checked(value: T | None, s: Sample, what: str) -> T:
    """A field check_sample found present (it raises first, with the full story)."""
    if value is None:
        raise _missing(s, what)
    return value


def _signal(s: Sample, name: str) -> SignalValues:
    """A signal check_sample found present (it raises first, with the full story)."""
    values = s.signals.get(name)
    if values is None:
        raise _missing(s, name)
    return values


def _missing(s: Sample, what: str) -> ValueError:
    return ValueError(f"sample {s.sample_id} (data_source {s.data_source!r}) has no {what}")
