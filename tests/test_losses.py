"""Each loss against values computed by hand, and the gradients the design relies on."""

from __future__ import annotations

import math

import pytest
import torch

from kubedistill.api.spec import AlgorithmSpec
from kubedistill.runtime.trainer import losses as L

torch.set_num_threads(1)


def test_k1_is_student_minus_teacher() -> None:
    s = torch.tensor([-1.0, -2.0, -0.5])
    t = torch.tensor([-1.5, -1.0, -0.5])
    assert torch.allclose(L.k1(s, t), torch.tensor([0.5, -1.0, 0.0]))


def test_k3_by_hand_and_verl_clamps() -> None:
    s = torch.tensor([-1.0, -2.0, -0.5, 0.0, -30.0])
    t = torch.tensor([-1.5, -1.0, -0.5, -40.0, 0.0])
    d = [-0.5, 1.0, 0.0]
    expected = [math.exp(x) - x - 1 for x in d]
    # d = -40 is clamped to -20: e^-20 + 20 - 1 = 19.0..., then the result to 10.
    # d = +30 is clamped to 20: e^20 - 21 is huge, then clamped to 10.
    expected += [10.0, 10.0]
    assert torch.allclose(L.k3(s, t), torch.tensor(expected), atol=1e-6)


def test_forward_kl_top_k_by_hand() -> None:
    # One position, k = 2: teacher p = (0.6, 0.3) (partial mass), student q = (0.5, 0.1).
    t = torch.log(torch.tensor([[0.6, 0.3]]))
    s = torch.log(torch.tensor([[0.5, 0.1]]))
    plain = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.1)
    assert L.forward_kl_top_k(s, t).item() == pytest.approx(plain, rel=1e-6)
    # Renormalised over K: p' = (2/3, 1/3), q' = (5/6, 1/6).
    renorm = (2 / 3) * math.log((2 / 3) / (5 / 6)) + (1 / 3) * math.log((1 / 3) / (1 / 6))
    assert L.forward_kl_top_k(s, t, renormalize=True).item() == pytest.approx(renorm, rel=1e-6)
    # The student's log-prob is clamped at logProbMinClamp: q = e^-30 counts as e^-5.
    s_small = torch.tensor([[-30.0, math.log(0.1)]])
    clamped = 0.6 * (math.log(0.6) + 5.0) + 0.3 * math.log(0.3 / 0.1)
    assert L.forward_kl_top_k(s_small, t, log_prob_min_clamp=-5.0).item() == pytest.approx(clamped, rel=1e-6)
    # A partial KL below zero (student above teacher on K) is clamped to 0.
    assert L.forward_kl_top_k(torch.log(torch.tensor([[0.9]])), torch.log(torch.tensor([[0.1]]))).item() == 0.0


def test_forward_kl_top_k_masks_padded_slots() -> None:
    t = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    s = torch.log(torch.tensor([[0.5, 0.1, 0.4]]))
    valid = torch.tensor([[True, True, False]])
    for renorm in (False, True):
        full = L.forward_kl_top_k(s[:, :2], t[:, :2], renormalize=renorm)
        masked = L.forward_kl_top_k(s, t, renormalize=renorm, valid=valid)
        assert torch.allclose(full, masked)


def test_forward_kl_top_k_with_whole_vocab_is_exact_forward_kl() -> None:
    g = torch.Generator().manual_seed(0)
    logits_s = torch.randn(4, 7, generator=g, requires_grad=True)
    logits_t = torch.randn(4, 7, generator=g)
    s, t = logits_s.log_softmax(-1), logits_t.log_softmax(-1)
    exact = (t.exp() * (t - s)).sum(-1)
    got = L.forward_kl_top_k(s, t, log_prob_min_clamp=-1e4)
    assert torch.allclose(got, exact, atol=1e-6)
    (ga,) = torch.autograd.grad(got.sum(), logits_s, retain_graph=True)
    (gb,) = torch.autograd.grad(exact.sum(), logits_s)
    assert torch.allclose(ga, gb, atol=1e-6)


def test_k3_expected_gradient_is_forward_kl_gradient() -> None:
    """On an enumerable distribution: E_{y~q}[grad k3(y)] = grad KL(p || q)."""
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(6, generator=g, requires_grad=True)
    log_p = torch.randn(6, generator=g).log_softmax(-1)
    log_q = theta.log_softmax(-1)
    expected_k3 = (log_q.exp().detach() * L.k3(log_q, log_p)).sum()
    (g_k3,) = torch.autograd.grad(expected_k3, theta, retain_graph=True)
    forward_kl = (log_p.exp() * (log_p - log_q)).sum()
    (g_fkl,) = torch.autograd.grad(forward_kl, theta, retain_graph=True)
    assert torch.allclose(g_k3, g_fkl, atol=1e-6)
    # And k3's expected value is the reverse KL(q || p).
    reverse = (log_q.exp() * (log_q - log_p)).sum()
    assert expected_k3.item() == pytest.approx(reverse.item(), rel=1e-5)


