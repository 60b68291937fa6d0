"""Each loss against values computed by hand, and the gradients the design relies on."""

from __future__ import annotations

import math

import numpy as np
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
    assert L.forward_kl_top_k(s, t, renormalize=True).item() == pytest.approx(renorm, rel=1e-5)
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


def test_k3_policy_gradient_is_the_reverse_kl_gradient() -> None:
    """On an enumerable distribution, the expected gradient of the k3 + usePolicyGradient loss
    under student samples is the reverse-KL gradient: the score term alone would be
    grad RKL - grad FKL, k3's own pathwise term adds grad FKL back."""
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(5, generator=g, requires_grad=True)
    log_p = (torch.randn(5, generator=g) * 0.5).log_softmax(-1)
    log_q = theta.log_softmax(-1)
    algo = _algo(lossMode="k3", usePolicyGradient=True, lossMaxClamp=10.0, advantageBaseline="none")
    losses = L.per_token_losses(algo, logprobs=log_q, behaviour_logprobs=log_q.detach(), teacher_logprobs=log_p)
    expected = (log_q.exp().detach() * losses["total"]).sum()  # E_{y~q}[loss(y)], q held fixed
    (got,) = torch.autograd.grad(expected, theta, retain_graph=True)
    q = log_q.exp()
    reverse = (q * (log_q - log_p)).sum()
    (want,) = torch.autograd.grad(reverse, theta, retain_graph=True)
    assert torch.allclose(got, want, atol=1e-5)
    forward = (log_p.exp() * (log_p - log_q)).sum()
    (fkl,) = torch.autograd.grad(forward, theta)
    assert not torch.allclose(fkl, torch.zeros_like(fkl), atol=1e-3)  # the term the score alone misses


@pytest.mark.parametrize("loss_max_clamp", [10.0, 3.0])
def test_k3_policy_gradient_never_reverses_at_the_clamp(loss_max_clamp: float) -> None:
    """A sampled token the teacher likes far more than the student (p_T/q = 50, k3 ~ 45 > the
    clamp) must be pushed up, as k1 pushes it: clamping k3 alone would zero its pathwise gradient
    and leave the score term pushing the token down."""
    s = torch.tensor([math.log(0.01), math.log(0.5)], requires_grad=True)
    t = torch.tensor([math.log(0.5), math.log(0.5)])
    grads = {}
    for mode in ("k1", "k3"):
        algo = _algo(lossMode=mode, usePolicyGradient=True, lossMaxClamp=loss_max_clamp, advantageBaseline="none")
        losses = L.per_token_losses(algo, logprobs=s, behaviour_logprobs=s.detach(), teacher_logprobs=t)
        (grads[mode],) = torch.autograd.grad(losses["total"].sum(), s)
    assert grads["k3"][0] < 0  # descent raises log q of the teacher's favourite
    assert torch.allclose(grads["k3"], grads["k1"])  # (k3 - b) + (1 - r) = k1 - b per token
    assert grads["k3"][1] == 0.0  # where student and teacher agree there is nothing to learn


def test_group_advantages_by_hand() -> None:
    from kubedistill.api.spec import Advantage

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    groups = [0, 0, 0, 1, 1, 2]
    adv = L.group_advantages(rewards, groups)
    std0 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased
    assert adv[0].item() == pytest.approx((2 / 3) / (std0 + 1e-6), rel=1e-5)
    assert adv[1].item() == pytest.approx((-1 / 3) / (std0 + 1e-6), rel=1e-5)
    assert adv[3].item() == 0.0 and adv[4].item() == 0.0  # equal rewards
    assert adv[5].item() == 0.0  # a group of one
    # rloo: the reward minus the mean of the group's other samples.
    rloo = L.group_advantages(rewards, groups, Advantage.rloo)
    assert rloo[:3].tolist() == pytest.approx([1.0, -0.5, -0.5])
    assert rloo[3:].tolist() == [0.0, 0.0, 0.0]
    # groupMean (Dr. GRPO): centred, not scaled.
    mean_only = L.group_advantages(rewards, groups, Advantage.group_mean)
    assert mean_only[:3].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert mean_only[5].item() == 0.0


