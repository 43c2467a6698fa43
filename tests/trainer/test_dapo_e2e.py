"""DAPO end to end (``configs/quickstart_cpu_dapo.yaml``: dynamic sampling, clip-higher, token-mean,
no KL, the overlong buffer) through the real CLI, colocated in sync and on a rollout pool of its
own one step off. The policy is the session's random tiny model, so the reward is the test's own:
prompts with an even answer score 0 whatever the response (their groups have no spread and are
dropped), the others score the parity of the response's length (their groups mostly differ).

The sync run also has an LLM judge (``reward.judge``) colocated in the driver: the session's tiny
model on a vLLM engine of its own, asked about every response of every round. Its verdicts never
match the pattern, so each is an invalid verdict that adds 0 (the groups above are unchanged) and
is counted: the judge ran in the training loop, on every generated response."""

import math

import pytest
from trainer_helpers import ONE_PROCESS, run_train, train_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REWARD = """
def even_answers_score_alike(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if int(ground_truth) % 2 == 0:
        return 0.0
    return float(len(solution_str) % 2)
"""

JUDGE = {
    "reward.judge.enable": True,
    "reward.judge.placement": "colocated",
    "reward.judge.prompt_template": "'{prompt}{response} Score: '",
    "reward.judge.score_pattern": "'NEVER([0-9])'",
    "reward.judge.combine": "add",
    "reward.judge.max_new_tokens": 2,
    "reward.judge.max_model_len": 64,
    "reward.judge.dtype": "float32",
}

LAYOUTS = {
    "sync": {},
    "one_step_off": {
        "actor_rollout_ref.hybrid_engine": False,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "trainer.rollout_mode": "one_step_off",
    },
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dynamic_sampling_fills_each_step_with_groups_that_differ(tiny_run_inputs, tmp_path, layout):
    (tmp_path / "rewards.py").write_text(REWARD)
    judged = layout == "sync"
    judge = {**JUDGE, "reward.judge.model_path": tiny_run_inputs["model"]} if judged else {}
    overrides = train_overrides(
        tiny_run_inputs,
        tmp_path / "run",
        **{
            "data.gen_batch_size": 4,  # rounds of 4 prompts x n=4 for a step of 8 prompts
            "custom_reward_function.path": tmp_path / "rewards.py",
            "custom_reward_function.name": "even_answers_score_alike",
            **ONE_PROCESS,  # dynamic sampling is the driver's: one trainer process
            **LAYOUTS[layout],
            **judge,
        },
    )
    proc, records = run_train("quickstart_cpu_dapo", overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        rounds = r["train/num_gen_batches"]
        assert rounds >= 2, "4 prompts a round cannot fill a step of 8"
        assert r["dynamic_sampling/generated_samples"] == rounds * 4 * 4
        assert r["dynamic_sampling/kept_groups"] - r["dynamic_sampling/surplus_groups"] == 8
        assert r["dynamic_sampling/kept_groups"] + r["dynamic_sampling/dropped_groups"] == rounds * 4
        assert r["dynamic_sampling/dropped_groups"] >= 1, "the even answers' groups are dropped"
        assert "reward/overlong/mean" in r and r["reward/overlong_reward/mean"] <= 0.0
        assert math.isfinite(r["actor/pg_loss"]) and "actor/kl_loss" not in r  # DAPO: no KL term
        assert r["timing_s/gen_more"] > 0
        if judged:  # every round was generated with the weights the actor scores with
            assert r["training/rollout_probs_diff_max"] < 1e-4
            assert r["reward/judge_invalid"] == r["dynamic_sampling/generated_samples"]
            assert r["reward/judge_timeouts"] == 0 and r["reward/judge_too_long"] == 0
        else:
            assert r["async/staleness_max"] <= 1
