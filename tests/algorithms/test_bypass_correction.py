"""Bypass mode's loss-time rollout correction: REINFORCE with IS weights of pi_theta / pi_rollout,
and the rejection mask, each checked in value and gradient against the formula written out here."""

import math
import zlib

import pytest
import torch

from rlhf_megatron.algorithms import agg_loss, apply_rollout_correction
from rlhf_megatron.algorithms.bypass_correction import (
    compute_bypass_correction,
    compute_policy_loss_reinforce,
    corrects_at_loss_time,
)
from rlhf_megatron.config.schema import RolloutCorrectionConfig

from .reference import holey_mask, ragged_mask

F64 = torch.float64
P = "rollout_corr/"
B, R = 6, 9


def _inputs(seed: int, holey: bool = False):
    """log pi_theta (leaf), log pi_rollout, advantages, mask; log-ratios spread over about e^+-1.5
    so that caps and bands bite, and NaN/-inf on padding, which must not leak."""
    g = torch.Generator().manual_seed(seed)
    mask = holey_mask(B, R, g) if holey else ragged_mask(B, R, g, min_len=1)
    mask = mask.to(F64)
    mask[0, :] = 0.0  # a response without any valid token
    rollout = -torch.rand(B, R, generator=g, dtype=F64) * 3 - 0.05
    current = rollout + (torch.rand(B, R, generator=g, dtype=F64) - 0.5) * 3 / math.sqrt(R)
    current[1] = rollout[1] + 0.4  # one response far off: its sequence weight exceeds any cap
    advantages = torch.randn(B, R, generator=g, dtype=F64)
    valid = mask.bool()
    current = torch.where(valid, current, torch.tensor(float("nan"), dtype=F64)).requires_grad_(True)
    rollout = torch.where(valid, rollout, torch.tensor(float("-inf"), dtype=F64))
    return current, rollout, advantages, mask


def _expected_weights(current, rollout, mask, level, threshold):
    """w from r = exp(current - rollout) per token, or per response exp(sum of log r), written
    out row by row: capped at a number, or zeroed outside a 'lo_hi' band; 0 off the mask."""
    out = torch.zeros(B, R, dtype=F64)
    for i in range(B):
        idx = [t for t in range(R) if mask[i, t]]
        log_r = {t: float(current[i, t] - rollout[i, t]) for t in idx}
        seq = math.exp(sum(log_r.values()))
        for t in idx:
            w = seq if level == "sequence" else math.exp(log_r[t])
            if isinstance(threshold, str):
                lo, hi = (float(x) for x in threshold.split("_"))
                w = w if lo <= w <= hi else 0.0
            else:
                w = min(w, threshold)
            out[i, t] = w
    return out


def _expected_k1_mask(current, rollout, mask, lo, hi):
    """token_k1 rejection: keep a token when its ratio r lies in [lo, hi]."""
    ratio = torch.exp((current.detach() - rollout).nan_to_num(0.0, posinf=0.0, neginf=0.0))
    return mask * ((ratio >= lo) & (ratio <= hi)).to(F64)


def _agg_grad(weights, advantages, mask, mode):
    """d/d log pi of agg(-w * A * log pi): -w * A times the aggregation's per-token factor."""
    valid = mask.bool()
    if mode == "token-mean":
        factor = mask / mask.sum()
    elif mode == "seq-mean-token-sum":
        factor = mask / B
    else:  # seq-mean-token-mean
        factor = mask / (B * mask.sum(-1, keepdim=True).clamp(min=1))
    return torch.where(valid, -weights * advantages * factor, torch.zeros((), dtype=F64))


def _cfg(**kw) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", **kw)


CASES = [
    pytest.param("token", 1.3, None, id="token-cap"),
    pytest.param("sequence", 1.5, None, id="sequence-cap"),
    pytest.param("token", "0.7_1.4", None, id="token-icepop"),
    pytest.param("sequence", "0.5_2.0", None, id="sequence-icepop"),
    pytest.param(None, 2.0, None, id="no-is"),
    pytest.param("token", 1.3, (0.8, 1.25), id="token-cap-rs"),
    pytest.param("sequence", 1.5, (0.8, 1.25), id="sequence-cap-rs"),
    pytest.param(None, 2.0, (0.8, 1.25), id="no-is-rs"),
]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("level, threshold, band", CASES)
def test_reinforce_value_and_gradient_match_the_formula(level, threshold, band, mode):
    current, rollout, advantages, mask = _inputs(
        seed=zlib.crc32(repr((level, threshold, band)).encode()), holey=True
    )
    rs = {} if band is None else {"rollout_rs": "token_k1", "rollout_rs_threshold": f"{band[0]}_{band[1]}"}
    cfg = _cfg(rollout_is=level, rollout_is_threshold=threshold, **rs)

    weights, pg_mask, metrics = compute_bypass_correction(current, rollout, mask, cfg)
    pg_loss, ppo_kl = compute_policy_loss_reinforce(current, rollout, advantages, pg_mask, mode, weights)
    pg_loss.backward()

    detached = current.detach()
    w = (
        torch.ones(B, R, dtype=F64)
        if level is None
        else _expected_weights(detached, rollout, mask, level, threshold)
    )
    keep = mask if band is None else _expected_k1_mask(detached, rollout, mask, *band)
    assert weights is None if level is None else torch.allclose(weights, w)
    assert torch.equal(pg_mask, keep)
    if band is not None:
        assert 0 < keep.sum() < mask.sum(), "the band should reject some tokens and keep others"
    valid = keep.bool()
    zero = torch.zeros((), dtype=F64)
    per_token = torch.where(valid, -w * advantages * detached, zero)
    torch.testing.assert_close(pg_loss, agg_loss(per_token, keep, mode))
    torch.testing.assert_close(current.grad, _agg_grad(w, advantages, keep, mode))
    diff = torch.where(valid, rollout - detached, zero)
    torch.testing.assert_close(ppo_kl, diff.sum() / keep.sum())
    assert not ppo_kl.requires_grad

    # Metrics of the loss-time weights (before rejection) and of the rejection.
    if level is not None:
        unit = mask.bool() if level == "token" else mask.bool().any(-1, keepdim=True) & mask.bool()
        first = torch.cumsum(mask, -1) == 1  # one token per response: the sequence's unit
        units = w[unit & first] if level == "sequence" else w[unit]
        assert metrics[f"{P}rollout_is_mean"] == pytest.approx(float(units.mean()))
        assert metrics[f"{P}rollout_is_max"] == pytest.approx(float(units.max()))
    else:
        assert f"{P}rollout_is_mean" not in metrics
    if band is not None:
        rejected = float((mask.sum() - keep.sum()) / mask.sum())
        assert metrics[f"{P}rollout_rs_masked_fraction"] == pytest.approx(rejected)
    # The off-policy diagnostics see pi_theta where the decoupled mode sees pi_old.
    kl = float(torch.where(mask.bool(), rollout - detached, zero).sum() / mask.sum())
    assert metrics[f"{P}kl"] == pytest.approx(kl)