def test_ppo_loss_clip_and_truncated_importance_weight() -> None:
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    old = torch.log(torch.tensor([0.5, 2.0, 1.0, 1.0]))  # ratios r = 2, 0.5, 1, 1
    behaviour = torch.log(torch.tensor([0.5, 2.0, 0.1, 2.0]))  # w = min(old/mu, 2) = 1, 1, 2, 0.5
    adv = torch.tensor([1.0, -1.0, 1.0, -2.0])
    w, cut = L.importance_weights(old - behaviour, high=2.0)
    assert cut.tolist() == [False, False, True, False]
    loss = L.ppo_loss(logp, old, adv, w, clip_ratio=0.2)
    # r=2, A=1: max(-2, -1.2) = -1.2; r=0.5, A=-1: max(0.5, 0.8) = 0.8;
    # r=1, A=1, w=2: -2; r=1, A=-2, w=0.5: 1.
    assert torch.allclose(loss, torch.tensor([-1.2, 0.8, -2.0, 1.0]), atol=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # Clipped tokens carry no gradient; the others -w A r.
    assert torch.allclose(grad, torch.tensor([0.0, 0.0, -2.0, 1.0]), atol=1e-6)


def test_token_weights_aggregate_as_the_mode_says() -> None:
    flat = torch.tensor([1.0, 2.0, 3.0, 5.0])  # two responses of two tokens each
    for mode, expected in (("tokenMean", 11.0 / 4), ("seqMeanTokenMean", (1.5 + 4.0) / 2)):
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


def test_importance_weights_token_and_sequence_truncate_and_mask() -> None:
    from kubedistill.api.spec import ImportanceLevel, ImportanceMode

    # Two samples: tokens 0-1 (ratios 3 and 0.5) and token 2 (ratio 1.5).
    log_ratio = torch.log(torch.tensor([3.0, 0.5, 1.5]))
    segments = torch.tensor([0, 0, 1])
    w, cut = L.importance_weights(log_ratio, high=2.0)
    assert torch.allclose(w, torch.tensor([2.0, 0.5, 1.5])) and cut.tolist() == [True, False, False]
    w, cut = L.importance_weights(log_ratio, mode=ImportanceMode.mask, low=0.6, high=2.0)
    assert torch.allclose(w, torch.tensor([0.0, 0.0, 1.5])) and cut.tolist() == [True, True, False]
    # Sequence level: sample 0's ratio is 3 x 0.5 = 1.5 on both its tokens.
    w, cut = L.importance_weights(log_ratio, level=ImportanceLevel.sequence, high=2.0, segments=segments)
    assert torch.allclose(w, torch.tensor([1.5, 1.5, 1.5])) and not cut.any()
    w, cut = L.importance_weights(
        log_ratio, level=ImportanceLevel.sequence, mode=ImportanceMode.mask, low=0.0, high=1.2, segments=segments
    )
    assert torch.allclose(w, torch.zeros(3)) and cut.all()
    # A ratio that overflows float32 is cut, not inf or nan.
    w, cut = L.importance_weights(torch.tensor([500.0]), high=2.0)
    assert w.item() == 2.0 and cut.item()
    with pytest.raises(ValueError, match="segments"):
        L.importance_weights(log_ratio, level=ImportanceLevel.sequence)


def test_batch_baseline_centres_the_policy_gradient_advantage() -> None:
    from kubedistill.api.spec import DistillationSpec, LossMode

    mu = torch.tensor([-1.0, -2.0, -0.5])
    t = torch.tensor([-1.5, -30.0, -0.5])
    # k1 at mu: 0.5, 28 (clamped to 10), 0 -> mean 3.5.
    b = L.batch_baseline(DistillationSpec(loss_mode=LossMode.k1, loss_max_clamp=10.0), mu, t)
    assert b == pytest.approx(3.5)
    s = mu.clone()
    adv = L.distillation_advantages(L.k1(s, t), 10.0, b)
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert torch.allclose(adv, -(torch.tensor([0.5, 10.0, 0.0]) - 3.5))
    k3b = L.batch_baseline(DistillationSpec(loss_mode=LossMode.k3, loss_max_clamp=10.0), mu, t)
    assert k3b == pytest.approx(float(L.k3(mu, t).mean()))
    with_baseline = L.per_token_losses(
        _algo(lossMode="k1", usePolicyGradient=True),
        logprobs=s,
        behaviour_logprobs=mu,
        teacher_logprobs=t,
        advantage_baseline=b,
    )
    assert torch.allclose(with_baseline["advantage"], adv)
    assert torch.allclose(with_baseline["is_weight"], torch.ones(3)) and not with_baseline["is_cut"].any()


def test_proximal_log_probs_anchor_the_clip() -> None:
    # The proximal policy (start of the step) differs from the current weights: the ratio to it
    # is clipped, and the importance weight is proximal / behaviour, not current / behaviour.
    s = torch.log(torch.tensor([0.9, 0.5])).requires_grad_(True)
    prox = torch.log(torch.tensor([0.5, 0.5]))
    mu = torch.log(torch.tensor([0.5, 0.25]))
    t = torch.log(torch.tensor([0.99, 0.25]))
    algo = _algo(lossMode="k1", usePolicyGradient=True, advantageBaseline="none")
    out = L.per_token_losses(algo, logprobs=s, behaviour_logprobs=mu, teacher_logprobs=t, old_logprobs=prox)
    assert torch.allclose(out["is_weight"], torch.tensor([1.0, 2.0]))
    assert torch.allclose(out["log_ratio"], prox - mu)
    (grad,) = torch.autograd.grad(out["total"].sum(), s)
    # Token 0: ratio 0.9 / 0.5 = 1.8 > 1.2 with A = log(0.99 / 0.9) > 0: clipped, no gradient.
    # Token 1: ratio 1, A = log(0.25 / 0.5), w = 2: gradient -w A = 2 log 2.
    assert torch.allclose(grad, torch.tensor([0.0, 2 * math.log(2)]), atol=1e-6)
    # Against the current weights (no proximal) token 0 is not clipped: gradient -w A, w = 0.9 / 0.5.
    current = L.per_token_losses(algo, logprobs=s, behaviour_logprobs=mu, teacher_logprobs=t)
    (grad,) = torch.autograd.grad(current["total"].sum(), s)
    assert grad[0].item() == pytest.approx(-1.8 * math.log(0.99 / 0.9), rel=1e-5)


def test_reverse_kl_top_k_by_hand_and_its_gradient() -> None:
    # One position, the student's top-2 ids: q = (0.6, 0.3) (0.1 elsewhere), teacher p = (0.5, 0.4).
    q = torch.tensor([[0.6, 0.3]])
    p = torch.tensor([[0.5, 0.4]])
    plain = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.4)
    assert L.reverse_kl_top_k(q.log(), p.log()).item() == pytest.approx(plain, rel=1e-5)
    # Renormalised over K: q' = (2/3, 1/3), p' = (5/9, 4/9).
    renorm = (2 / 3) * math.log((2 / 3) / (5 / 9)) + (1 / 3) * math.log((1 / 3) / (4 / 9))
    assert L.reverse_kl_top_k(q.log(), p.log(), renormalize=True).item() == pytest.approx(renorm, rel=1e-5)
    # A teacher log-prob of -50 is clamped to -10; a padded slot adds nothing.
    clamped = 0.6 * (math.log(0.6) + 10.0)
    value = L.reverse_kl_top_k(q.log(), torch.tensor([[-50.0, -1.0]]), valid=torch.tensor([[True, False]]))
    assert value.item() == pytest.approx(clamped, rel=1e-6)
    # With k = the whole vocabulary it is the exact reverse KL, and its gradient wrt the student's
    # logits is the exact reverse-KL gradient.
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.0]], requires_grad=True)
    teacher = torch.log_softmax(torch.tensor([[0.3, 1.0, -1.0, 0.1]]), -1)
    s = torch.log_softmax(logits, -1)
    exact = (s.exp() * (s - teacher)).sum()
    ours = L.reverse_kl_top_k(s, teacher).sum()
    assert ours.item() == pytest.approx(exact.item(), rel=1e-6)
    (g_ours,) = torch.autograd.grad(ours, logits, retain_graph=True)
    (g_exact,) = torch.autograd.grad(exact, logits)
    assert torch.allclose(g_ours, g_exact, atol=1e-6)


