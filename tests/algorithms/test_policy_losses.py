"""Policy-loss registry, vanilla PPO (with dual clip), GSPO and KL-Cov."""

import inspect
import math

import pytest
import torch

from rlhf_megatron.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSS_REGISTRY,
    compute_policy_loss,
    get_policy_loss_fn,
)

from . import reference as ref

F64 = torch.float64
OPTIONS = {"dro_beta": 0.1}  # the one variant option without a default (dro's); the others ignore it


def test_registry_names_and_unknown_name():
    for name in ("vanilla", "gspo", "kl_cov"):
        assert get_policy_loss_fn(name) is POLICY_LOSS_REGISTRY[name]
    assert get_policy_loss_fn("vanilla") is compute_policy_loss
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'.*gspo.*kl_cov.*vanilla"):
        get_policy_loss_fn("ppo2")


def test_vanilla_hand_computed():
    old = torch.zeros(1, 3, dtype=F64)
    new = torch.log(torch.tensor([[1.5, 0.5, 5.0]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    loss, clipfrac, ppo_kl, lower = compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0)
    # token 0: A>0, ratio 1.5 clipped to 1.2 -> -1.2; token 1: A<0, ratio 0.5 clipped to 0.8 -> 0.8;
    # token 2: A<0, ratio 5 -> 5, capped by dual clip at 3.
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0) / 3)
    assert clipfrac.item() == pytest.approx(2 / 3)
    assert lower.item() == pytest.approx(1 / 3)
    assert ppo_kl.item() == pytest.approx(-math.log(1.5 * 0.5 * 5.0) / 3)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.zeros(1, 3, dtype=F64))  # every token is clipped


