"""Distillation and policy-gradient losses (docs/design.md#losses, docs/algorithms.md). Pure torch.

Every function works per token on flat tensors of response tokens (shape ``[N]``, or ``[N, k]``
for top-k terms) and returns per-token values; aggregation into one scalar is separate
(:func:`token_weights`) so the trainer can split a batch into
micro-batches and ranks and still get exactly the loss of the whole batch.

Notation per response token t: ``s`` = log pi_student(y_t) (with grad), ``mu`` = rollout
(behaviour) log-prob, ``T`` = log pi_teacher(y_t); top-k terms carry the teacher's top-k ids K_t.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from kubedistill.api.enums import LossAggregation
from kubedistill.api.losses import CONTRACTS
from kubedistill.api.spec import Advantage, AlgorithmSpec, DistillationSpec, ImportanceLevel, ImportanceMode, LossMode

# verl's low_var_kl clamps: the log-ratio before exp, and the result.
K3_LOG_RATIO_CLAMP = 20.0
K3_RESULT_CLAMP = 10.0
GRPO_EPS = 1e-6


def k1(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """k1_t = s_t - T_t: unbiased per-token estimate of KL(student || teacher) under student samples.

    Its gradient as a direct loss is zero in expectation, so it is used only as a
    policy-gradient signal (:func:`distillation_advantages`).
    """
    return student_logprobs - teacher_logprobs


def k3(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """k3_t = exp(d) - d - 1 with d = clamp(T_t - s_t, ±20), result clamped to ±10 (verl's low_var_kl).

    Non-negative, unbiased for KL(student || teacher) under student samples; its pathwise gradient
    (1 - p_T/q) grad log q has expectation -sum_y p_T(y) grad log q(y), the forward-KL gradient.
    """
    d = (teacher_logprobs - student_logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1.0).clamp(-K3_RESULT_CLAMP, K3_RESULT_CLAMP)


def forward_kl_top_k(
    student_topk_logprobs: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    *,
    renormalize: bool = False,
    log_prob_min_clamp: float = -10.0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_{v in K_t} p_T(v) (T_t(v) - log q(v)), shape ``[N, k] -> [N]``.

    ``student_topk_logprobs`` are the student's full-vocabulary log-probs gathered at the teacher's
    top-k ids. They are clamped below at ``log_prob_min_clamp`` (a vanishing student probability
    would otherwise give an unbounded term). With ``renormalize`` both sides are renormalised over
    K_t (log-softmax of the k values), making the sum a true KL between two distributions on K_t.
    Without it the sum is a partial KL that can dip below zero, hence the final ``clamp_min(0)``.
    ``valid`` (bool ``[N, k]``) excludes padded top-k slots.
    """
    student = student_topk_logprobs.clamp_min(log_prob_min_clamp)
    return _kl_over_top_k(teacher_topk_logprobs, student, renormalize=renormalize, valid=valid).clamp_min(0.0)


def reverse_kl_top_k(
    student_topk_logprobs: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    *,
    renormalize: bool = False,
    log_prob_min_clamp: float = -10.0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_{v in K_t} q(v) (log q(v) - T_t(v)) over the **student's** top-k ids K_t, ``[N, k] -> [N]``.

    The exact reverse KL(student || teacher) at each position of the student's own sample,
    restricted to where the student puts its mass: no sampled token enters the value, so the
    gradient through q and log q has none of the per-token sampling noise of k1 + policy gradient.
    ``student_topk_logprobs`` are the student's full-vocabulary log-probs at K_t (with grad);
    ``teacher_topk_logprobs`` the teacher's at the same ids, clamped below at
    ``log_prob_min_clamp`` (a token the teacher all but forbids would give an unbounded term).
    With ``renormalize`` both sides are renormalised over K_t: a true KL between distributions on
    K_t, never negative. Without it the tail outside K_t is left out, and a position whose teacher
    holds more of K_t's mass than the student can give a slightly negative value; it is not
    clamped, so its gradient stays. ``valid`` (bool ``[N, k]``) excludes padded slots.
    """
    teacher = teacher_topk_logprobs.clamp_min(log_prob_min_clamp)
    return _kl_over_top_k(student_topk_logprobs, teacher, renormalize=renormalize, valid=valid)


def _kl_over_top_k(
    weighting: torch.Tensor, other: torch.Tensor, *, renormalize: bool, valid: torch.Tensor | None
) -> torch.Tensor:
    """sum_v exp(a_v) (a_v - b_v) over the k slots of each row (a = `weighting`, b = `other`,
    log-probs ``[N, k]``): the top-k KL of the distribution a from b. Padded slots (``valid``
    false) add nothing; with `renormalize` both sides are log-softmaxed over the valid slots."""
    a, b = weighting, other
    if valid is not None:
        neg_inf = torch.finfo(a.dtype).min
        a = a.masked_fill(~valid, neg_inf)
        b = b.masked_fill(~valid, neg_inf) if renormalize else b
    if renormalize:
        a = a - torch.logsumexp(a, dim=-1, keepdim=True)
        b = b - torch.logsumexp(b, dim=-1, keepdim=True)
    terms = torch.exp(a) * (a - b)
    if valid is not None:
        terms = terms.masked_fill(~valid, 0.0)
    return terms.sum(dim=-1)


@dataclass(frozen=True)
class TermInputs:
    """What a per-token distillation term may read (each mode's contract says which it needs):
    the student's log-probs ``s`` ([N], with grad), the teacher's of the sampled tokens ([N]), and
    the student's and teacher's log-probs at the contract's top-k ids ([N, k], `topk_valid`
    masking padded slots)."""

    logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor | None = None
    student_topk_logprobs: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None
    topk_valid: torch.Tensor | None = None


DistillTerm = Callable[[TermInputs, DistillationSpec], tuple[torch.Tensor, torch.Tensor]]
"""A mode's per-token function: (its term, the signal its policy-gradient advantage is built from)."""


def _needed(value: torch.Tensor | None, d: DistillationSpec, what: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"lossMode {d.loss_mode.value} needs {what} in the batch")
    return value


def _k1_term(x: TermInputs, d: DistillationSpec) -> tuple[torch.Tensor, torch.Tensor]:
    term = k1(x.logprobs, _needed(x.teacher_logprobs, d, "teacher log-probs of the sampled tokens"))
    return term, term


def _k3_term(x: TermInputs, d: DistillationSpec) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = _needed(x.teacher_logprobs, d, "teacher log-probs of the sampled tokens")
    # k3 depends on the student's log-prob too: the gradient of E_q[k3] is its score term
    # (alone: grad RKL - grad FKL) plus its pathwise one, (1 - r) grad log q. Per token they sum
    # to (k3 + 1 - r) grad log q = k1 grad log q, so a policy gradient is built from k1: clamping
    # k3 alone would drop the pathwise part exactly where the teacher likes a token far more than
    # the student, and reverse its push.
    return k3(x.logprobs, teacher), k1(x.logprobs, teacher)


def _top_k_term(
    top_k_loss: Callable[..., torch.Tensor],
) -> DistillTerm:
    def term(x: TermInputs, d: DistillationSpec) -> tuple[torch.Tensor, torch.Tensor]:
        raw = top_k_loss(
            _needed(x.student_topk_logprobs, d, "top-k ids and teacher log-probs"),
            _needed(x.teacher_topk_logprobs, d, "top-k ids and teacher log-probs"),
            renormalize=d.renormalize,
            log_prob_min_clamp=d.log_prob_min_clamp,
            valid=x.topk_valid,
        )
        return raw, raw

    return term


PER_TOKEN_TERMS: Mapping[LossMode, DistillTerm] = MappingProxyType(
    {
        LossMode.k1: _k1_term,
        LossMode.k3: _k3_term,
        LossMode.forward_kl_top_k: _top_k_term(forward_kl_top_k),
        LossMode.reverse_kl_top_k: _top_k_term(reverse_kl_top_k),
    }
)
"""The per-token function of every LossMode (its contract: kubedistill.api.losses.CONTRACTS)."""


def distillation_advantages(distill_loss: torch.Tensor, loss_max_clamp: float, baseline: float = 0.0) -> torch.Tensor:
    """Per-token advantage a_t = -(clamp(loss_t, ±loss_max_clamp) - b), detached (a reward, not a loss).

    b is a constant over the batch (:func:`batch_baseline`): any b that does not depend on the
    sampled token leaves the gradient's expectation unchanged and can only lower its variance.
    """
    return -(distill_loss.detach().clamp(-loss_max_clamp, loss_max_clamp) - baseline)


def batch_baseline(d: DistillationSpec, behaviour_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> float:
    """The batch's mean per-token distillation term at the rollout's log-probs, b = mean_t clamp(D(mu_t, T_t)).

    Known before the step (no forward pass), identical on every rank and micro-batch, and close
    to the mean of the terms the step computes: centring the advantages on it stops a
    policy-gradient step from pushing every sampled token down (k1 and k3 terms are mostly
    positive), which hands their probability to tokens nobody sampled.
    """
    term, _ = PER_TOKEN_TERMS[d.loss_mode](TermInputs(behaviour_logprobs, teacher_logprobs=teacher_logprobs), d)
    return float(term.clamp(-d.loss_max_clamp, d.loss_max_clamp).mean()) if term.numel() else 0.0


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[int] | torch.Tensor,
    estimator: Advantage = Advantage.grpo,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    """Per-sample task-reward advantage within each group g of samples of the same prompt.

    * grpo: (r_i - mean_g) / (std_g + eps), std the unbiased sample standard deviation (as verl);
    * rloo: r_i - mean of the group's other samples = n / (n - 1) (r_i - mean_g) (REINFORCE
      leave-one-out, verl's rloo and TRL's RLOOTrainer);
    * groupMean: r_i - mean_g (Dr. GRPO: no division by std, which favours groups of nearly equal
      rewards; TRL's scale_rewards "none").

    A group of one sample gets 0 (the API requires samplesPerPrompt >= 2 with task rewards).
    """
    rewards = rewards.to(torch.float64)
    groups = torch.as_tensor(group_ids)
    out = torch.zeros_like(rewards)
    for g in torch.unique(groups):
        idx = (groups == g).nonzero(as_tuple=True)[0]
        n = idx.numel()
        if n < 2:
            continue
        r = rewards[idx]
        centred = r - r.mean()
        if estimator is Advantage.grpo:
            out[idx] = centred / (r.std() + eps)
        elif estimator is Advantage.rloo:
            out[idx] = centred * n / (n - 1)
        elif estimator is Advantage.group_mean:
            out[idx] = centred
        else:
            raise ValueError(f"algorithm.advantage must be grpo, rloo or groupMean, got {estimator!r}")
    return out.to(torch.float32)


def importance_weights(
    log_ratio: torch.Tensor,
    *,
    level: ImportanceLevel = ImportanceLevel.token,
    mode: ImportanceMode = ImportanceMode.truncate,
    low: float = 0.0,
    high: float = 2.0,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights w = pi_prox / mu of the behaviour policy's tokens, and which were cut.

    `log_ratio` is log pi_prox - mu per token (detached). At ``sequence`` level every token of a
    sample gets the sample's ratio exp(sum of its log ratios); `segments` ([N], sample index per
    token) says which tokens form a sample. ``truncate`` (TIS) caps w at `high`; ``mask`` (MIS)
    gives weight 0 to tokens (or whole samples) whose w lies outside [`low`, `high`], and keeps
    the others at their ratio; ``none`` gives every token weight 1. Returns (weights, cut), cut
    being a bool ``[N]`` of the tokens truncated or masked.
    """
    log_ratio = log_ratio.detach()
    if mode is ImportanceMode.none:
        return torch.ones_like(log_ratio), torch.zeros_like(log_ratio, dtype=torch.bool)
    if level is ImportanceLevel.sequence:
        if segments is None:
            raise ValueError("sequence-level importance weights need each token's sample (segments)")
        per_sample = torch.zeros(int(segments.max()) + 1 if segments.numel() else 0, dtype=log_ratio.dtype)
        per_sample = per_sample.to(log_ratio.device).index_add_(0, segments, log_ratio)
        log_ratio = per_sample[segments]
    # exp of a clamped log ratio: a sample whose ratio overflows is cut either way.
    w = torch.exp(log_ratio.clamp(max=math.log(high) + 1.0))
    if mode is ImportanceMode.truncate:
        return w.clamp(max=high), w > high
    cut = (w < low) | (w > high)
    return w.masked_fill(cut, 0.0), cut


def previous_token_log_ratio(log_ratio: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """Each token's log ratio replaced by the one of the token before it in its sample (0 for a
    sample's first token, which only the prompt precedes).

    A top-k term at position t is a function of the prefix y_<t alone; the last sampled token it
    depends on is y_(t-1), so its token-level importance weight is that token's ratio
    (docs/algorithms.md#off-policy-correction-of-the-direct-losses). `segments` ([N]) numbers
    each token's sample; the tokens of a sample are contiguous.
    """
    if segments is None:
        raise ValueError("the importance weight of a top-k term needs each token's sample (segments)")
    shifted = torch.roll(log_ratio, 1)
    first = torch.ones_like(segments, dtype=torch.bool)
    first[1:] = segments[1:] != segments[:-1]
    return shifted.masked_fill(first, 0.0)


def ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    importance_weight: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
) -> torch.Tensor:
    """Decoupled PPO clipped surrogate (per token).

    r = exp(s - s_prox) is the ratio to the proximal policy (the trainer's weights at the start of
    the step) and is clipped to [1 - eps, 1 + eps]; `importance_weight` w (detached, see
    :func:`importance_weights`) corrects for the rollout's behaviour policy mu differing from the
    proximal one (stale samples, engine numerics):

        loss_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps))

    With one optimiser step per batch s_prox = s.detach(), so r = 1 and the gradient is
    -w_t A_t grad s_t: the importance-sampled policy gradient.
    """
    ratio = torch.exp(logprobs - proximal_logprobs)
    clipped = ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    surrogate = torch.maximum(-advantages * ratio, -advantages * clipped)
    return importance_weight.detach() * surrogate


def token_weights(lengths: Sequence[int], mode: LossAggregation, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token weights (flat, sample after sample) whose weighted sum is the aggregated loss.

    tokenMean: 1 / (total tokens). seqMeanTokenMean: 1 / (samples x the sample's length).
    Computed over the whole batch, so any split into micro-batches and ranks sums to the same loss.
    With `loss_mask` (bool, one per token) only its tokens count and carry weight: a multi-turn
    trace's observation tokens get 0, so they carry no gradient, and the means are over the
    student's own tokens.
    """
    lengths = [int(n) for n in lengths]
    total = sum(lengths)
    if total == 0:
        raise ValueError("batch has no response tokens")
    keep = torch.ones(total, dtype=torch.bool) if loss_mask is None else loss_mask.to(torch.bool).cpu()
    if mode == LossAggregation.token_mean:
        return keep.to(torch.float32) / max(int(keep.sum()), 1)
    if mode == LossAggregation.seq_mean_token_mean:
        counts = torch.stack([part.sum() for part in torch.split(keep, lengths)]).to(torch.float32)
        samples = max(int((counts > 0).sum()), 1)
        per_sample = torch.where(counts > 0, 1.0 / (samples * counts.clamp(min=1)), torch.zeros_like(counts))
        return per_sample.repeat_interleave(torch.tensor(lengths)) * keep
    raise ValueError(f"loss aggregation must be tokenMean or seqMeanTokenMean, got {mode!r}")


def per_token_losses(
    algorithm: AlgorithmSpec,
    *,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor | None = None,
    student_topk_logprobs: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
    topk_valid: torch.Tensor | None = None,
    task_advantages: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
    advantage_baseline: float = 0.0,
    loss_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The configured loss per response token: ``{"distill", "pg", "total"}`` (each ``[N]``), plus
    what the step reports about it: ``log_ratio`` = s_old - mu (the log importance weight before
    correction), ``is_weight`` and ``is_cut`` (the importance weights applied to the distillation
    term, or to the task-reward term without distillation, and the tokens truncated or masked,
    see :func:`importance_weights`) and ``advantage`` (the distillation
    advantage of a policy-gradient loss, else 0). `segments` ([N]) numbers each token's sample.

    * distill: the per-token distillation term, clamped to ±lossMaxClamp. As a direct loss
      (usePolicyGradient false) it is the training signal, times its detached importance weight
      (:func:`direct_loss_weights`); with usePolicyGradient it becomes the
      advantage -(clamp(term) - b) of a PPO term and ``distill`` reports the PPO term's value.
      The term and the advantage's signal come from the mode's per-token function
      (`PER_TOKEN_TERMS`); for k3 the signal is k1: the score and pathwise gradients of k3 sum to
      k1's per token (docs/algorithms.md), and k3 remains in the baseline b (:func:`batch_baseline`).
    * pg: the PPO term of the GRPO task advantages (useTaskRewards), else zeros.
    * total = pg + coef x distill (coef = 1 when task rewards are off).

    `loss_mask` ([N] bool) marks the tokens the student sampled; the others (a multi-turn trace's
    observations, with no behaviour log-prob) get log ratio 0, so they leave a sequence-level
    importance weight as it is. Their weight in the aggregation is 0 (:func:`token_weights`).
    """
    d = algorithm.distillation
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    log_ratio = (old - behaviour_logprobs).detach()
    if loss_mask is not None:
        log_ratio = log_ratio.masked_fill(~loss_mask, 0.0)
    imp = algorithm.off_policy.importance
    token_weight, token_cut = importance_weights(
        log_ratio, level=imp.level, mode=imp.mode, low=imp.low, high=imp.high, segments=segments
    )
    is_weight, is_cut = token_weight, token_cut
    zero = torch.zeros_like(logprobs)
    distill = zero
    advantage = zero
    if d.enabled:
        inputs = TermInputs(
            logprobs,
            teacher_logprobs=teacher_logprobs,
            student_topk_logprobs=student_topk_logprobs,
            teacher_topk_logprobs=teacher_topk_logprobs,
            topk_valid=topk_valid,
        )
        raw, pg_signal = PER_TOKEN_TERMS[d.loss_mode](inputs, d)
        if d.use_policy_gradient:
            advantage = distillation_advantages(pg_signal, d.loss_max_clamp, advantage_baseline)
            distill = ppo_loss(logprobs, old, advantage, token_weight, clip_ratio=algorithm.clip_ratio)
        else:
            is_weight, is_cut = direct_loss_weights(algorithm, log_ratio, segments, token_weight, token_cut)
            distill = is_weight * raw.clamp(-d.loss_max_clamp, d.loss_max_clamp)
    pg = zero
    if d.use_task_rewards:
        if task_advantages is None:
            raise ValueError("useTaskRewards needs task advantages (rewards and group ids in the batch)")
        pg = ppo_loss(logprobs, old, task_advantages, token_weight, clip_ratio=algorithm.clip_ratio)
    coef = d.coef if d.use_task_rewards else 1.0
    return {
        "distill": distill,
        "pg": pg,
        "total": pg + coef * distill,
        "log_ratio": log_ratio,
        "is_weight": is_weight,
        "is_cut": is_cut,
        "advantage": advantage,
    }


def direct_loss_weights(
    algorithm: AlgorithmSpec,
    log_ratio: torch.Tensor,
    segments: torch.Tensor | None,
    token_weight: torch.Tensor,
    token_cut: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The detached importance weights (and cut tokens) of a direct distillation loss.

    A term of the sampled token (k3) takes the token's own weight, as a policy-gradient term does.
    A top-k term at position t does not read y_t, only the prefix; at ``token`` level it takes the
    weight of y_(t-1), the last sampled token it depends on (:func:`previous_token_log_ratio`);
    at ``sequence`` level it takes its sample's weight like every other term.
    """
    imp = algorithm.off_policy.importance
    top_k = CONTRACTS[algorithm.distillation.loss_mode].top_k is not None
    if not top_k or imp.level is ImportanceLevel.sequence or imp.mode is ImportanceMode.none:
        return token_weight, token_cut
    shifted = previous_token_log_ratio(log_ratio, segments)
    return importance_weights(shifted, level=imp.level, mode=imp.mode, low=imp.low, high=imp.high)
