"""On-policy distillation (``distillation.*``) through the real CLI: the CPU quickstart's GRPO run
(actor TP=2, vLLM TP=2 in the same two processes) with a teacher's vLLM engine, beside the rollout's
or on its own pool, scoring every sampled token before the actor's update.

- A teacher that differs from the student (the same tiny architecture, other random weights) on a
  Ray resource pool of its own (one process, vLLM TP=1 while the rollout's is 2: a placement the
  actor's processes could not host), the top-k forward KL backpropagated: the
  ``actor/distillation/*`` metrics appear, the teacher and student disagree, and the student's
  log-probs at the teacher's top-k ids come from the vocabulary-parallel logits (TP=2).
- The student as its own teacher, k1 as a per-token reward (``configs/quickstart_opd_cpu.yaml``,
  the distillation quickstart): the reverse KL of the first update
  (one mini-batch, so the student there is the one that sampled) is zero up to vLLM-vs-Megatron
  rounding, and the two log-prob means agree.
"""

import math

import pytest
from trainer_helpers import TINY_POLICY_SHAPE, run_train, train_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

METRICS = ("loss", "reverse_kl", "student_log_prob_mean", "teacher_log_prob_mean", "clamped_frac")


def _teacher(tmp_path):
    from rlhf_megatron.models.tiny import make_tiny_hf_model

    # The session's student architecture (trainer_helpers.tiny_run_inputs), other weights.
    return make_tiny_hf_model(tmp_path / "teacher", "llama", **TINY_POLICY_SHAPE, seed=7)


def test_the_student_as_its_own_teacher_has_zero_reverse_kl(tiny_run_inputs, tmp_path):
    """The distillation quickstart's preset (k1 as a reward, no task reward in the loss), its
    teacher replaced by the student itself."""
    overrides = train_overrides(
        tiny_run_inputs,
        tmp_path / "run",
        **{
            "actor_rollout_ref.actor.ppo_mini_batch_size": 8,  # one update per step: on-policy
            "trainer.total_training_steps": 1,
            "distillation.teacher_model.model_path": tiny_run_inputs["model"],
        },
    )
    proc, records = run_train("quickstart_opd_cpu", overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (r,) = records
    assert abs(r["actor/distillation/reverse_kl"]) < 1e-4
    assert r["actor/distillation/student_log_prob_mean"] < -0.5  # a random policy: real log-probs
    assert r["actor/distillation/teacher_log_prob_mean"] == pytest.approx(
        r["actor/distillation/student_log_prob_mean"], abs=1e-4
    )
    assert abs(r["actor/distillation/loss"]) < 1e-4 and r["actor/distillation/clamped_frac"] == 0
    assert r["actor/distillation/pg_clipfrac"] == 0


def test_a_different_teacher_on_its_own_pool_scores_every_step_with_the_topk_forward_kl(
    tiny_run_inputs, tmp_path
):
    """A teacher that differs from the student, on a Ray pool of its own (one process, vLLM TP=1
    while the rollout's is 2: a colocated teacher must match the rollout's TP, so this runs only
    through the pool), the top-k forward KL backpropagated."""
    overrides = train_overrides(
        tiny_run_inputs,
        tmp_path / "run",
        **{
            "distillation.enabled": True,
            "distillation.teacher_model.model_path": _teacher(tmp_path),
            "distillation.teacher_model.enable_resource_pool": True,
            "distillation.teacher_model.nnodes": 1,
            "distillation.teacher_model.n_gpus_per_node": 1,
            "distillation.teacher_model.inference.tensor_model_parallel_size": 1,
            "distillation.teacher_model.inference.dtype": "float32",
            "distillation.distillation_loss.loss_mode": "forward_kl_topk",
            "distillation.distillation_loss.topk": 8,
            "distillation.distillation_loss.use_policy_gradient": False,
        },
    )
    proc, records = run_train("quickstart_cpu", overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for name in METRICS:
            assert math.isfinite(r[f"actor/distillation/{name}"]), name
        assert r["actor/distillation/loss"] > 0.01  # two random models disagree on their top tokens
        assert abs(r["actor/distillation/reverse_kl"]) > 0.05
        assert r["timing_s/teacher"] > 0
        assert "actor/distillation/pg_clipfrac" not in r  # backpropagated, not a reward