def test_reverse_kl_top_k_is_a_direct_loss_in_per_token_losses() -> None:
    s_topk = torch.log(torch.tensor([[0.6, 0.3], [0.9, 0.05]])).requires_grad_(True)
    t_topk = torch.log(torch.tensor([[0.5, 0.4], [0.2, 0.7]]))
    out = L.per_token_losses(
        _algo(lossMode="reverseKLTopK", topK=2),
        logprobs=torch.tensor([-0.5, -0.1]),
        behaviour_logprobs=torch.tensor([-0.5, -0.1]),
        student_topk_logprobs=s_topk,
        teacher_topk_logprobs=t_topk,
        segments=torch.tensor([0, 0]),
    )
    expected = L.reverse_kl_top_k(s_topk, t_topk)
    assert torch.allclose(out["total"], expected) and torch.allclose(out["distill"], expected)
    with pytest.raises(ValueError, match="reverseKLTopK needs top-k ids"):
        L.per_token_losses(_algo(lossMode="reverseKLTopK"), logprobs=torch.zeros(1), behaviour_logprobs=torch.zeros(1))


# ---- off-policy correction of the direct losses (docs/algorithms.md) -------------------------


def _numpy_weights(log_ratio: np.ndarray, segments: np.ndarray, imp: dict, shift: bool) -> np.ndarray:
    """The reference: per token w = IS(exp(log pi_prox - mu)), of y_t itself for a term of the
    sampled token, of y_(t-1) (1 at a sample's first token) for a top-k term, or of the sample."""
    r = log_ratio.copy()
    if imp.get("level") == "sequence":
        r = np.array([log_ratio[segments == g].sum() for g in segments])
    elif shift:
        r = np.array([0.0 if t == 0 or segments[t - 1] != segments[t] else log_ratio[t - 1] for t in range(len(r))])
    w = np.exp(r)
    low, high = imp.get("low", 0.0), imp.get("high", 2.0)
    mode = imp.get("mode", "truncate")
    if mode == "none":
        return np.ones_like(w)
    if mode == "truncate":
        return np.minimum(w, high)
    return np.where((w < low) | (w > high), 0.0, w)


