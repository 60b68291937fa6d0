"""The loss settings of spec.algorithm reach the per-token losses the trainer computes
(runtime/trainer/losses.per_token_losses and loss_inputs): each setting changes the loss as the
function it selects computes it by hand in tests/test_losses.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kubedistill.api.losses import CONTRACTS, Signal
from kubedistill.api.spec import AlgorithmSpec, LossMode
from kubedistill.runtime.trainer import losses as L
from kubedistill.runtime.trainer.loss_inputs import distillation_baseline, needs_proximal_pass

torch.set_num_threads(1)


def _algo(distillation: dict[str, Any], **rest: Any) -> AlgorithmSpec:
    return AlgorithmSpec.model_validate({"distillation": distillation, **rest})


# Top-k log-probs with a tiny probability on each side, so the clamp matters for both modes.
S_TOPK = torch.log(torch.tensor([[0.6, 1e-6], [0.9, 0.05]]))
T_TOPK = torch.log(torch.tensor([[0.5, 0.4], [1e-6, 0.7]]))


@pytest.mark.parametrize("mode, loss", [("forwardKLTopK", L.forward_kl_top_k), ("reverseKLTopK", L.reverse_kl_top_k)])
def test_renormalize_and_log_prob_min_clamp_reach_the_top_k_losses(mode: str, loss: Any) -> None:
    seen = []
    for renormalize in (False, True):
        for clamp in (-20.0, -3.0):
            d = {
                "lossMode": mode,
                "topK": 2,
                "renormalize": renormalize,
                "logProbMinClamp": clamp,
                "lossMaxClamp": 50.0,
            }
            out = L.per_token_losses(
                _algo(d, offPolicy={"importance": {"mode": "none"}}),
                logprobs=torch.tensor([-0.5, -0.1]),
                behaviour_logprobs=torch.tensor([-0.5, -0.1]),
                student_topk_logprobs=S_TOPK,
                teacher_topk_logprobs=T_TOPK,
                segments=torch.tensor([0, 0]),
            )
            expected = loss(S_TOPK, T_TOPK, renormalize=renormalize, log_prob_min_clamp=clamp)
            assert torch.allclose(out["distill"], expected)
            seen.append(tuple(round(v, 6) for v in out["distill"].tolist()))
    assert len(set(seen)) == 4, "each setting changes the loss"


def test_clip_ratio_is_the_ppo_clip_of_the_policy_gradient_terms() -> None:
    """k1 as a policy gradient with a positive advantage (teacher above student) and a ratio 1.5
    to the proximal policy: clipped at 1 + clipRatio, the term has no gradient; within it, it does."""
    old = torch.tensor([math.log(0.4)])

    def gradient(clip_ratio: float) -> float:
        s = torch.tensor([math.log(0.6)], requires_grad=True)
        out = L.per_token_losses(
            _algo({"lossMode": "k1", "usePolicyGradient": True}, clipRatio=clip_ratio),
            logprobs=s,
            behaviour_logprobs=old,
            teacher_logprobs=torch.tensor([math.log(0.9)]),
            old_logprobs=old,
        )
        (g,) = torch.autograd.grad(out["total"].sum(), s)
        return float(g)

    assert gradient(0.2) == 0.0
    assert gradient(1.0) != 0.0


class _Batch:
    """What distillation_baseline reads of a TensorBatch."""

    def __init__(self, mu: list[float], teacher: list[float]) -> None:
        self.rollout_logprobs = torch.tensor(mu)
        self._teacher = torch.tensor(teacher)
        self.loss_mask = None  # a single-turn batch

    def signal(self, name: Signal) -> torch.Tensor | None:
        return self._teacher if name is Signal.teacher_logprobs else None


@pytest.mark.parametrize("mode", ["k1", "k3"])
def test_advantage_baseline_chooses_the_batch_mean_or_none(mode: str) -> None:
    batch = _Batch([-1.0, -2.0, -0.5], [-1.5, -1.0, -3.0])
    contract = CONTRACTS[LossMode(mode)]
    d = {"lossMode": mode, "usePolicyGradient": True}
    mean = distillation_baseline(batch, _algo({**d, "advantageBaseline": "batchMean"}), contract)  # type: ignore[arg-type]
    algo = _algo(d)
    assert mean == pytest.approx(L.batch_baseline(algo.distillation, batch.rollout_logprobs, batch._teacher))
    assert mean != 0.0
    assert distillation_baseline(batch, _algo({**d, "advantageBaseline": "none"}), contract) == 0.0  # type: ignore[arg-type]


def test_proximal_recompute_asks_for_a_proximal_pass_and_current_does_not() -> None:
    pg = {"lossMode": "k1", "usePolicyGradient": True}
    assert needs_proximal_pass(_algo(pg, offPolicy={"proximal": "recompute"}), mini_batches=2)
    assert not needs_proximal_pass(_algo(pg, offPolicy={"proximal": "current"}), mini_batches=2)
    assert not needs_proximal_pass(_algo(pg, offPolicy={"proximal": "recompute"}), mini_batches=1)


def test_distillation_enabled_switches_the_teacher_term_on_and_off() -> None:
    """algorithm.distillation.enabled in the trainer's loss: with it, the teacher's term joins the
    task-reward term (total = pg + coef x distill); without it, the loss is the task-reward term
    alone, even where the batch holds teacher log-probs."""
    logprobs = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    mu = torch.tensor([-1.1, -1.9, -0.6])
    teacher = torch.tensor([-0.2, -3.0, -0.1])
    adv = torch.tensor([0.5, 0.5, -1.0])
    base = {"lossMode": "k3", "useTaskRewards": True, "coef": 1.0}
    on = L.per_token_losses(
        _algo({**base, "enabled": True}),
        logprobs=logprobs,
        behaviour_logprobs=mu,
        teacher_logprobs=teacher,
        task_advantages=adv,
    )
    off = L.per_token_losses(
        _algo({**base, "enabled": False}),
        logprobs=logprobs,
        behaviour_logprobs=mu,
        teacher_logprobs=teacher,  # present, and not read
        task_advantages=adv,
    )
    assert torch.allclose(on["pg"], off["pg"])
    assert on["distill"].abs().sum() > 0 and torch.equal(off["distill"], torch.zeros(3))
    assert torch.allclose(off["total"], off["pg"]) and not torch.allclose(on["total"], off["total"])