def test_grpo_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    groups = [0, 0, 0, 1, 1, 2]
    adv = L.grpo_advantages(rewards, groups)
    std0 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased
    assert adv[0].item() == pytest.approx((2 / 3) / (std0 + 1e-6), rel=1e-5)
    assert adv[1].item() == pytest.approx((-1 / 3) / (std0 + 1e-6), rel=1e-5)
    assert adv[3].item() == 0.0 and adv[4].item() == 0.0  # equal rewards
    assert adv[5].item() == 0.0  # a group of one


def test_ppo_loss_clip_and_truncated_importance_weight() -> None:
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    old = torch.log(torch.tensor([0.5, 2.0, 1.0, 1.0]))  # ratios r = 2, 0.5, 1, 1
    behaviour = torch.log(torch.tensor([0.5, 2.0, 0.1, 2.0]))  # w = min(old/mu, 2) = 1, 1, 2, 0.5
    adv = torch.tensor([1.0, -1.0, 1.0, -2.0])
    loss = L.ppo_loss(logp, old, behaviour, adv, clip_ratio=0.2, importance_weight_cap=2.0)
    # r=2, A=1: max(-2, -1.2) = -1.2; r=0.5, A=-1: max(0.5, 0.8) = 0.8;
    # r=1, A=1, w=2: -2; r=1, A=-2, w=0.5: 1.
    assert torch.allclose(loss, torch.tensor([-1.2, 0.8, -2.0, 1.0]), atol=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # Clipped tokens carry no gradient; the others -w A r.
    assert torch.allclose(grad, torch.tensor([0.0, 0.0, -2.0, 1.0]), atol=1e-6)


def test_token_weights_and_masked_aggregate_agree() -> None:
    values = torch.tensor([[9.0, 1.0, 2.0, 0.0], [9.0, 9.0, 3.0, 5.0]])
    mask = torch.tensor([[False, True, True, False], [False, False, True, True]])
    flat = values[mask]
    for mode, expected in (("tokenMean", 11.0 / 4), ("seqMeanTokenMean", (1.5 + 4.0) / 2)):
        assert L.masked_aggregate(values, mask, mode).item() == pytest.approx(expected)
        assert (L.token_weights([2, 2], mode) * flat).sum().item() == pytest.approx(expected)
    w = L.token_weights([1, 3], "seqMeanTokenMean")
    assert torch.allclose(w, torch.tensor([0.5, 1 / 6, 1 / 6, 1 / 6]))
    with pytest.raises(ValueError, match="tokenMean or seqMeanTokenMean"):
        L.token_weights([1], "mean")  # type: ignore[arg-type]


def _algo(**distillation) -> AlgorithmSpec:
    return AlgorithmSpec.model_validate({"distillation": distillation})


def test_per_token_losses_modes() -> None:
    s = torch.tensor([-1.0, -2.0], requires_grad=True)
    mu = torch.tensor([-1.0, -2.0])
    t = torch.tensor([-1.5, -30.0])
    direct = L.per_token_losses(
        _algo(lossMode="k3", lossMaxClamp=5.0), logprobs=s, behaviour_logprobs=mu, teacher_logprobs=t
    )
    assert torch.allclose(direct["total"], L.k3(s, t).clamp(max=5.0))
    assert torch.equal(direct["pg"], torch.zeros(2))
    # k1 as a policy gradient: advantage -clamp(s - T, ±5) = (-0.5, -5); on-policy r = w = 1.
    pg = L.per_token_losses(
        _algo(lossMode="k1", usePolicyGradient=True, lossMaxClamp=5.0),
        logprobs=s,
        behaviour_logprobs=mu,
        teacher_logprobs=t,
    )
    assert torch.allclose(pg["total"], torch.tensor([0.5, 5.0]))
    (grad,) = torch.autograd.grad(pg["total"].sum(), s)
    assert torch.allclose(grad, torch.tensor([0.5, 5.0]))
    # Task rewards: total = pg(A_task) + coef x distill.
    both = L.per_token_losses(
        _algo(lossMode="k3", useTaskRewards=True, coef=0.5),
        logprobs=s,
        behaviour_logprobs=mu,
        teacher_logprobs=t,
        task_advantages=torch.tensor([1.0, -1.0]),
    )
    assert torch.allclose(both["pg"], torch.tensor([-1.0, 1.0]))
    assert torch.allclose(both["total"], both["pg"] + 0.5 * both["distill"])
    with pytest.raises(ValueError, match="top-k"):
        L.per_token_losses(_algo(lossMode="forwardKLTopK"), logprobs=s, behaviour_logprobs=mu)