IMPORTANCE_CASES = [
    {},
    {"mode": "mask", "low": 0.5, "high": 1.5},
    {"level": "sequence", "high": 3.0},
    {"level": "sequence", "mode": "mask", "low": 0.2, "high": 4.0},
    {"mode": "none"},
]


@pytest.mark.parametrize("imp", IMPORTANCE_CASES)
def test_direct_k3_is_weighted_like_the_numpy_reference(imp: dict) -> None:
    rng = np.random.default_rng(0)
    n = 9
    segments = np.array([0, 0, 0, 0, 1, 1, 2, 2, 2])
    s_np = rng.uniform(-3.0, -0.2, n)
    mu_np = s_np + rng.normal(0.0, 0.6, n)  # stale samples: the behaviour policy differs
    t_np = s_np + rng.normal(0.0, 1.0, n)
    s = torch.tensor(s_np, requires_grad=True)
    algo = AlgorithmSpec.model_validate({"distillation": {"lossMode": "k3"}, "offPolicy": {"importance": imp}})
    out = L.per_token_losses(
        algo,
        logprobs=s,
        behaviour_logprobs=torch.tensor(mu_np),
        teacher_logprobs=torch.tensor(t_np),
        segments=torch.tensor(segments),
    )
    w = _numpy_weights(s_np - mu_np, segments, imp, shift=False)
    k3 = np.exp(t_np - s_np) - (t_np - s_np) - 1.0
    assert out["distill"].detach().numpy() == pytest.approx(w * k3, rel=1e-9)
    assert out["is_weight"].numpy() == pytest.approx(w, rel=1e-9)
    assert out["is_cut"].any() == (imp.get("mode") != "none")  # the cases are built to cut some
    # The weight is a constant: the gradient is w times k3's own, (1 - p_T / q) per token.
    (grad,) = torch.autograd.grad(out["total"].sum(), s)
    assert grad.numpy() == pytest.approx(w * (1.0 - np.exp(t_np - s_np)), rel=1e-9)


