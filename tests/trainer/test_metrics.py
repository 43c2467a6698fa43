"""Step metrics that are pure functions of a batch (the rollout/actor log-prob mismatch), and the
step's one timing channel."""

from __future__ import annotations

import math
import time

import pytest
import torch

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.trainer.metrics import StepTimer, compute_rollout_mismatch_metrics


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


def test_step_timer_times_phases_sums_repeats_and_records_outside_spans():
    timer = StepTimer()
    t0 = time.time()
    with timer("reward"):
        time.sleep(0.02)
    with timer("reward"):  # a phase that runs twice in a step: its time is summed, its span is the last
        time.sleep(0.02)
    timer.record("gen", t0 - 1.0, t0 - 0.5, role="rollout")
    with pytest.raises(RuntimeError), timer("update_actor"):
        raise RuntimeError("a failed phase is still timed")
    out = timer.metrics(t0)
    assert 0.04 <= out["timing_s/reward"] < 1.0 and out["timing_s/gen"] == pytest.approx(0.5)
    assert "timing_s/update_actor" in out
    assert out["timeline/rollout/gen/start_s"] == pytest.approx(-1.0)
    assert out["timeline/rollout/gen/end_s"] == pytest.approx(-0.5)
    start, end = out["timeline/trainer/reward/start_s"], out["timeline/trainer/reward/end_s"]
    assert 0.02 <= start < end and end - start >= 0.02
    spans = ("trainer/reward", "rollout/gen", "trainer/update_actor")
    timeline = {f"timeline/{span}/{edge}_s" for span in spans for edge in ("start", "end")}
    assert set(out) == {"timing_s/reward", "timing_s/gen", "timing_s/update_actor", *timeline}
