"""TrainBatch: what the driver hands the trainer for one step.

The driver (trainer rank 0) fills one ``TrainBatch`` per train step from finished, scored samples
and calls ``Trainer.step(batch)``. Per sample i:

* ``token_ids[i]``: prompt + response token ids; ``prompt_lens[i]``: how many are prompt.
  The response is ``token_ids[i][prompt_lens[i]:]`` (R_i = len - prompt_len >= 1 tokens).
* ``rollout_logprobs[i]``: the rollout engine's log-prob of each response token (behaviour
  policy mu, length R_i).
* ``teacher_logprobs[i]``: the teacher's log-prob of each response token (length R_i); needed by
  k1/k3.
* ``teacher_topk_ids[i]`` / ``teacher_topk_logprobs[i]``: ``R_i`` rows of k ids / log-probs (k =
  spec.algorithm.distillation.topK); needed by forwardKLTopK. Rows may be shorter than k (a
  small vocabulary); missing slots are padded internally and masked.
* ``rollout_topk_ids[i]`` / ``teacher_logprobs_at_rollout_topk[i]``: ``R_i`` rows of the
  rollout's (student's) top-k ids and the teacher's log-probs at them; needed by reverseKLTopK.
* ``rewards[i]`` and ``group_ids[i]``: the task reward and the prompt group (samples of one
  prompt share a group id); needed by GRPO (useTaskRewards).
* ``weight_versions[i]``: the oldest weight version that produced any of the sample's tokens
  (for staleness metrics; the loss corrects staleness through ``rollout_logprobs``).
* ``trainer_version``: the trainer's weight version when the step was assembled, so the trainer
  can report its log-probs against the rollout's per version lag (0: the same weights).

Plain Python lists keep it picklable and cheap to build; the trainer turns them into tensors.
Rank 0 broadcasts the whole batch (pickled) to the other trainer ranks, which then take their
share of the samples (see :mod:`kubedistill.runtime.trainer`).
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass, field


@dataclass
class TrainBatch:
    token_ids: list[list[int]]
    prompt_lens: list[int]
    rollout_logprobs: list[list[float]]
    teacher_logprobs: list[list[float]] | None = None
    teacher_topk_ids: list[list[list[int]]] | None = None
    teacher_topk_logprobs: list[list[list[float]]] | None = None
    rollout_topk_ids: list[list[list[int]]] | None = None
    teacher_logprobs_at_rollout_topk: list[list[list[float]]] | None = None
    rewards: list[float] | None = None
    group_ids: list[int] | None = None
    weight_versions: list[int] = field(default_factory=list)
    trainer_version: int | None = None

    def lag(self, i: int) -> int | None:
        """How many weight versions sample i's oldest token lags the trainer (None: unknown)."""
        if self.trainer_version is None or not self.weight_versions:
            return None
        return self.trainer_version - self.weight_versions[i]

    def top_k_scores(self) -> tuple[list[list[list[int]]], list[list[list[float]]]] | None:
        """The ids a top-k loss sums over at each position and the teacher's log-probs at them: the
        rollout's top-k (reverseKLTopK) or the teacher's (forwardKLTopK); None without either."""
        if self.rollout_topk_ids is not None and self.teacher_logprobs_at_rollout_topk is not None:
            return self.rollout_topk_ids, self.teacher_logprobs_at_rollout_topk
        if self.teacher_topk_ids is not None and self.teacher_topk_logprobs is not None:
            return self.teacher_topk_ids, self.teacher_topk_logprobs
        return None

    def __len__(self) -> int:
        return len(self.token_ids)

    def response_len(self, i: int) -> int:
        return len(self.token_ids[i]) - self.prompt_lens[i]

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field (one line, no traceback noise)."""
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("TrainBatch.token_ids: the batch has no samples")
        per_sample: dict[str, Sized | None] = {
            "prompt_lens": self.prompt_lens,
            "rollout_logprobs": self.rollout_logprobs,
            "teacher_logprobs": self.teacher_logprobs,
            "teacher_topk_ids": self.teacher_topk_ids,
            "teacher_topk_logprobs": self.teacher_topk_logprobs,
            "rollout_topk_ids": self.rollout_topk_ids,
            "teacher_logprobs_at_rollout_topk": self.teacher_logprobs_at_rollout_topk,
            "rewards": self.rewards,
            "group_ids": self.group_ids,
        }
        if self.weight_versions:
            per_sample["weight_versions"] = self.weight_versions
        for name, values in per_sample.items():
            if values is not None and len(values) != n:
                raise ValueError(f"TrainBatch.{name}: has {len(values)} entries, expected one per sample ({n})")
        if (self.teacher_topk_ids is None) != (self.teacher_topk_logprobs is None):
            raise ValueError("TrainBatch.teacher_topk_ids and teacher_topk_logprobs must be given together")
        if (self.rollout_topk_ids is None) != (self.teacher_logprobs_at_rollout_topk is None):
            raise ValueError("TrainBatch.rollout_topk_ids and teacher_logprobs_at_rollout_topk must be given together")
        if self.teacher_topk_ids is not None and self.rollout_topk_ids is not None:
            raise ValueError("TrainBatch.teacher_topk_ids and rollout_topk_ids: one top-k loss per batch, give one")
        if (self.rewards is None) != (self.group_ids is None):
            raise ValueError("TrainBatch.rewards and group_ids must be given together")
        for i in range(n):
            p, total = self.prompt_lens[i], len(self.token_ids[i])
            if not 1 <= p < total:
                raise ValueError(f"TrainBatch.prompt_lens[{i}]: {p} must be >= 1 and < the sample's {total} tokens")
            r = total - p
            for name in (
                "rollout_logprobs",
                "teacher_logprobs",
                "teacher_topk_ids",
                "teacher_topk_logprobs",
                "rollout_topk_ids",
                "teacher_logprobs_at_rollout_topk",
            ):
                values = getattr(self, name)
                if values is not None and len(values[i]) != r:
                    raise ValueError(
                        f"TrainBatch.{name}[{i}]: has {len(values[i])} entries, expected {r} response tokens"
                    )
            scored = self.top_k_scores()
            if scored is not None:
                name = "rollout_topk_ids" if self.rollout_topk_ids is not None else "teacher_topk_ids"
                for t, (ids, lps) in enumerate(zip(scored[0][i], scored[1][i])):
                    if len(ids) != len(lps) or not ids:
                        raise ValueError(
                            f"TrainBatch.{name}[{i}][{t}]: needs >= 1 id and as many log-probs "
                            f"({len(ids)} vs {len(lps)})"
                        )
