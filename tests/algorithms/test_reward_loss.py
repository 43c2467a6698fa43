"""The reward model's Bradley-Terry loss: hand-computed values, its gradient, stability, metrics."""

import math

import pytest
import torch

from rlhf_megatron.algorithms import bradley_terry_loss

F64 = torch.float64


def test_hand_computed_loss_and_metrics():
    chosen = torch.tensor([1.0, 0.0, 2.0], dtype=F64)
    rejected = torch.tensor([0.0, 0.0, 3.0], dtype=F64)
    loss, metrics = bradley_terry_loss(chosen, rejected)
    # -log sigmoid(d) = log(1 + exp(-d)) for d = 1, 0, -1
    expected = (math.log(1 + math.exp(-1)) + math.log(2) + math.log(1 + math.e)) / 3
    assert loss.item() == pytest.approx(expected)
    assert metrics["accuracy"].item() == pytest.approx(1 / 3), "a tie is not a correct preference"
    assert metrics["margin"].item() == pytest.approx(0.0)  # (1 + 0 - 1) / 3


def test_margin_shifts_the_logit_but_not_the_metrics():
    chosen = torch.tensor([2.0, 1.0], dtype=F64)
    rejected = torch.tensor([0.0, 0.0], dtype=F64)
    margin = torch.tensor([2.0, 0.5], dtype=F64)
    loss, metrics = bradley_terry_loss(chosen, rejected, margin)
    expected = (math.log(2) + math.log(1 + math.exp(-0.5))) / 2  # logits 0 and 0.5
    assert loss.item() == pytest.approx(expected)
    assert metrics["margin"].item() == pytest.approx(1.5), "the learned margin, not the target"
    assert metrics["accuracy"].item() == 1.0
    no_margin, _ = bradley_terry_loss(chosen, rejected, torch.zeros(2, dtype=F64))
    assert no_margin.item() == pytest.approx(bradley_terry_loss(chosen, rejected)[0].item())
    int_margin, _ = bradley_terry_loss(chosen, rejected, torch.tensor([2, 0]))
    assert int_margin.item() == pytest.approx((math.log(2) + math.log(1 + math.exp(-1))) / 2)


def test_gradient_is_sigmoid_of_minus_the_logit_over_b():
    chosen = torch.tensor([0.5, -1.0], dtype=F64, requires_grad=True)
    rejected = torch.tensor([0.0, 1.0], dtype=F64, requires_grad=True)
    loss, metrics = bradley_terry_loss(chosen, rejected)
    loss.backward()
    d = torch.tensor([0.5, -2.0], dtype=F64)
    # d/dc [-log sigmoid(c - r)] = -sigmoid(-(c - r)); mean over B = 2
    torch.testing.assert_close(chosen.grad, -torch.sigmoid(-d) / 2)
    torch.testing.assert_close(rejected.grad, torch.sigmoid(-d) / 2)
    assert not metrics["accuracy"].requires_grad and not metrics["margin"].requires_grad


def test_stable_for_far_apart_scores():
    chosen = torch.tensor([-200.0, 200.0])
    rejected = torch.tensor([200.0, -200.0])
    loss, _ = bradley_terry_loss(chosen, rejected)
    # a naive log(sigmoid(-400)) is -inf in float32; logsigmoid gives -400
    assert torch.isfinite(loss) and loss.item() == pytest.approx(200.0)


def test_bad_inputs_are_named():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"chosen must have shape \(B,\)"):
        bradley_terry_loss(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="rejected has shape"):
        bradley_terry_loss(x, torch.zeros(4))
    with pytest.raises(ValueError, match="margin has shape"):
        bradley_terry_loss(x, x, torch.zeros(2))
    with pytest.raises(ValueError, match="floating point"):
        bradley_terry_loss(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="no pairs"):
        bradley_terry_loss(torch.zeros(0), torch.zeros(0))
