"""What a step's loss needs of its whole batch before the micro-batches run: the task advantages,
the distillation baseline, and whether the proximal log-probs must be computed first."""

from __future__ import annotations

import torch

from kubedistill.api.losses import LossContract, Signal
from kubedistill.api.spec import Advantage, AdvantageBaseline, AlgorithmSpec, ImportanceMode, ProximalPolicy
from kubedistill.runtime.trainer import losses as L
from kubedistill.runtime.wire.batch import TensorBatch


def task_advantages(batch: TensorBatch, estimator: Advantage) -> torch.Tensor:
    """The algorithm.advantage of each sample within its prompt group (useTaskRewards)."""
    if batch.rewards is None or batch.group_ids is None:
        raise ValueError("TensorBatch.rewards/group_ids: required when algorithm.distillation.useTaskRewards is true")
    return L.group_advantages(torch.tensor(batch.rewards, dtype=torch.float32), batch.group_ids, estimator)


def needs_proximal_pass(algo: AlgorithmSpec, mini_batches: int) -> bool:
    """Whether a step must compute its proximal log-probs before training: a term reads them (a
    policy-gradient term's clip, or the importance weight of a direct loss), the spec asks for
    recompute, and more than one optimiser step follows (with one, the proximal weights are the
    weights of the only update)."""
    d = algo.distillation
    pg = d.use_task_rewards or (d.enabled and d.use_policy_gradient)
    weighted = d.enabled and algo.off_policy.importance.mode is not ImportanceMode.none
    return (pg or weighted) and algo.off_policy.proximal is ProximalPolicy.recompute and mini_batches > 1


def distillation_baseline(batch: TensorBatch, algo: AlgorithmSpec, contract: LossContract | None) -> float:
    """The constant subtracted from every per-token distillation advantage of this batch (0 unless
    a policy-gradient loss whose contract has a batch-mean baseline asks for it)."""
    d = algo.distillation
    if contract is None or not (d.use_policy_gradient and contract.batch_mean_baseline):
        return 0.0
    teacher_logprobs = batch.signal(Signal.teacher_logprobs)
    if d.advantage_baseline is not AdvantageBaseline.batch_mean or teacher_logprobs is None:
        return 0.0
    mu, teacher = batch.rollout_logprobs.double(), teacher_logprobs.double()
    if batch.loss_mask is not None:  # over the student's own tokens only
        mu, teacher = mu[batch.loss_mask], teacher[batch.loss_mask]
    return L.batch_baseline(d, mu, teacher)
