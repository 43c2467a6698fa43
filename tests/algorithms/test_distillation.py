"""On-policy distillation losses: each mode's value and gradient against its formula, masks, clamps,
and the policy-gradient form (the per-token reverse KL as a negative advantage)."""

import pytest
import torch

from rlhf_megatron.algorithms import (
    DISTILLATION_LOSS_MODES,
    compute_distillation_loss,
    distillation_token_losses,
)

F64 = torch.float64
B, T, K = 3, 7, 4


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    s = -4.0 * torch.rand(B, T, generator=g, dtype=F64)  # log-probs in (-4, 0]: no clamp binds
    t = -4.0 * torch.rand(B, T, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(F64)
    mask[0, 0] = 1.0
    s_k = -4.0 * torch.rand(B, T, K, generator=g, dtype=F64)
    t_k = torch.log_softmax(torch.randn(B, T, K + 3, generator=g, dtype=F64), -1)[..., :K]
    return s, t, mask, s_k, t_k


def _k3(s, t):
    return torch.exp(t - s) - (t - s) - 1


def _k3_grad(s, t):
    return torch.where(_k3(s, t) < 10, 1 - torch.exp(t - s), torch.zeros_like(s))


# Each estimator: (value, d value / d student log-prob), written out from its definition (k3 is
# bounded at 10 by ``algorithms.kl``, where its gradient stops).
FORMULAS = {
    "k1": (lambda s, t: s - t, lambda s, t: torch.ones_like(s)),
    "kl": (lambda s, t: s - t, lambda s, t: torch.ones_like(s)),
    "abs": (lambda s, t: (s - t).abs(), lambda s, t: torch.sign(s - t)),
    "k2": (lambda s, t: 0.5 * (s - t) ** 2, lambda s, t: s - t),
    "mse": (lambda s, t: 0.5 * (s - t) ** 2, lambda s, t: s - t),
    "k3": (lambda s, t: _k3(s, t).clamp(max=10), _k3_grad),
    "low_var_kl": (lambda s, t: _k3(s, t).clamp(max=10), _k3_grad),
}


def test_every_mode_has_a_formula_here():
    assert set(DISTILLATION_LOSS_MODES) == {*FORMULAS, "forward_kl_topk"}


@pytest.mark.parametrize("mode", sorted(FORMULAS))
def test_estimator_value_and_gradient_backpropagated(mode):
    s, t, mask, _, _ = _inputs()
    # Masked positions hold values that would change both the mean and the gradient if counted.
    s = torch.where(mask.bool(), s, torch.full_like(s, -3.0)).requires_grad_(True)
    value, grad = FORMULAS[mode]
    per_token = distillation_token_losses(mode, s, t)
    torch.testing.assert_close(per_token, value(s.detach(), t))
    loss, metrics = compute_distillation_loss(mode, s, s.detach(), t, mask, use_policy_gradient=False)
    n = mask.sum()
    torch.testing.assert_close(loss, (value(s.detach(), t) * mask).sum() / n)
    (got,) = torch.autograd.grad(loss, s)
    torch.testing.assert_close(got, grad(s.detach(), t) * mask / n)
    assert got[~mask.bool()].abs().max() == 0
    torch.testing.assert_close(metrics["reverse_kl"], ((s.detach() - t) * mask).sum() / n)
    torch.testing.assert_close(metrics["student_log_prob_mean"], (s.detach() * mask).sum() / n)
    torch.testing.assert_close(metrics["teacher_log_prob_mean"], (t * mask).sum() / n)
    assert metrics["clamped_frac"] == 0 and metrics["log_prob_clamped_frac"] == 0


def test_forward_kl_topk_value_and_gradient():
    s, t, mask, s_k, t_k = _inputs(1)
    s_k = s_k.requires_grad_(True)
    expected = (t_k.exp() * (t_k - s_k.detach())).sum(-1).clamp_min(0)
    assert (expected > 0).any() and (expected == 0).any()  # both sides of the clamp at 0
    loss, _ = compute_distillation_loss(
        "forward_kl_topk",
        s,
        s,
        t,
        mask,
        use_policy_gradient=False,
        student_topk_log_probs=s_k,
        teacher_topk_log_probs=t_k,
    )
    n = mask.sum()
    torch.testing.assert_close(loss, (expected * mask).sum() / n)
    (got,) = torch.autograd.grad(loss, s_k)
    # d/ds_k sum_k p_T(k) (t_k - s_k) = -p_T(k), where the token's loss is positive and counted.
    live = (mask * (expected > 0)).unsqueeze(-1)
    torch.testing.assert_close(got, -t_k.exp() * live / n)


def test_forward_kl_topk_without_topk_inputs_is_refused():
    s, t, mask, _, _ = _inputs()
    with pytest.raises(ValueError, match="topk"):
        compute_distillation_loss("forward_kl_topk", s, s, t, mask)


def test_unknown_mode_names_the_key_and_the_modes():
    s, t, mask, _, _ = _inputs()
    with pytest.raises(ValueError, match="loss_mode 'jsd'.*k3.*forward_kl_topk"):
        distillation_token_losses("jsd", s, t)


@pytest.mark.parametrize("mode", ["k1", "k3"])
def test_policy_gradient_uses_the_negative_loss_as_advantage(mode):
    """On-policy (log_prob == old_log_prob: ratio 1, no clip binds) the surrogate's value is the mean
    per-token loss and its gradient at token t is d_t / N: the student's log-prob of a token the
    teacher finds likelier (d_t < 0) is pushed up."""
    s, t, mask, _, _ = _inputs(2)
    s = s.requires_grad_(True)
    d = FORMULAS[mode][0](s.detach(), t)
    loss, metrics = compute_distillation_loss(mode, s, s.detach(), t, mask, use_policy_gradient=True)
    n = mask.sum()
    torch.testing.assert_close(loss, (d * mask).sum() / n)
    (got,) = torch.autograd.grad(loss, s)
    torch.testing.assert_close(got, d * mask / n)
    assert metrics["pg_clipfrac"] == 0


def test_policy_gradient_clips_the_ratio():
    """Off-policy past the clip range, tokens with a positive advantage stop pushing."""
    s, t, mask, _, _ = _inputs(3)
    old = s.clone()
    s = (s + 1.0).requires_grad_(True)  # ratio e > 1 + 0.2 everywhere
    loss, metrics = compute_distillation_loss("k1", s, old, t, mask, use_policy_gradient=True)
    (got,) = torch.autograd.grad(loss, s)
    positive_adv = (s.detach() - t) < 0  # advantage -d > 0: clipped at 1.2, no gradient
    assert got[positive_adv & mask.bool()].abs().max() == 0
    assert got[~positive_adv & mask.bool()].abs().min() > 0
    assert metrics["pg_clipfrac"] > 0


def test_loss_max_clamp_bounds_the_loss_and_counts_the_clamped_tokens():
    s, t, mask, _, _ = _inputs(4)
    s = s.clone()
    t = t.clone()
    s[0, 0], t[0, 0] = 0.0, -9.0  # k1 = 9 > 5
    loss, metrics = compute_distillation_loss(
        "k1", s, s, t, torch.ones_like(mask), use_policy_gradient=True, loss_max_clamp=5.0
    )
    d = (s - t).clamp(-5, 5)
    torch.testing.assert_close(loss, d.mean())
    torch.testing.assert_close(metrics["clamped_frac"], ((s - t).abs() > 5).to(F64).mean())
    assert metrics["clamped_frac"] > 0


def test_log_prob_min_clamp_raises_both_sides_and_stops_the_gradient():
    s = torch.tensor([[-12.0, -9.8]], dtype=F64, requires_grad=True)
    t = torch.tensor([[-9.5, -15.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    loss, metrics = compute_distillation_loss(
        "k3", s, s.detach(), t, mask, use_policy_gradient=False, loss_max_clamp=None, log_prob_min_clamp=-10.0
    )
    sc, tc = torch.tensor([[-10.0, -9.8]], dtype=F64), torch.tensor([[-9.5, -10.0]], dtype=F64)
    torch.testing.assert_close(loss, FORMULAS["k3"][0](sc, tc).mean())
    (got,) = torch.autograd.grad(loss, s)
    assert got[0, 0] == 0 and got[0, 1] != 0
    torch.testing.assert_close(metrics["log_prob_clamped_frac"], torch.tensor(1.0, dtype=F64))


def test_teacher_equal_to_student_gives_zero_loss_and_zero_reverse_kl():
    s, _, mask, _, _ = _inputs(5)
    for mode in ("k1", "k3", "k2", "abs"):
        loss, metrics = compute_distillation_loss(mode, s, s, s.clone(), mask, use_policy_gradient=False)
        assert loss == 0 and metrics["reverse_kl"] == 0
