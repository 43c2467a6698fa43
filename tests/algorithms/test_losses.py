"""Loss aggregation, value loss and entropy."""

import math

import pytest
import torch

from rlhf_megatron.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_value_loss,
    entropy_from_logits,
)

from . import reference as ref

F64 = torch.float64
LN2 = math.log(2.0)


def test_agg_loss_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row is all padding
    expected = {
        "token-mean": 10 / 4,
        "seq-mean-token-sum": (6 + 4 + 0) / 3,
        "seq-mean-token-mean": (2 + 4 + 0) / 3,
        "seq-mean-token-sum-norm": (6 + 4 + 0) / 3 / 3,
    }
    assert set(expected) == set(LOSS_AGG_MODES)
    for mode, value in expected.items():
        assert agg_loss(loss, mask, mode).item() == pytest.approx(value), mode


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_reference_and_has_gradient(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 8, generator=g, dtype=F64, requires_grad=True)
    mask = ref.ragged_mask(6, 8, g).double()
    out = agg_loss(loss, mask, mode)
    assert out.item() == pytest.approx(ref.agg(loss.detach(), mask, mode))
    out.backward()
    assert torch.isfinite(loss.grad).all()
    assert (loss.grad[mask == 0] == 0).all()
    assert (loss.grad[mask == 1] != 0).all()


def test_agg_loss_all_masked_is_zero_and_unknown_mode_lists_modes():
    loss = torch.ones(2, 3, requires_grad=True)
    for mode in LOSS_AGG_MODES:
        assert agg_loss(loss, torch.zeros(2, 3), mode).item() == 0.0
    with pytest.raises(
        ValueError, match="unknown loss_agg_mode 'seq-mean'.*token-mean.*seq-mean-token-sum-norm"
    ):
        agg_loss(loss, torch.ones(2, 3), "seq-mean")
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2, 4\) but loss_mat has shape \(2, 3\)"):
        agg_loss(loss, torch.ones(2, 4), "token-mean")


def test_value_loss_hand_computed():
    vpreds = torch.tensor([[1.0, 0.0]], requires_grad=True)
    values = torch.tensor([[0.5, 0.5]])
    returns = torch.tensor([[2.0, 0.0]])
    mask = torch.ones(1, 2)
    # clip(v) = [0.7, 0.3]; unclipped [1, 0], clipped [1.69, 0.09] -> 0.5 * mean(1.69, 0.09)
    vf_loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    assert vf_loss.item() == pytest.approx(0.445)
    assert clipfrac.item() == pytest.approx(1.0)
    # Both tokens sit on the clipped branch, whose gradient w.r.t. vpreds is zero.
    vf_loss.backward()
    torch.testing.assert_close(vpreds.grad, torch.zeros(1, 2))


def test_value_loss_matches_loop_and_gradient_flows():
    g = torch.Generator().manual_seed(1)
    vpreds = torch.randn(5, 7, generator=g, dtype=F64, requires_grad=True)
    values = vpreds.detach() + 0.3 * torch.randn(5, 7, generator=g, dtype=F64)
    returns = torch.randn(5, 7, generator=g, dtype=F64)
    mask = ref.ragged_mask(5, 7, g, min_len=1).double()
    vf_loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, 0.1, "seq-mean-token-mean")
    per_token, flags = [], []
    for v_row, o_row, r_row in zip(vpreds.tolist(), values.tolist(), returns.tolist()):
        row, frow = [], []
        for v, o, r in zip(v_row, o_row, r_row):
            vc = min(max(v, o - 0.1), o + 0.1)
            row.append(max((v - r) ** 2, (vc - r) ** 2))
            frow.append(1.0 if (vc - r) ** 2 > (v - r) ** 2 else 0.0)
        per_token.append(row)
        flags.append(frow)
    assert vf_loss.item() == pytest.approx(
        0.5 * ref.agg(torch.tensor(per_token), mask, "seq-mean-token-mean")
    )
    assert clipfrac.item() == pytest.approx(ref.agg(torch.tensor(flags), mask, "token-mean"))
    vf_loss.backward()
    assert torch.isfinite(vpreds.grad).all() and vpreds.grad.abs().sum() > 0


def test_value_loss_shape_error_names_both():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"returns has shape \(2, 4\) but vpreds has shape \(2, 3\)"):
        compute_value_loss(x, torch.zeros(2, 4), x, torch.ones(2, 3), 0.2)


def test_entropy_hand_computed():
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]], dtype=F64)
    expected = torch.tensor([[LN2, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]], dtype=F64)
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    mask = torch.tensor([[1.0, 0.0]], dtype=F64)
    assert compute_entropy_loss(logits, mask, "token-mean").item() == pytest.approx(LN2)


def test_entropy_matches_loop_and_gradient_flows():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 4, 13, generator=g, dtype=F64) * 4).requires_grad_()
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor(ref.entropy(logits.detach()), dtype=F64)
    )
    mask = ref.ragged_mask(3, 4, g, min_len=1).double()
    loss = compute_entropy_loss(logits, mask, "token-mean")
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    with pytest.raises(
        ValueError, match=r"logits has shape \(3, 4, 13\) but response_mask has shape \(3, 5\)"
    ):
        compute_entropy_loss(logits, torch.ones(3, 5), "token-mean")
