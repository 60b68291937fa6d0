"""TrainBatch: what the driver hands the trainer for one step.

The driver (trainer rank 0) fills one ``TrainBatch`` per train step from finished, scored samples
and calls ``Trainer.step(batch)``. Per sample i:

* ``token_ids[i]``: prompt + response token ids; ``prompt_lens[i]``: how many are prompt.
  The response is ``token_ids[i][prompt_lens[i]:]`` (R_i = len - prompt_len >= 1 tokens).
* ``rollout_logprobs[i]``: the rollout engine's log-prob of each response token (behaviour
  policy mu, length R_i).
* ``signals[name][i]``: what the loss reads of sample i, keyed by the loss contract's signal
  names (kubedistill.api.losses.Signal): one entry per response token (length R_i), a float
  (``teacher_logprobs``) or a row of top-k ids or log-probs (``teacher_topk_ids`` /
  ``teacher_topk_logprobs`` of forwardKLTopK, ``rollout_topk_ids`` /
  ``teacher_logprobs_at_rollout_topk`` of reverseKLTopK). Rows may be shorter than
  spec.algorithm.distillation.topK (a small vocabulary); missing slots are padded internally and
  masked.
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
from typing import Any

from kubedistill.api.losses import SIGNAL_NAMES, LossContract, Signal, TopKSignals


@dataclass
class TrainBatch:
    token_ids: list[list[int]]
    prompt_lens: list[int]
    rollout_logprobs: list[list[float]]
    signals: dict[str, list[list[Any]]] = field(default_factory=dict)
    rewards: list[float] | None = None
    group_ids: list[int] | None = None
    weight_versions: list[int] = field(default_factory=list)
    trainer_version: int | None = None

    def lag(self, i: int) -> int | None:
        """How many weight versions sample i's oldest token lags the trainer (None: unknown)."""
        if self.trainer_version is None or not self.weight_versions:
            return None
        return self.trainer_version - self.weight_versions[i]

    def signal(self, name: Signal) -> list[list[Any]] | None:
        return self.signals.get(name.value)

    def top_k_scores(self, pair: TopKSignals | None) -> tuple[list[list[list[int]]], list[list[list[float]]]] | None:
        """The ids a top-k loss sums over at each position and the teacher's log-probs at them (the
        loss contract's `pair`); None without it."""
        if pair is None:
            return None
        ids, logprobs = self.signal(pair.ids), self.signal(pair.logprobs)
        if ids is None or logprobs is None:
            return None
        return ids, logprobs

    def __len__(self) -> int:
        return len(self.token_ids)

    def response_len(self, i: int) -> int:
        return len(self.token_ids[i]) - self.prompt_lens[i]

    def validate(self, contract: LossContract | None = None, *, rewards: bool = False) -> None:
        """Raise ValueError naming the first inconsistent field (one line, no traceback noise),
        or the first signal `contract` needs that the batch lacks (and rewards, when `rewards`)."""
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("TrainBatch.token_ids: the batch has no samples")
        if contract is not None:
            for needed in contract.signals:
                if needed.value not in self.signals:
                    raise ValueError(
                        f"TrainBatch.signals[{needed.value!r}]: lossMode {contract.mode.value} needs "
                        f"{SIGNAL_NAMES[needed]}"
                    )
        if rewards and (self.rewards is None or self.group_ids is None):
            raise ValueError(
                "TrainBatch.rewards/group_ids: required when algorithm.distillation.useTaskRewards is true"
            )
        per_sample: dict[str, Sized | None] = {
            "prompt_lens": self.prompt_lens,
            "rollout_logprobs": self.rollout_logprobs,
            **{f"signals[{name!r}]": values for name, values in self.signals.items()},
            "rewards": self.rewards,
            "group_ids": self.group_ids,
        }
        if self.weight_versions:
            per_sample["weight_versions"] = self.weight_versions
        for name, values in per_sample.items():
            if values is not None and len(values) != n:
                raise ValueError(f"TrainBatch.{name}: has {len(values)} entries, expected one per sample ({n})")
        unknown = set(self.signals) - {s.value for s in Signal}
        if unknown:
            raise ValueError(f"TrainBatch.signals: unknown signals {sorted(unknown)}")
        if (self.rewards is None) != (self.group_ids is None):
            raise ValueError("TrainBatch.rewards and group_ids must be given together")
        pair = contract.top_k if contract is not None else None
        for i in range(n):
            p, total = self.prompt_lens[i], len(self.token_ids[i])
            if not 1 <= p < total:
                raise ValueError(f"TrainBatch.prompt_lens[{i}]: {p} must be >= 1 and < the sample's {total} tokens")
            r = total - p
            per_token = {"rollout_logprobs": self.rollout_logprobs} | {
                f"signals[{name!r}]": values for name, values in self.signals.items()
            }
            for name, values in per_token.items():
                if len(values[i]) != r:
                    raise ValueError(
                        f"TrainBatch.{name}[{i}]: has {len(values[i])} entries, expected {r} response tokens"
                    )
            scored = self.top_k_scores(pair)
            if pair is not None and scored is not None:
                for t, (ids, lps) in enumerate(zip(scored[0][i], scored[1][i])):
                    if len(ids) != len(lps) or not ids:
                        raise ValueError(
                            f"TrainBatch.signals[{pair.ids.value!r}][{i}][{t}]: needs >= 1 id and as many "
                            f"log-probs ({len(ids)} vs {len(lps)})"
                        )
