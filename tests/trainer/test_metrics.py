"""Step metrics that are pure functions of a batch: the rollout/actor log-prob mismatch."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.trainer.metrics import compute_rollout_mismatch_metrics


def _batch(rollout, actor, mask):
    return Batch.from_dict(
        {
            "rollout_log_probs": torch.tensor(rollout),
            "old_log_probs": torch.tensor(actor),
            "response_mask": torch.tensor(mask),
        }
    )


def test_mismatch_is_zero_when_the_engines_agree_and_hand_computed_otherwise():
    same = compute_rollout_mismatch_metrics(_batch([[-1.0, -2.0]], [[-1.0, -2.0]], [[1, 1]]))
    assert same == {
        "training/rollout_probs_diff_mean": 0.0,
        "training/rollout_probs_diff_max": 0.0,
        "training/rollout_actor_kl": 0.0,
    }
    # second token masked out: only the first counts
    m = compute_rollout_mismatch_metrics(_batch([[-1.0, -9.0]], [[-1.5, 0.0]], [[1, 0]]))
    diff = abs(math.exp(-1.0) - math.exp(-1.5))
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(diff)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(diff)
    log_ratio = -0.5
    assert m["training/rollout_actor_kl"] == pytest.approx(math.exp(log_ratio) - 1 - log_ratio)


def test_no_metrics_without_both_log_probs():
    assert compute_rollout_mismatch_metrics(Batch.from_dict({"old_log_probs": torch.zeros(1, 2)})) == {}
