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
* ``rewards[i]`` and ``group_ids[i]``: the task reward and the prompt group (samples of one
  prompt share a group id); needed by GRPO (useTaskRewards).
* ``weight_versions[i]``: the oldest weight version that produced any of the sample's tokens
  (for staleness metrics; the loss corrects staleness through ``rollout_logprobs``).

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
    rewards: list[float] | None = None
    group_ids: list[int] | None = None
    weight_versions: list[int] = field(default_factory=list)

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
        if (self.rewards is None) != (self.group_ids is None):
            raise ValueError("TrainBatch.rewards and group_ids must be given together")
        for i in range(n):
            p, total = self.prompt_lens[i], len(self.token_ids[i])
            if not 1 <= p < total:
                raise ValueError(f"TrainBatch.prompt_lens[{i}]: {p} must be >= 1 and < the sample's {total} tokens")
            r = total - p
            for name in ("rollout_logprobs", "teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs"):
                values = getattr(self, name)
                if values is not None and len(values[i]) != r:
                    raise ValueError(
                        f"TrainBatch.{name}[{i}]: has {len(values[i])} entries, expected {r} response tokens"
                    )
            if self.teacher_topk_ids is not None and self.teacher_topk_logprobs is not None:
                for t, (ids, lps) in enumerate(zip(self.teacher_topk_ids[i], self.teacher_topk_logprobs[i])):
                    if len(ids) != len(lps) or not ids:
                        raise ValueError(
                            f"TrainBatch.teacher_topk_ids[{i}][{t}]: needs >= 1 id and as many log-probs "
                            f"({len(ids)} vs {len(lps)})"
                        )