@pytest.mark.parametrize("imp", IMPORTANCE_CASES)
@pytest.mark.parametrize("mode", ["forwardKLTopK", "reverseKLTopK"])
def test_direct_top_k_terms_take_the_previous_tokens_weight(mode: str, imp: dict) -> None:
    rng = np.random.default_rng(1)
    n, k = 7, 3
    segments = np.array([0, 0, 0, 1, 1, 1, 1])
    s_np = rng.uniform(-3.0, -0.2, n)
    mu_np = s_np + rng.normal(0.0, 0.8, n)
    s_topk = torch.tensor(np.log(rng.dirichlet(np.ones(k + 1), n)[:, :k]), requires_grad=True)
    t_topk = torch.tensor(np.log(rng.dirichlet(np.ones(k + 1), n)[:, :k]))
    algo = AlgorithmSpec.model_validate(
        {"distillation": {"lossMode": mode, "topK": k}, "offPolicy": {"importance": imp}}
    )
    out = L.per_token_losses(
        algo,
        logprobs=torch.tensor(s_np),
        behaviour_logprobs=torch.tensor(mu_np),
        student_topk_logprobs=s_topk,
        teacher_topk_logprobs=t_topk,
        segments=torch.tensor(segments),
    )
    w = _numpy_weights(s_np - mu_np, segments, imp, shift=True)
    q, p = s_topk.detach().numpy(), t_topk.numpy()
    if mode == "forwardKLTopK":
        term = np.maximum((np.exp(p) * (p - q)).sum(-1), 0.0)
    else:
        term = (np.exp(q) * (q - p)).sum(-1)
    assert out["distill"].detach().numpy() == pytest.approx(w * term, rel=1e-9)
    assert out["is_weight"].numpy() == pytest.approx(w, rel=1e-9)
    assert w[0] == 1.0 or imp.get("level") == "sequence"  # a sample's first position: only the prompt before it
    (grad,) = torch.autograd.grad(out["total"].sum(), s_topk)
    (unweighted,) = torch.autograd.grad(
        (
            torch.tensor(w)
            * getattr(L, "forward_kl_top_k" if mode == "forwardKLTopK" else "reverse_kl_top_k")(s_topk, t_topk)
        ).sum(),
        s_topk,
    )
    assert torch.allclose(grad, unweighted)


def test_weighted_direct_k3_has_the_on_policy_expected_gradient() -> None:
    # One position, a 4-token vocabulary. Samples drawn from a stale mu, weighted by pi / mu
    # (untruncated), give in expectation the gradient of direct k3 under the current policy pi:
    # sum_y mu(y) w(y) grad k3(y) = sum_y pi(y) grad k3(y) = grad KL(p_T || pi) (the forward KL).
    logits = torch.tensor([0.5, -0.2, 1.0, 0.1], requires_grad=True)
    mu = torch.softmax(torch.tensor([1.2, 0.0, 0.3, -0.5]), -1)
    teacher = torch.log_softmax(torch.tensor([0.0, 1.0, 0.5, -1.0]), -1)
    algo = AlgorithmSpec.model_validate(
        {"distillation": {"lossMode": "k3", "lossMaxClamp": 50.0}, "offPolicy": {"importance": {"high": 1000.0}}}
    )
    s = torch.log_softmax(logits, -1)
    out = L.per_token_losses(
        algo, logprobs=s, behaviour_logprobs=mu.log(), teacher_logprobs=teacher, segments=torch.arange(4)
    )
    (weighted,) = torch.autograd.grad((mu * out["total"]).sum(), logits)
    forward_kl = (teacher.exp() * (teacher - torch.log_softmax(logits, -1))).sum()
    (exact,) = torch.autograd.grad(forward_kl, logits)
    assert torch.allclose(weighted, exact, atol=1e-6)
    # Without the correction the same samples follow mu's weighting of the terms instead.
    none = AlgorithmSpec.model_validate(
        {"distillation": {"lossMode": "k3", "lossMaxClamp": 50.0}, "offPolicy": {"importance": {"mode": "none"}}}
    )
    s = torch.log_softmax(logits, -1)
    plain = L.per_token_losses(none, logprobs=s, behaviour_logprobs=mu.log(), teacher_logprobs=teacher)
    (uncorrected,) = torch.autograd.grad((mu * plain["total"]).sum(), logits)
    assert not torch.allclose(uncorrected, exact, atol=1e-3)
