"""GAE, REINFORCE++ and ReMax against hand-computed numbers and plain loops."""

import pytest
import torch

from rlhf_megatron.algorithms import (
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
)
from rlhf_megatron.algorithms.scan import reverse_linear_scan

from . import reference as ref

F64 = torch.float64


def _t(rows):
    return torch.tensor(rows, dtype=F64)


# ---- the scan under GAE / REINFORCE++ ---------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 3, 16, 17, 50])
@pytest.mark.parametrize("chunk", [None, 1, 4, 64])
def test_reverse_linear_scan_matches_loop(steps, chunk):
    g = torch.Generator().manual_seed(steps)
    inc = torch.randn(5, steps, generator=g, dtype=F64)
    decay = torch.rand(5, steps, generator=g, dtype=F64)
    expected = torch.zeros_like(inc)
    for b in range(5):
        y = 0.0
        for t in reversed(range(steps)):
            y = inc[b, t].item() + decay[b, t].item() * y
            expected[b, t] = y
    torch.testing.assert_close(reverse_linear_scan(inc, decay, chunk), expected)


# ---- GAE --------------------------------------------------------------------------------


def test_gae_hand_computed_with_padding():
    # gamma=0.9, lam=0.5, one response of 3 tokens and one padding column holding garbage.
    rewards = _t([[0.0, 0.0, 1.0, 5.0]])
    values = _t([[0.2, 0.4, 0.6, 9.0]])
    mask = _t([[1, 1, 1, 0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.5)
    # delta = [0.9*0.4-0.2, 0.9*0.6-0.4, 1-0.6] = [0.16, 0.14, 0.4]
    # raw A = [0.16+0.45*0.32, 0.14+0.45*0.4, 0.4] = [0.304, 0.32, 0.4]
    torch.testing.assert_close(ret[:, :3], _t([[0.504, 0.72, 1.0]]))
    torch.testing.assert_close(adv, _t([[-0.7258648143402887, -0.4147798939087361, 1.1406447082490259, 0.0]]))


def test_gae_hand_computed_masked_span_carries_values_through():
    # Token 1 is an observation token (mask 0): it neither adds a TD error nor breaks the chain.
    rewards = _t([[0.0, 7.0, 1.0]])
    values = _t([[0.2, 9.0, 0.6]])
    mask = _t([[1, 0, 1]])
    _, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    # A_2 = 1 - 0.6 = 0.4; A_1 carries 0.4; A_0 = (0 + 0.6 - 0.2) + 0.4 = 0.8
    torch.testing.assert_close(ret, _t([[1.0, 9.4, 1.0]]))


@pytest.mark.parametrize("mask_kind", ["ragged", "holey"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_reference_loop(mask_kind, gamma, lam):
    g = torch.Generator().manual_seed(1)
    batch, steps = 7, 23
    rewards = torch.randn(batch, steps, generator=g, dtype=F64)
    values = torch.randn(batch, steps, generator=g, dtype=F64)
    if mask_kind == "ragged":
        mask = ref.ragged_mask(batch, steps, g, min_len=1).double()
    else:
        mask = ref.holey_mask(batch, steps, g).double()
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    exp_adv, exp_ret = ref.gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, _t(exp_adv))
    torch.testing.assert_close(ret, _t(exp_ret))


def test_gae_float32_long_sequences_match_reference():
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(4, 300, generator=g)
    values = torch.randn(4, 300, generator=g)
    mask = ref.ragged_mask(4, 300, g, min_len=100)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    exp_adv, exp_ret = ref.gae(rewards, values, mask, 0.99, 0.95)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(exp_adv), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ret, torch.tensor(exp_ret), rtol=1e-4, atol=1e-4)


def test_gae_padding_invariance():
    g = torch.Generator().manual_seed(3)
    batch, steps, extra = 5, 12, 9
    rewards = torch.randn(batch, steps, generator=g, dtype=F64)
    values = torch.randn(batch, steps, generator=g, dtype=F64)
    mask = ref.ragged_mask(batch, steps, g, min_len=1).double()
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)

    # Extra padding columns with large garbage rewards/values, and NaN values for good measure.
    pad_r = torch.randn(batch, extra, generator=g, dtype=F64) * 100
    pad_v = torch.randn(batch, extra, generator=g, dtype=F64) * 100
    pad_v[:, -1] = float("nan")
    adv2, ret2 = compute_gae_advantage_return(
        torch.cat([rewards, pad_r], 1),
        torch.cat([values, pad_v], 1),
        torch.cat([mask, torch.zeros(batch, extra, dtype=F64)], 1),
        0.9,
        0.8,
    )
    valid = mask.bool()
    torch.testing.assert_close(adv2[:, :steps], adv)
    torch.testing.assert_close(ret2[:, :steps][valid], ret[valid])
    assert (adv2[:, steps:] == 0).all()


def test_gae_all_masked_row_is_zero_and_finite():
    rewards = _t([[1.0, 2.0], [3.0, 4.0]])
    values = _t([[0.5, 0.5], [0.5, 0.5]])
    mask = _t([[1, 1], [0, 0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    torch.testing.assert_close(adv[1], _t([0.0, 0.0]))
    torch.testing.assert_close(ret[0], _t([3.0, 2.0]))


def test_gae_bf16_is_computed_in_float32():
    rewards = torch.zeros(1, 4, dtype=torch.bfloat16)
    rewards[0, -1] = 1.0
    values = torch.zeros(1, 4, dtype=torch.bfloat16)
    adv, ret = compute_gae_advantage_return(rewards, values, torch.ones(1, 4), 1.0, 1.0)
    assert adv.dtype == torch.bfloat16 and ret.dtype == torch.bfloat16
    torch.testing.assert_close(ret.float(), torch.ones(1, 4))


def test_gae_shape_and_dtype_errors_name_both():
    r = torch.zeros(4, 8)
    with pytest.raises(
        ValueError, match=r"values has shape \(4, 7\) but token_level_rewards has shape \(4, 8\)"
    ):
        compute_gae_advantage_return(r, torch.zeros(4, 7), torch.ones(4, 8), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"response_mask has shape \(4, 9\).*\(4, 8\)"):
        compute_gae_advantage_return(r, torch.zeros(4, 8), torch.ones(4, 9), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"float64.*float32"):
        compute_gae_advantage_return(r, torch.zeros(4, 8, dtype=F64), torch.ones(4, 8), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        compute_gae_advantage_return(torch.zeros(8), torch.zeros(8), torch.ones(8), 1.0, 1.0)


# ---- REINFORCE++ ------------------------------------------------------------------------


def test_reinforce_pp_hand_computed():
    rewards = _t([[0.0, 0.0, 1.0], [0.0, 2.0, 3.0]])
    mask = _t([[1, 1, 1], [1, 1, 0]])  # row 1: the reward on padding is ignored
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, _t([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    # whitened over [0.25, 0.5, 1, 1, 2]: mean 0.95, unbiased std 0.67082
    expected = _t(
        [
            [-1.0434983779054754, -0.670820385796377, 0.07453559842181974],
            [0.07453559842181974, 1.5652475668582133, 0.0],
        ]
    )
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("mask_kind", ["ragged", "holey"])
def test_reinforce_pp_matches_reference_loop(mask_kind):
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(6, 19, generator=g, dtype=F64)
    if mask_kind == "ragged":
        mask = ref.ragged_mask(6, 19, g, min_len=1).double()
    else:
        mask = ref.holey_mask(6, 19, g).double()
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.97)
    exp_adv, exp_ret = ref.reinforce_pp(rewards, mask, 0.97)
    torch.testing.assert_close(adv, _t(exp_adv))
    torch.testing.assert_close(ret, _t(exp_ret))


# ---- ReMax ------------------------------------------------------------------------------


def test_remax_hand_computed():
    rewards = _t([[0.0, 0.0, 1.0], [0.5, 0.5, 9.0]])
    mask = _t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_remax_outcome_advantage(rewards, _t([0.4, 2.0]), mask)
    torch.testing.assert_close(ret, _t([[1.0, 1.0, 1.0], [1.0, 0.5, 0.0]]))
    torch.testing.assert_close(adv, _t([[0.6, 0.6, 0.6], [-1.0, -1.5, 0.0]]))


def test_remax_matches_reference_loop():
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(5, 11, generator=g, dtype=F64)
    baselines = torch.randn(5, generator=g, dtype=F64)
    mask = ref.ragged_mask(5, 11, g).double()
    adv, ret = compute_remax_outcome_advantage(rewards, baselines, mask)
    exp_adv, exp_ret = ref.remax(rewards, baselines, mask)
    torch.testing.assert_close(adv, _t(exp_adv))
    torch.testing.assert_close(ret, _t(exp_ret))


def test_remax_baseline_shape_error_names_both():
    with pytest.raises(
        ValueError, match=r"reward_baselines has shape \(3, 1\) but token_level_rewards has shape \(3, 5\)"
    ):
        compute_remax_outcome_advantage(torch.zeros(3, 5), torch.zeros(3, 1), torch.ones(3, 5))
