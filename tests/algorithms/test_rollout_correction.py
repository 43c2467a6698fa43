"""Rollout correction: truncated importance weights rollout -> actor, their metrics, the batch call."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_megatron.algorithms import apply_rollout_correction, compute_rollout_is_weights
from rlhf_megatron.config.schema import RolloutCorrectionConfig
from rlhf_megatron.data.batch import Batch

F64 = torch.float64
P = "rollout_corr/"


def _log_probs(ratios, mask):
    """(old, rollout) log-probs whose ratio is ``ratios`` on valid tokens, garbage on padding."""
    ratios = torch.tensor(ratios, dtype=F64)
    mask = torch.tensor(mask)
    rollout = torch.log(torch.linspace(0.1, 0.9, ratios.numel(), dtype=F64)).view_as(ratios)
    old = rollout + torch.log(ratios)
    # Padding holds what it likes (the engine writes 0, an actor anything): it must not leak.
    old = torch.where(mask.bool(), old, torch.tensor(float("nan"), dtype=F64))
    rollout = torch.where(mask.bool(), rollout, torch.tensor(float("-inf"), dtype=F64))
    return old, rollout, mask


def test_token_weights_truncate_and_mask_hand_computed():
    old, rollout, mask = _log_probs([[0.5, 1.0, 3.0, 7.0]], [[1, 1, 1, 0]])
    weights, m = compute_rollout_is_weights(old, rollout, mask, "token", rollout_is_threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.5, 1.0, 2.0, 0.0]], dtype=F64))
    assert weights.dtype == F64 and not weights.requires_grad
    # Units are the 3 valid tokens: [0.5, 1, 2] after the cap (3 before it).
    assert m[f"{P}rollout_is_mean"] == pytest.approx(3.5 / 3)
    assert m[f"{P}rollout_is_std"] == pytest.approx(math.sqrt(5.25 / 3 - (3.5 / 3) ** 2))
    assert m[f"{P}rollout_is_min"] == pytest.approx(0.5)
    assert m[f"{P}rollout_is_max"] == pytest.approx(2.0)
    assert m[f"{P}rollout_is_max_raw"] == pytest.approx(3.0)
    assert m[f"{P}rollout_is_clipped_frac"] == pytest.approx(1 / 3)
    assert m[f"{P}rollout_is_eff_sample_size"] == pytest.approx(3.5**2 / (3 * 5.25))
    assert f"{P}rollout_is_batch_norm_factor" not in m


def test_sequence_weight_is_the_product_over_valid_tokens():
    old, rollout, mask = _log_probs(
        [[2.0, 0.75, 9.0], [4.0, 5.0, 5.0], [3.0, 3.0, 3.0]],
        [[1, 1, 0], [1, 0, 0], [0, 0, 0]],
    )
    weights, m = compute_rollout_is_weights(old, rollout, mask, "sequence", rollout_is_threshold=2.0)
    # Row 0: 2 * 0.75 = 1.5; row 1: 4, capped at 2; row 2 has no valid token (and is no unit).
    expected = torch.tensor([[1.5, 1.5, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(weights, expected)
    assert m[f"{P}rollout_is_mean"] == pytest.approx(1.75)
    assert m[f"{P}rollout_is_std"] == pytest.approx(0.25)
    assert (m[f"{P}rollout_is_min"], m[f"{P}rollout_is_max"]) == pytest.approx((1.5, 2.0))
    assert m[f"{P}rollout_is_max_raw"] == pytest.approx(4.0)
    assert m[f"{P}rollout_is_clipped_frac"] == pytest.approx(0.5)
    assert m[f"{P}rollout_is_eff_sample_size"] == pytest.approx(3.5**2 / (2 * (1.5**2 + 2.0**2)))


def test_equal_policies_give_weight_one_and_full_sample_size():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g)
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    for level in ("token", "sequence"):
        weights, m = compute_rollout_is_weights(lp, lp.clone(), mask, level)
        torch.testing.assert_close(weights, mask)
        assert m[f"{P}rollout_is_eff_sample_size"] == pytest.approx(1.0)
        assert m[f"{P}rollout_is_clipped_frac"] == 0.0
        assert m[f"{P}rollout_is_std"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize(
    "level, ratios, expected, factor",
    [
        # token: the capped weights [0.5, 1, 2] have mean 7/6
        ("token", [0.5, 1.0, 3.0], [3 / 7, 6 / 7, 12 / 7], 7 / 6),
        # sequence: 2 * 0.75 * 1 = 1.5 on each of the 3 tokens
        ("sequence", [2.0, 0.75, 1.0], [1.0, 1.0, 1.0], 1.5),
    ],
)
def test_batch_normalize_rescales_to_mean_one_over_valid_tokens(level, ratios, expected, factor):
    old, rollout, mask = _log_probs([ratios, [1.0, 1.0, 1.0]], [[1, 1, 1], [0, 0, 0]])
    weights, m = compute_rollout_is_weights(old, rollout, mask, level, 2.0, rollout_is_batch_normalize=True)
    torch.testing.assert_close(weights, torch.tensor([expected, [0.0, 0.0, 0.0]], dtype=F64))
    assert weights[mask.bool()].mean().item() == pytest.approx(1.0)
    assert m[f"{P}rollout_is_batch_norm_factor"] == pytest.approx(factor)
    # The distribution metrics describe the weights before the rescaling.
    assert m[f"{P}rollout_is_mean"] == pytest.approx(factor)


def test_sequence_normalisation_weighs_long_responses_by_their_tokens():
    old, rollout, mask = _log_probs([[1.5, 1.0, 1.0], [2.0, 1.0, 1.0]], [[1, 1, 0], [1, 0, 0]])
    weights, m = compute_rollout_is_weights(
        old, rollout, mask, "sequence", 2.0, rollout_is_batch_normalize=True
    )
    # Token mean: (1.5 + 1.5 + 2) / 3 = 5/3 (the sequence mean would be 1.75).
    assert m[f"{P}rollout_is_batch_norm_factor"] == pytest.approx(5 / 3)
    torch.testing.assert_close(weights, torch.tensor([[0.9, 0.9, 0.0], [1.2, 0.0, 0.0]], dtype=F64))


def test_log_ratios_are_clamped_before_exp():
    old = torch.tensor([[60.0, 0.0], [15.0, 15.0]])
    rollout = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    weights, m = compute_rollout_is_weights(old, rollout, mask, "token", rollout_is_threshold=1e12)
    assert torch.isfinite(weights).all()
    assert weights[0, 0].item() == pytest.approx(math.exp(20), rel=1e-6)
    assert m[f"{P}rollout_is_max_raw"] == pytest.approx(math.exp(20), rel=1e-6)
    # sequence: 15 + 15 = 30 is clamped to 20 too
    weights, _ = compute_rollout_is_weights(old, rollout, mask, "sequence", rollout_is_threshold=1e12)
    assert weights[1, 0].item() == pytest.approx(math.exp(20), rel=1e-6)


def test_no_valid_token_gives_zero_weights_and_no_metrics():
    weights, m = compute_rollout_is_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), "token")
    assert weights.abs().sum() == 0 and m == {}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rollout_is": "geometric"}, "rollout_is='geometric' is not one of: token, sequence"),
        ({"rollout_is_threshold": 0.0}, "rollout_is_threshold must be > 0"),
        ({"rollout_log_probs": torch.zeros(2, 4)}, "rollout_log_probs has shape"),
        ({"rollout_log_probs": torch.zeros(2, 3, dtype=F64)}, "must have the same dtype"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    args = {
        "old_log_probs": torch.zeros(2, 3),
        "rollout_log_probs": torch.zeros(2, 3),
        "response_mask": torch.ones(2, 3),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        compute_rollout_is_weights(**args)


# --- the driver's call -------------------------------------------------------------------


def _batch(**extra):
    old, rollout, mask = _log_probs([[0.5, 4.0, 1.0], [1.0, 1.0, 1.0]], [[1, 1, 0], [1, 1, 1]])
    tensors = {"old_log_probs": old.float(), "rollout_log_probs": rollout.float(), "response_mask": mask}
    tensors.update(extra)
    return Batch.from_dict(tensors)


def test_apply_writes_weights_and_returns_prefixed_metrics():
    batch = _batch()
    cfg = OmegaConf.structured(RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    metrics = apply_rollout_correction(batch, cfg)  # the config node the driver holds
    expected = torch.tensor([[0.5, 2.0, 0.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(batch["rollout_is_weights"], expected)
    assert batch["rollout_is_weights"].dtype == torch.float32
    assert metrics[f"{P}rollout_is_clipped_frac"] == pytest.approx(1 / 5)
    assert all(k.startswith(P) for k in metrics)


def test_apply_is_a_no_op_when_off():
    batch = _batch()
    assert apply_rollout_correction(batch, RolloutCorrectionConfig()) == {}
    assert "rollout_is_weights" not in batch


def test_apply_without_rollout_log_probs_names_the_keys():
    batch = _batch()
    batch.pop(["rollout_log_probs"])
    with pytest.raises(
        ValueError, match=r"rollout_is=sequence needs rollout_log_probs in the batch.*old_log_probs"
    ):
        apply_rollout_correction(batch, RolloutCorrectionConfig(rollout_is="sequence"))
