"""KL estimators, controllers and the in-reward penalty."""

import math

import pytest
import torch

from rlhf_megatron.algorithms import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)

F64 = torch.float64
LN2 = math.log(2.0)


def test_estimators_hand_computed():
    lp = torch.tensor([[math.log(0.5)]], dtype=F64)
    ref = torch.tensor([[math.log(0.25)]], dtype=F64)
    expected = {
        "kl": LN2,
        "k1": LN2,
        "abs": LN2,
        "mse": 0.5 * LN2**2,
        "k2": 0.5 * LN2**2,
        "low_var_kl": 0.5 + LN2 - 1.0,  # exp(-ln2) - (-ln2) - 1
        "k3": 0.5 + LN2 - 1.0,
    }
    for name, value in expected.items():
        assert kl_penalty(lp, ref, name).item() == pytest.approx(value), name
    # abs differs from k1 when the policy is *less* likely than the reference
    assert kl_penalty(ref, lp, "abs").item() == pytest.approx(LN2)
    assert kl_penalty(ref, lp, "kl").item() == pytest.approx(-LN2)


def test_estimators_match_elementwise_formulas():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 6, generator=g, dtype=F64) * 3
    ref = torch.randn(4, 6, generator=g, dtype=F64) * 3
    for name in ("kl", "abs", "mse", "low_var_kl"):
        out = kl_penalty(lp, ref, name)
        for i in range(4):
            for j in range(6):
                d = lp[i, j].item() - ref[i, j].item()
                want = {
                    "kl": d,
                    "abs": abs(d),
                    "mse": 0.5 * d * d,
                    "low_var_kl": min(max(math.exp(-d) + d - 1.0, -10.0), 10.0),
                }[name]
                assert out[i, j].item() == pytest.approx(want, rel=1e-12, abs=1e-12), (name, i, j)


def test_low_var_kl_is_clamped_and_has_finite_gradient():
    lp = torch.tensor([[0.0, -60.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-60.0, 0.0]], dtype=F64)
    out = kl_penalty(lp, ref, "low_var_kl")
    torch.testing.assert_close(out, torch.tensor([[10.0, 10.0]], dtype=F64))
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_full_kl_hand_computed():
    # p = [0.5, 0.5], ref = [0.25, 0.75]: 0.5 ln 2 + 0.5 ln(2/3)
    lp = torch.log(torch.tensor([[[0.5, 0.5]]], dtype=F64))
    ref = torch.log(torch.tensor([[[0.25, 0.75]]], dtype=F64))
    out = kl_penalty(lp, ref, "full")
    assert out.shape == (1, 1)
    assert out.item() == pytest.approx(0.5 * LN2 + 0.5 * math.log(2 / 3))


def test_full_kl_matches_torch_kl_div_and_is_nonnegative():
    g = torch.Generator().manual_seed(1)
    lp = torch.log_softmax(torch.randn(3, 4, 11, generator=g, dtype=F64), -1)
    ref = torch.log_softmax(torch.randn(3, 4, 11, generator=g, dtype=F64), -1)
    out = kl_penalty(lp, ref, "full")
    expected = torch.nn.functional.kl_div(ref, lp, reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(out, expected)
    assert (out >= 0).all()
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        kl_penalty(lp[..., 0], ref[..., 0], "full")


def test_unknown_penalty_and_shape_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown kl_penalty 'k4'.*low_var_kl.*full"):
        kl_penalty(x, x, "k4")
    assert set(KL_PENALTY_NAMES) >= {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"}
    with pytest.raises(ValueError, match=r"logprob has shape \(2, 3\) but ref_logprob has shape \(2, 4\)"):
        kl_penalty(x, torch.zeros(2, 4), "kl")


def test_adaptive_controller_hand_computed():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
    ctrl.update(current_kl=0.1, n_steps=100)  # error clipped to +0.2 -> x1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.045, n_steps=100)  # error -0.1 -> x0.99
    assert ctrl.value == pytest.approx(0.102 * 0.99)
    ctrl.update(current_kl=0.0, n_steps=1000)  # error clipped to -0.2 -> x0.8
    assert ctrl.value == pytest.approx(0.102 * 0.99 * 0.8)


def test_fixed_controller_never_moves():
    ctrl = FixedKLController(kl_coef=0.3)
    ctrl.update(current_kl=5.0, n_steps=10_000)
    assert ctrl.value == 0.3


def test_controller_state_round_trip():
    ctrl = AdaptiveKLController(0.1, 0.05, 1000)
    ctrl.update(0.2, 500)
    fresh = AdaptiveKLController(0.1, 0.02, 300)  # the resumed run's config changed the settings
    fresh.load_state_dict(ctrl.state_dict())
    assert fresh.value == ctrl.value and fresh.value != 0.1
    assert (fresh.target, fresh.horizon) == (0.02, 300)  # settings come from config, not the checkpoint
    fixed = FixedKLController(0.2)
    fixed.load_state_dict({"type": "fixed", "value": 0.7})
    assert fixed.value == 0.7
    with pytest.raises(ValueError, match="'adaptive' KL controller state into a 'fixed'"):
        fixed.load_state_dict(ctrl.state_dict())


def test_get_kl_controller_by_type():
    ctrl = get_kl_controller("adaptive", kl_coef=0.2, target_kl=0.1, horizon=500)
    assert isinstance(ctrl, AdaptiveKLController)
    assert (ctrl.value, ctrl.target, ctrl.horizon) == (0.2, 0.1, 500)
    fixed = get_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    with pytest.raises(ValueError, match="'fixed' or 'adaptive'"):
        get_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="horizon > 0"):
        get_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="kl_coef is required"):
        get_kl_controller("fixed")


def test_apply_kl_penalty_hand_computed_and_updates_controller():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.4, 9.0]])
    ref = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.8, 0.0]])  # scores - 0.5 * kl, padding untouched
    torch.testing.assert_close(rewards, expected)
    # per-seq masked mean kl: [0.2, 0.4] -> batch mean 0.3
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.3)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5  # the beta that was applied
    # error = clip(0.3/0.1 - 1) = 0.2, n_steps = batch size 2: 0.5 * (1 + 0.2 * 2 / 10)
    assert ctrl.value == pytest.approx(0.52)


def test_apply_kl_penalty_shape_and_dtype_errors():
    ctrl = FixedKLController(0.1)
    s = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"old_log_probs has shape \(2, 4\) but token_level_scores has shape \(2, 3\)"
    ):
        apply_kl_penalty(s, torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 3), ctrl)
    with pytest.raises(ValueError, match=r"response_mask has shape \(2, 2\).*\(2, 3\)"):
        apply_kl_penalty(s, torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2), ctrl)
    with pytest.raises(ValueError, match="same dtype"):
        apply_kl_penalty(
            s, torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3, dtype=F64), torch.ones(2, 3), ctrl
        )