def test_vanilla_asymmetric_clip_hand_computed():
    old = torch.zeros(1, 2, dtype=F64)
    new = torch.log(torch.tensor([[1.25, 0.75]], dtype=F64)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    # clip-higher: [1 - 0.2, 1 + 0.28] -> 1.25 is inside, 0.75 is below 0.8
    loss, clipfrac, _, _ = compute_policy_loss(
        old, new, adv, torch.ones(1, 2, dtype=F64), cliprange_low=0.2, cliprange_high=0.28
    )
    assert loss.item() == pytest.approx((-1.25 + 0.8) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.25 / 2, 0.0]], dtype=F64))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_vanilla_matches_reference_loop(mode):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 10, generator=g, dtype=F64)
    new = (old + 0.4 * torch.randn(6, 10, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(6, 10, generator=g, dtype=F64)
    mask = ref.ragged_mask(6, 10, g).double()
    loss, clipfrac, ppo_kl, lower = compute_policy_loss(
        old, new, adv, mask, cliprange=0.2, cliprange_high=0.3, clip_ratio_c=2.0, loss_agg_mode=mode
    )
    losses, clipped, dual = ref.ppo_token_losses(old, new.detach(), adv, 0.2, 0.3, 2.0)
    assert loss.item() == pytest.approx(ref.agg(torch.tensor(losses), mask, mode))
    assert clipfrac.item() == pytest.approx(ref.agg(torch.tensor(clipped), mask, "token-mean"))
    assert lower.item() == pytest.approx(ref.agg(torch.tensor(dual), mask, "token-mean"))
    assert ppo_kl.item() == pytest.approx(ref.agg(old - new.detach(), mask, "token-mean"))
    loss.backward()
    assert torch.isfinite(new.grad).all() and new.grad.abs().sum() > 0
    assert (new.grad[mask == 0] == 0).all()


def test_vanilla_rejects_bad_dual_clip_and_mismatched_shapes():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        compute_policy_loss(x, x, x, torch.ones(2, 3), clip_ratio_c=1.0)
    with pytest.raises(ValueError, match=r"old_log_prob has shape \(2, 4\) but log_prob has shape \(2, 3\)"):
        compute_policy_loss(torch.zeros(2, 4), x, x, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"advantages has shape \(3, 3\) but log_prob has shape \(2, 3\)"):
        compute_policy_loss(x, x, torch.zeros(3, 3), torch.ones(2, 3))


def test_gspo_hand_computed_uses_sequence_ratio():
    old = torch.zeros(1, 3, dtype=F64)
    new = torch.tensor([[0.1, 0.3, 7.0]], dtype=F64, requires_grad=True)  # last token is padding
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    gspo = get_policy_loss_fn("gspo")
    seq_ratio = math.exp(0.2)  # exp(mean(0.1, 0.3)) = 1.2214

    # A < 0: unclipped -A * s = 1.2214 beats clipped 1.2, so the gradient flows.
    adv = torch.full((1, 3), -1.0, dtype=F64)
    loss, clipfrac, ppo_kl, lower = gspo(old, new, adv, mask, cliprange=0.2)
    assert loss.item() == pytest.approx(seq_ratio)
    assert clipfrac.item() == 0.0 and lower.item() == 0.0
    assert ppo_kl.item() == pytest.approx(-0.2)
    loss.backward()
    # GSPO-token: d/d lp_t of the seq-mean-token-mean loss is -A * s / n_valid at each valid token.
    torch.testing.assert_close(new.grad, torch.tensor([[seq_ratio / 2, seq_ratio / 2, 0.0]], dtype=F64))

    # A > 0: the ratio is clipped at 1.2 for every token of the sequence.
    loss, clipfrac, _, _ = gspo(old, new.detach(), -adv, mask, cliprange=0.2)
    assert loss.item() == pytest.approx(-1.2)
    assert clipfrac.item() == pytest.approx(1.0)


def test_kl_cov_penalises_top_covariance_tokens():
    old = torch.zeros(1, 4, dtype=F64)
    new = torch.tensor([[-0.1, -0.2, 0.5, -0.3]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[0.0, 0.0, 2.0, 0.0]], dtype=F64)
    mask = torch.ones(1, 4, dtype=F64)
    # Token 2 has the largest (A - mean A)(lp - mean lp); ratio 0.25 of 4 tokens selects only it.
    loss, clipfrac, ppo_kl, lower = get_policy_loss_fn("kl_cov")(
        old, new, adv, mask, kl_cov_ratio=0.25, ppo_kl_coef=2.0
    )
    per_token = [0.0, 0.0, -2.0 * math.exp(0.5) + 2.0 * 0.5, 0.0]
    assert loss.item() == pytest.approx(sum(per_token) / 4)
    assert ppo_kl.item() == pytest.approx((0.1 + 0.2 + 0.5 + 0.3) / 4)
    assert clipfrac.item() == 0.0 and lower.item() == 0.0
    loss.backward()
    assert torch.isfinite(new.grad).all() and new.grad[0, 2] != 0


@pytest.mark.parametrize("name", ["vanilla", "gspo", "kl_cov"])
def test_all_variants_share_one_signature(name):
    g = torch.Generator().manual_seed(1)
    old = torch.randn(4, 6, generator=g)
    new = (old + 0.1 * torch.randn(4, 6, generator=g)).requires_grad_()
    adv = torch.randn(4, 6, generator=g)
    mask = ref.ragged_mask(4, 6, g, min_len=1)
    out = get_policy_loss_fn(name)(
        old,
        new,
        adv,
        mask,
        cliprange=0.2,
        cliprange_low=0.2,
        cliprange_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode="token-mean",
        some_future_option=1,
    )
    assert len(out) == 4 and all(t.dim() == 0 for t in out)
    assert all(not t.requires_grad for t in out[1:])
    # A bool mask means the same as a 0/1 float mask.
    with torch.no_grad():
        out_bool = get_policy_loss_fn(name)(
            old, new, adv, mask.bool(), cliprange_high=0.28, loss_agg_mode="token-mean"
        )
    for a, b in zip(out, out_bool):
        torch.testing.assert_close(a.detach(), b)
    out[0].backward()
    assert torch.isfinite(new.grad).all() and new.grad.abs().sum() > 0


def _random_inputs(seed=2):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 6, generator=g, dtype=F64)
    new = (old + 0.3 * torch.randn(4, 6, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(4, 6, generator=g, dtype=F64)
    return old, new, adv, ref.ragged_mask(4, 6, g, min_len=1).to(F64)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSS_REGISTRY))
def test_rollout_is_weights_of_one_leave_the_loss_unchanged(name, mode):
    old, new, adv, mask = _random_inputs()
    fn = get_policy_loss_fn(name)
    plain = fn(old, new, adv, mask, loss_agg_mode=mode, **OPTIONS)
    (grad,) = torch.autograd.grad(plain[0], new)
    weighted = fn(old, new, adv, mask, loss_agg_mode=mode, rollout_is_weights=torch.ones_like(old), **OPTIONS)
    (grad_w,) = torch.autograd.grad(weighted[0], new)
    for a, b in zip(plain, weighted):
        torch.testing.assert_close(a.detach(), b.detach())
    torch.testing.assert_close(grad, grad_w)


@pytest.mark.parametrize("name", sorted(POLICY_LOSS_REGISTRY))
def test_rollout_is_weights_scale_each_tokens_loss(name):
    old, new, adv, _ = _random_inputs()
    weights = torch.rand(4, 6, generator=torch.Generator().manual_seed(3), dtype=F64) * 2
    fn = get_policy_loss_fn(name)
    # With one valid token, token-mean is that token's loss: weighted, it is w times the loss.
    for row, col in [(0, 0), (1, 3), (3, 5)]:
        mask = torch.zeros(4, 6, dtype=F64)
        mask[row, col] = 1
        plain, *metrics = fn(old, new, adv, mask, loss_agg_mode="token-mean", **OPTIONS)
        weighted, *metrics_w = fn(
            old, new, adv, mask, loss_agg_mode="token-mean", rollout_is_weights=weights, **OPTIONS
        )
        assert weighted.item() == pytest.approx(weights[row, col].item() * plain.item())
        for a, b in zip(metrics, metrics_w):  # the metrics stay unweighted
            torch.testing.assert_close(a, b)


def test_rollout_is_weights_carry_no_gradient_and_must_match_the_shape():
    old, new, adv, mask = _random_inputs()
    weights = torch.full_like(old, 0.5).requires_grad_()
    loss, *_ = compute_policy_loss(old, new, adv, mask, rollout_is_weights=weights)
    loss.backward()
    assert weights.grad is None and new.grad is not None
    plain, *_ = compute_policy_loss(old, new, adv, mask)
    assert loss.item() == pytest.approx(0.5 * plain.item())
    with pytest.raises(ValueError, match="rollout_is_weights has shape"):
        compute_policy_loss(old, new, adv, mask, rollout_is_weights=torch.ones(4, 5, dtype=F64))


def test_every_registered_variant_takes_rollout_is_weights():
    for name, fn in POLICY_LOSS_REGISTRY.items():
        assert "rollout_is_weights" in inspect.signature(fn).parameters, name
