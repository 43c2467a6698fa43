"""Masked reductions and input checks."""

import math

import pytest
import torch

from rlhf_megatron.algorithms import masked_mean, masked_var, masked_whiten
from rlhf_megatron.algorithms.utils import check_values_and_mask, masked_sum


def test_masked_mean_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.5)  # (1+2+3+4)/4
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=0), torch.tensor([2.5, 2.0, 3.0]))


def test_masked_var_and_whiten_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    assert masked_var(x, mask).item() == pytest.approx(1.0)  # unbiased var of 1, 2, 3
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(2.0 / 3.0)
    scale = 1.0 / math.sqrt(1.0 + 1e-8)
    expected = torch.tensor([[-scale, 0.0, scale, 7.0 * scale]], dtype=torch.float64)
    torch.testing.assert_close(masked_whiten(x, mask), expected)
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), expected + 2.0)


def test_empty_selection_gives_zero_not_nan():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    none = torch.zeros(2, 2)
    assert masked_mean(x, none).item() == 0.0
    assert masked_var(x, none).item() == 0.0
    row_empty = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    torch.testing.assert_close(masked_mean(x, row_empty, dim=-1), torch.tensor([1.5, 0.0]))
    single = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    assert masked_var(x, single).item() == 0.0
    assert masked_whiten(x, single)[0, 1].item() == 0.0


def test_nan_in_padding_does_not_leak():
    x = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[True, False], [True, False]])
    mean = masked_mean(x, mask)
    assert mean.item() == pytest.approx(2.0)
    assert masked_sum(x, mask).item() == pytest.approx(4.0)
    mean.backward()
    torch.testing.assert_close(x.grad, torch.tensor([[0.5, 0.0], [0.5, 0.0]]))


def test_masked_mean_matches_loop_on_random_input():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) < 0.5).double()
    valid = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(valid) / len(valid)
    var = sum((v - mean) ** 2 for v in valid) / (len(valid) - 1)
    assert masked_mean(x, mask).item() == pytest.approx(mean)
    assert masked_var(x, mask).item() == pytest.approx(var)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\) but x has shape \(2, 3\)"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 3\)"):
        masked_whiten(torch.zeros(2, 3), torch.ones(2, 4))


def test_dtype_and_floating_checks():
    a, b = torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"float64.*float32|float32.*float64"):
        check_values_and_mask("f", {"a": a, "b": b}, "mask", torch.ones(2, 3))
    with pytest.raises(ValueError, match="must be floating point"):
        check_values_and_mask("f", {"a": torch.zeros(2, 3, dtype=torch.long)}, "mask", torch.ones(2, 3))
