"""Distillation and policy-gradient losses (docs/design.md#losses, docs/algorithms.md). Pure torch.

Every function works per token on flat tensors of response tokens (shape ``[N]``, or ``[N, k]``
for top-k terms) and returns per-token values; aggregation into one scalar is separate
(:func:`token_weights`, :func:`masked_aggregate`) so the trainer can split a batch into
micro-batches and ranks and still get exactly the loss of the whole batch.

Notation per response token t: ``s`` = log pi_student(y_t) (with grad), ``mu`` = rollout
(behaviour) log-prob, ``T`` = log pi_teacher(y_t); top-k terms carry the teacher's top-k ids K_t.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kubedistill.api.spec import AlgorithmSpec, LossMode

Aggregation = Literal["tokenMean", "seqMeanTokenMean"]

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
    s = student_topk_logprobs.clamp_min(log_prob_min_clamp)
    t = teacher_topk_logprobs
    if valid is not None:
        neg_inf = torch.finfo(t.dtype).min
        t = t.masked_fill(~valid, neg_inf)
        s = s.masked_fill(~valid, neg_inf) if renormalize else s
    if renormalize:
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(t)
    terms = p * (t - s)
    if valid is not None:
        terms = terms.masked_fill(~valid, 0.0)
    return terms.sum(dim=-1).clamp_min(0.0)


def distillation_advantages(distill_loss: torch.Tensor, loss_max_clamp: float) -> torch.Tensor:
    """Per-token advantage a_t = -clamp(loss_t, ±loss_max_clamp), detached (a reward, not a loss)."""
    return -distill_loss.detach().clamp(-loss_max_clamp, loss_max_clamp)


def grpo_advantages(
    rewards: torch.Tensor, group_ids: Sequence[int] | torch.Tensor, eps: float = GRPO_EPS
) -> torch.Tensor:
    """Per-sample (r_i - mean_g) / (std_g + eps) within each group g of samples of the same prompt.

    std is the unbiased sample standard deviation (as verl); a group of one sample gets 0.
    """
    rewards = rewards.to(torch.float64)
    groups = torch.as_tensor(group_ids)
    out = torch.zeros_like(rewards)
    for g in torch.unique(groups):
        idx = (groups == g).nonzero(as_tuple=True)[0]
        if idx.numel() < 2:
            continue
        r = rewards[idx]
        out[idx] = (r - r.mean()) / (r.std() + eps)
    return out.to(torch.float32)


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    importance_weight_cap: float = 2.0,
) -> torch.Tensor:
    """Decoupled PPO clipped surrogate with a truncated importance weight (per token).

    r = exp(s - s_old) is the ratio to the proximal policy (the trainer's weights at the start of
    the step) and is clipped to [1 - eps, 1 + eps]; w = min(exp(s_old - mu), C) (detached) corrects
    for the rollout's behaviour policy mu being older than the trainer (stale samples):

        loss_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps))

    With one optimiser step per batch s_old = s.detach(), so r = 1 and the gradient is
    -w_t A_t grad s_t: the truncated importance-sampled policy gradient.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    surrogate = torch.maximum(-advantages * ratio, -advantages * clipped)
    weight = torch.exp(old_logprobs.detach() - behaviour_logprobs).clamp(max=importance_weight_cap)
    return weight * surrogate


def token_weights(lengths: Sequence[int], mode: Aggregation) -> torch.Tensor:
    """Per-token weights (flat, sample after sample) whose weighted sum is the aggregated loss.

    tokenMean: 1 / (total tokens). seqMeanTokenMean: 1 / (samples x the sample's length).
    Computed over the whole batch, so any split into micro-batches and ranks sums to the same loss.
    """
    lengths = [int(n) for n in lengths]
    total = sum(lengths)
    if total == 0:
        raise ValueError("batch has no response tokens")
    if mode == "tokenMean":
        return torch.full((total,), 1.0 / total, dtype=torch.float32)
    if mode == "seqMeanTokenMean":
        parts = [torch.full((n,), 1.0 / (len(lengths) * n), dtype=torch.float32) for n in lengths if n > 0]
        return torch.cat(parts)
    raise ValueError(f"loss aggregation must be tokenMean or seqMeanTokenMean, got {mode!r}")


def masked_aggregate(values: torch.Tensor, mask: torch.Tensor, mode: Aggregation) -> torch.Tensor:
    """Aggregate a padded ``[B, L]`` per-token loss over the positions where ``mask`` is true
    (response tokens; prompt and padding positions are false)."""
    mask = mask.to(values.dtype)
    if mode == "tokenMean":
        return (values * mask).sum() / mask.sum().clamp_min(1.0)
    if mode == "seqMeanTokenMean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        return per_seq.mean()
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
) -> dict[str, torch.Tensor]:
    """The configured loss per response token: ``{"distill", "pg", "total"}`` (each ``[N]``).

    * distill: the per-token distillation term, clamped to ±lossMaxClamp. As a direct loss
      (usePolicyGradient false) it is the training signal; with usePolicyGradient it becomes the
      advantage -clamp(distill) of a PPO term and ``distill`` reports the PPO term's value.
    * pg: the PPO term of the GRPO task advantages (useTaskRewards), else zeros.
    * total = pg + coef x distill (coef = 1 when task rewards are off).
    """
    d = algorithm.distillation
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ppo = dict(clip_ratio=algorithm.clip_ratio, importance_weight_cap=algorithm.importance_weight_cap)
    zero = torch.zeros_like(logprobs)
    distill = zero
    if d.enabled:
        if d.loss_mode is LossMode.forward_kl_top_k:
            if student_topk_logprobs is None or teacher_topk_logprobs is None:
                raise ValueError("lossMode forwardKLTopK needs teacher top-k ids and log-probs in the batch")
            raw = forward_kl_top_k(
                student_topk_logprobs,
                teacher_topk_logprobs,
                renormalize=d.renormalize,
                log_prob_min_clamp=d.log_prob_min_clamp,
                valid=topk_valid,
            )
        else:
            if teacher_logprobs is None:
                raise ValueError(
                    f"lossMode {d.loss_mode.value} needs teacher log-probs of the sampled tokens in the batch"
                )
            raw = (k1 if d.loss_mode is LossMode.k1 else k3)(logprobs, teacher_logprobs)
        clamped = raw.clamp(-d.loss_max_clamp, d.loss_max_clamp)
        if d.use_policy_gradient:
            adv = distillation_advantages(raw, d.loss_max_clamp)
            distill = ppo_loss(logprobs, old, behaviour_logprobs, adv, **ppo)
        else:
            distill = clamped
    pg = zero
    if d.use_task_rewards:
        if task_advantages is None:
            raise ValueError("useTaskRewards needs task advantages (rewards and group ids in the batch)")
        pg = ppo_loss(logprobs, old, behaviour_logprobs, task_advantages, **ppo)
    coef = d.coef if d.use_task_rewards else 1.0
    return {"distill": distill, "pg": pg, "total": pg + coef * distill}
