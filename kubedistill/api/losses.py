"""One contract per loss mode: what a `lossMode` reads, asks the servers for and allows.

The batcher, the engine factory, the trainer (its batch check, its baseline and its micro-batch
tensors) and the API's rules read a mode's needs here rather than deriving them from the enum
again; the per-token function of each mode is registered beside the torch losses
(kubedistill.runtime.trainer.losses.PER_TOKEN_TERMS). Adding a loss is one `LossMode` value, one
`LossContract` in `CONTRACTS`, one per-token function and its tests.

Pure data, no torch: the operator image imports it through the API's rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING

from kubedistill.api.enums import LossMode

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kubedistill.api.spec import DistillationSpec


class Signal(str, Enum):
    """A per-token signal a sample and a TrainBatch carry, keyed by its value.

    Every signal has one entry per response token: a float (`TOKEN_SIGNALS`) or a row of up to
    topK values. The rollout's own log-probs (the behaviour policy) and the task rewards are not
    signals: every batch has the former, and the latter follow useTaskRewards, not the loss mode.
    """

    teacher_logprobs = "teacher_logprobs"
    """The teacher's log-prob of each sampled token (T_t); also the step's reported KL."""
    teacher_topk_ids = "teacher_topk_ids"
    """The teacher's top-k ids at each position (K_t)."""
    teacher_topk_logprobs = "teacher_topk_logprobs"
    """The teacher's log-probs at teacher_topk_ids, row for row."""
    rollout_topk_ids = "rollout_topk_ids"
    """The rollout's (student's) top-k ids at each position (S_t)."""
    teacher_logprobs_at_rollout_topk = "teacher_logprobs_at_rollout_topk"
    """The teacher's log-probs at rollout_topk_ids, row for row (the teacher's gather)."""


TOKEN_SIGNALS: frozenset[Signal] = frozenset({Signal.teacher_logprobs})
"""Signals of one float per response token; the others are rows of top-k ids or values."""

SIGNAL_NAMES: Mapping[Signal, str] = MappingProxyType(
    {
        Signal.teacher_logprobs: "teacher log-probs",
        Signal.teacher_topk_ids: "teacher top-k ids",
        Signal.teacher_topk_logprobs: "teacher top-k log-probs",
        Signal.rollout_topk_ids: "rollout top-k ids",
        Signal.teacher_logprobs_at_rollout_topk: "teacher log-probs at the rollout's top-k",
    }
)
"""How error lines name each signal."""


@dataclass(frozen=True)
class TopKSignals:
    """The ids a top-k term sums over at each position and the teacher's log-probs at them."""

    ids: Signal
    logprobs: Signal
    label: str
    """How error lines name the pair ("teacher top-k")."""


class PolicyGradient(str, Enum):
    """Whether a mode may be used with usePolicyGradient (an API rule refuses the rest)."""

    required = "required"
    allowed = "allowed"
    forbidden = "forbidden"


@dataclass(frozen=True)
class LossContract:
    mode: LossMode
    signals: tuple[Signal, ...]
    """What every sample and batch of a distilling job must carry (teacher_logprobs always: the
    reported KL reads it)."""
    top_k: TopKSignals | None = None
    """The pair the per-token term sums over; None for a term of the sampled token alone."""
    rollout_top_k: bool = False
    """The rollout returns its top-topK ids at every position (GenerateRequest top_k_ids)."""
    teacher_gather: bool = False
    """The teacher scores the rollout's top-k ids (ScoreRequest gather_ids), so its engine returns
    log-probs without a limit (vLLM's V1 runner gathers arbitrary ids only from the whole
    distribution)."""
    policy_gradient: PolicyGradient = PolicyGradient.allowed
    policy_gradient_reason: str = ""
    """Why usePolicyGradient is required or forbidden: the API rule's message ends with it."""
    batch_mean_baseline: bool = False
    """With usePolicyGradient and advantageBaseline batchMean, the advantages are centred on the
    batch's mean per-token term at the rollout's log-probs (it needs only per-token signals)."""

    @property
    def teacher_top_k(self) -> bool:
        """The teacher returns its own top-topK ids and log-probs at every position (ScoreRequest
        top_k); the other modes read only the sampled token's log-prob or the rollout's ids."""
        return Signal.teacher_topk_ids in self.signals

    def rollout_k(self, top_k: int) -> int:
        """The top-k ids the rollout returns per position, for algorithm.distillation.topK = top_k
        (0: none)."""
        return top_k if self.rollout_top_k else 0

    def teacher_k(self, top_k: int) -> int:
        """The top-k rows the teacher returns per position, for algorithm.distillation.topK = top_k
        (0: the scored token's log-prob only)."""
        return top_k if self.teacher_top_k else 0


TEACHER_TOP_K = TopKSignals(Signal.teacher_topk_ids, Signal.teacher_topk_logprobs, "teacher top-k")
ROLLOUT_TOP_K = TopKSignals(Signal.rollout_topk_ids, Signal.teacher_logprobs_at_rollout_topk, "rollout top-k")

CONTRACTS: Mapping[LossMode, LossContract] = MappingProxyType(
    {
        c.mode: c
        for c in (
            LossContract(
                LossMode.k1,
                signals=(Signal.teacher_logprobs,),
                policy_gradient=PolicyGradient.required,
                policy_gradient_reason="k1 has no useful gradient as a direct loss",
                batch_mean_baseline=True,
            ),
            LossContract(LossMode.k3, signals=(Signal.teacher_logprobs,), batch_mean_baseline=True),
            LossContract(
                LossMode.forward_kl_top_k,
                signals=(Signal.teacher_logprobs, TEACHER_TOP_K.ids, TEACHER_TOP_K.logprobs),
                top_k=TEACHER_TOP_K,
            ),
            LossContract(
                LossMode.reverse_kl_top_k,
                signals=(Signal.teacher_logprobs, ROLLOUT_TOP_K.ids, ROLLOUT_TOP_K.logprobs),
                top_k=ROLLOUT_TOP_K,
                rollout_top_k=True,
                teacher_gather=True,
                policy_gradient=PolicyGradient.forbidden,
                policy_gradient_reason=(
                    "as an advantage it is the same for every token sampled at a position, so its policy "
                    "gradient is zero in expectation"
                ),
            ),
        )
    }
)
"""The contract of every LossMode, in the enum's order (the API's rules are emitted in it)."""


def active_contract(distillation: DistillationSpec) -> LossContract | None:
    """The contract the job's loss follows; None with distillation disabled (no teacher signal)."""
    return CONTRACTS[distillation.loss_mode] if distillation.enabled else None
