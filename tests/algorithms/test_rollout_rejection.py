"""Rollout rejection sampling (``rollout_rs``), IcePop thresholds, the off-policy diagnostics and
the threshold grammar's refusals; masks checked entry by entry against hand-written rules."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_megatron.algorithms import apply_rollout_correction, compute_rollout_is_weights
from rlhf_megatron.algorithms.rollout_rejection import (
    compute_offpolicy_metrics,
    compute_rollout_rejection_mask,
    parse_rollout_rs,
)
from rlhf_megatron.config import RolloutCorrectionConfig
from rlhf_megatron.data.batch import Batch

F64 = torch.float64
# log(pi_old / pi_rollout) per token; row 2 has a padded tail holding garbage.
LOG_RATIO = [[0.0, 0.9, -0.9, 0.1], [0.2, 0.2, 0.3, -0.1], [-2.0, 0.05, 99.0, 99.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]


def _tensors():
    rollout = torch.full((3, 4), -1.0, dtype=F64)
    return rollout + torch.tensor(LOG_RATIO, dtype=F64), rollout, torch.tensor(MASK, dtype=F64)


def _stat(kind, d):
    return {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1 - d}[kind]


def _expected_keep(option, lower, upper):
    """Which valid tokens ``option`` keeps, from the definitions, in Python floats."""
    level, kind = option.rsplit("_", 1)
    keep = []
    for row, mrow in zip(LOG_RATIO, MASK):
        vals = [_stat(kind, d) for d, m in zip(row, mrow) if m]
        if level == "token":
            units = [_stat(kind, d) if m else None for d, m in zip(row, mrow)]
        else:
            agg = {"seq_sum": sum(vals), "seq_mean": sum(vals) / len(vals), "seq_max": max(vals)}[level]
            units = [agg if m else None for m in mrow]
        lo = math.log(lower) if lower is not None else None
        hi = math.log(upper) if kind == "k1" else upper
        keep.append([u is not None and u <= hi and (lo is None or u >= lo) for u in units])
    return keep


@pytest.mark.parametrize(
    "option, spec, lower, upper",
    [
        ("token_k1", "0.5_2.0", 0.5, 2.0),
        ("token_k1", 1.5, 1 / 1.5, 1.5),  # a single k1 value means 1/u .. u
        ("token_k2", 0.3, None, 0.3),
        ("token_k3", "0.2", None, 0.2),
        ("seq_sum_k1", "0.4_1.5", 0.4, 1.5),
        ("seq_sum_k2", 0.5, None, 0.5),
        ("seq_mean_k1", "0.9_1.1", 0.9, 1.1),
        ("seq_mean_k3", 0.05, None, 0.05),
        ("seq_max_k2", 0.3, None, 0.3),
        ("seq_max_k3", 0.5, None, 0.5),
    ],
)
def test_each_option_masks_exactly_its_definition(option, spec, lower, upper):
    old, rollout, mask = _tensors()
    new_mask, metrics = compute_rollout_rejection_mask(old, rollout, mask, option, spec)
    keep = _expected_keep(option, lower, upper)
    assert new_mask.tolist() == [[float(k) for k in row] for row in keep]
    n_valid = sum(map(sum, MASK))
    rejected = sum(m and not k for krow, mrow in zip(keep, MASK) for k, m in zip(krow, mrow))
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(rejected / n_valid)
    assert metrics[f"rollout_rs_{option}_masked_fraction"] == pytest.approx(rejected / n_valid)
    assert 0 < rejected < n_valid  # each case rejects some tokens and keeps others


def test_k1_bounds_bind_on_both_sides():
    old, rollout, mask = _tensors()
    _, metrics = compute_rollout_rejection_mask(old, rollout, mask, "token_k1", "0.5_2.0")
    # token k1 = -log_ratio: 0.9 -> -0.9 < log 0.5 (low); -0.9 -> 0.9 > log 2 (high); -2 -> 2 (high)
    assert metrics["rollout_rs_token_k1_fraction_low"] == pytest.approx(1 / 10)
    assert metrics["rollout_rs_token_k1_fraction_high"] == pytest.approx(2 / 10)
    k1 = (rollout - old)[mask != 0].double()  # the statistic over valid tokens
    assert metrics["rollout_rs_token_k1_mean"] == pytest.approx(float(k1.mean()))
    assert metrics["rollout_rs_token_k1_std"] == pytest.approx(float(k1.std()))
    assert metrics["rollout_rs_token_k1_max"] == pytest.approx(float(k1.max()))


def test_options_combine_with_one_threshold_each():
    old, rollout, mask = _tensors()
    new_mask, metrics = compute_rollout_rejection_mask(
        old, rollout, mask, "token_k1, seq_max_k2", "0.5_2.0,0.3"
    )
    a, b = _expected_keep("token_k1", 0.5, 2.0), _expected_keep("seq_max_k2", None, 0.3)
    assert new_mask.tolist() == [[float(x and y) for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
    assert "rollout_rs_token_k1_mean" in metrics and "rollout_rs_seq_max_k2_mean" in metrics
    # rows 0 and 2 lose a token, row 1 none
    assert metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "rs, spec, match",
    [
        ("token_k4", 2.0, "unknown option.*token_k4.*token_k1, token_k2"),
        ("seq_max_k1", 2.0, "unknown option.*seq_max_k1"),
        ("token_k1", None, "rollout_rs_threshold is required"),
        ("token_k1,token_k2", "1_2,3,4", "gives 3 thresholds for 2 options"),
        ("token_k2", "0.5_2.0", "token_k2 takes one upper bound"),
        ("token_k1", "2.0_0.5", "k1 bounds are ratios, positive with lower <= upper"),
        ("seq_mean_k3", "-1", "must be > 0"),
        ("token_k3", "abc", "'abc' is not a number"),
    ],
)
def test_bad_options_and_thresholds_are_refused(rs, spec, match):
    with pytest.raises(ValueError, match=match):
        parse_rollout_rs(rs, spec)


def test_icepop_zeroes_weights_outside_the_band_and_keeps_the_rest():
    old, rollout, mask = _tensors()
    weights, metrics = compute_rollout_is_weights(old, rollout, mask, "token", rollout_is_threshold="0.5_2.0")
    expected = [
        [math.exp(d) if m and 0.5 <= math.exp(d) <= 2.0 else 0.0 for d, m in zip(row, mrow)]
        for row, mrow in zip(LOG_RATIO, MASK)
    ]
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=F64))
    # out of band: exp(0.9) > 2, exp(-0.9) < 0.5? no (0.41 < 0.5: yes), exp(-2) < 0.5
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(3 / 10)


def test_offpolicy_metrics_match_their_definitions():
    old, rollout, mask = _tensors()
    m = compute_offpolicy_metrics(old, rollout, mask)
    rows = [
        [(o, r) for o, r, k in zip(orow, rrow, mrow) if k]
        for orow, rrow, mrow in zip(old.tolist(), rollout.tolist(), MASK)
    ]
    mean_old = [sum(o for o, _ in row) / len(row) for row in rows]
    mean_roll = [sum(r for _, r in row) / len(row) for row in rows]
    tokens = [o - r for row in rows for o, r in row]
    assert m["training_ppl"] == pytest.approx(sum(math.exp(-x) for x in mean_old) / 3)
    assert m["rollout_ppl"] == pytest.approx(sum(math.exp(-x) for x in mean_roll) / 3)
    assert m["log_ppl_diff"] == pytest.approx(sum(r - o for r, o in zip(mean_roll, mean_old)) / 3)
    assert m["chi2_token"] == pytest.approx(sum(math.exp(2 * d) for d in tokens) / len(tokens) - 1)
    seq = [sum(o - r for o, r in row) for row in rows]
    assert m["chi2_seq"] == pytest.approx(sum(math.exp(2 * s) for s in seq) / 3 - 1)
    assert m["kl"] == pytest.approx(-sum(tokens) / len(tokens))


def test_apply_narrows_the_mask_and_reports_verls_metric_names():
    old, rollout, mask = _tensors()
    batch = Batch.from_dict({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    cfg = OmegaConf.structured(RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"))
    metrics = apply_rollout_correction(batch, cfg)
    keep = _expected_keep("token_k1", 0.5, 2.0)
    assert batch["response_mask"].tolist() == [[float(k) for k in row] for row in keep]
    assert "rollout_is_weights" not in batch  # rejection alone writes no weights
    for name in (
        "rollout_rs_masked_fraction",
        "training_ppl",
        "rollout_ppl",
        "log_ppl_diff",
        "chi2_token",
        "chi2_seq",
    ):
        assert f"rollout_corr/{name}" in metrics