def test_caps_and_bands_change_the_gradient():
    """The weights reach the gradient: a capped token keeps the cap as its weight, and
    IcePop zeroes it outside the band."""
    current, rollout, advantages, mask = _inputs(seed=7)
    grads = {}
    settings = {
        "off": {},
        "cap": {"rollout_is": "token", "rollout_is_threshold": 1.05},
        "band": {"rollout_is": "token", "rollout_is_threshold": "0.9_1.1"},
    }
    for name, kw in settings.items():
        leaf = current.detach().clone().requires_grad_(True)
        weights, pg_mask, _ = compute_bypass_correction(leaf, rollout, mask, _cfg(**kw))
        compute_policy_loss_reinforce(leaf, rollout, advantages, pg_mask, "token-mean", weights)[0].backward()
        grads[name] = leaf.grad
    ratio = torch.exp((current.detach() - rollout).nan_to_num(0.0, posinf=0.0, neginf=0.0))
    valid = mask.bool()
    over, outside = valid & (ratio > 1.1), valid & ((ratio < 0.9) | (ratio > 1.1))
    assert over.any() and (valid & ~outside).any()
    torch.testing.assert_close(grads["cap"][over], grads["off"][over] * 1.05)
    assert torch.all(grads["band"][outside] == 0)
    torch.testing.assert_close(grads["band"][valid & ~outside], (grads["off"] * ratio)[valid & ~outside])
    assert torch.all(grads["off"][~valid] == 0) and not grads["off"].isnan().any()


def test_ppo_clip_bypass_only_narrows_the_mask():
    current, rollout, _, mask = _inputs(seed=3)
    cfg = RolloutCorrectionConfig(bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")
    weights, pg_mask, metrics = compute_bypass_correction(current, rollout, mask, cfg)
    assert weights is None
    assert torch.equal(pg_mask, _expected_k1_mask(current, rollout, mask, 0.8, 1.25))
    assert 0 < pg_mask.sum() < mask.sum()
    assert f"{P}rollout_is_mean" not in metrics
    assert metrics[f"{P}rollout_rs_token_k1_masked_fraction"] == pytest.approx(
        float((mask.sum() - pg_mask.sum()) / mask.sum())
    )


def test_which_configs_correct_at_loss_time():
    assert not corrects_at_loss_time(RolloutCorrectionConfig())
    assert not corrects_at_loss_time(RolloutCorrectionConfig(bypass_mode=True))
    assert not corrects_at_loss_time(
        RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=1.0)
    )
    assert corrects_at_loss_time(_cfg())
    assert corrects_at_loss_time(
        RolloutCorrectionConfig(bypass_mode=True, rollout_rs="token_k2", rollout_rs_threshold=1.0)
    )


def test_the_driver_leaves_bypass_mode_to_the_loss():
    current, rollout, _, mask = _inputs(seed=5)
    batch = {"old_log_probs": rollout.clone(), "rollout_log_probs": rollout, "response_mask": mask}
    cfg = _cfg(rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=0.01)
    assert apply_rollout_correction(batch, cfg) == {}
    assert set(batch) == {"old_log_probs", "rollout_log_probs", "response_mask"}
    assert batch["response_mask"] is mask


def test_shapes_are_checked_naming_the_function():
    current, rollout, advantages, mask = _inputs(seed=1)
    with pytest.raises(ValueError, match="compute_policy_loss_reinforce"):
        compute_policy_loss_reinforce(current, rollout, advantages[:, :-1], mask)
    with pytest.raises(ValueError, match="compute_bypass_correction"):
        compute_bypass_correction(current, rollout[:-1], mask, _cfg())


def test_weights_are_stop_gradient_even_when_passed_with_a_graph():
    """sg(w): a weight built from log pi_theta itself adds no term to the gradient."""
    current, rollout, advantages, mask = _inputs(seed=11)
    valid = mask.bool()
    live = torch.where(valid, torch.exp(current - rollout), torch.zeros((), dtype=F64))  # in the graph
    loss, _ = compute_policy_loss_reinforce(current, rollout, advantages, mask, "token-mean", live)
    loss.backward()
    torch.testing.assert_close(current.grad, _agg_grad(live.detach(), advantages, mask, "token-mean"))
