"""Scoring in worker processes: same results as in-process, and a hanging or crashing function
cannot stall training (its worker is killed, the call returns in bounded time)."""

import os
import time

import psutil
import pytest

from rlhf_megatron.rewards import RewardFunctionError, RewardManager, load_custom_reward_fn

ROWS = [
    ("p", "8", "arith", "8"),
    ("p", "3", "arith", "2"),  # wrong: the misbehaving functions hang or die here
    ("p", "5", "arith", "5"),
]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_pool_matches_in_process(tokenizer, make_rollout, user_reward_file):
    fn = load_custom_reward_fn(user_reward_file, "length_reward")
    batch = make_rollout(ROWS)
    with RewardManager(tokenizer, compute_score=fn, num_workers=2) as pooled:
        expected = RewardManager(tokenizer, compute_score=fn)(batch)
        got = pooled(batch)
        assert pooled(batch).metrics == expected.metrics  # the pool is reused across calls
    assert torch_equal(got.token_level_scores, expected.token_level_scores)
    assert got.extra == expected.extra


def torch_equal(a, b):
    return bool((a == b).all())


def test_hanging_function_is_killed_and_scored_zero(tokenizer, make_rollout, user_reward_file, tmp_path):
    fn = load_custom_reward_fn(user_reward_file, "hang_on_wrong", reward_kwargs={"pid_dir": str(tmp_path)})
    manager = RewardManager(tokenizer, compute_score=fn, on_error="zero", timeout_s=1.0, num_workers=2)
    try:
        start = time.monotonic()
        result = manager(make_rollout(ROWS))
        elapsed = time.monotonic() - start
        assert elapsed < 30, elapsed
        assert result.token_level_scores.sum(-1).tolist() == [1.0, 0.0, 1.0]
        assert result.metrics["reward/timeouts"] == 1.0 and result.metrics["reward/errors"] == 0.0
        (pid_file,) = [f for f in os.listdir(tmp_path) if f.endswith(".pid")]
        assert gone(int(pid_file.split(".")[0]))
        # The pool recovers for the next batch.
        assert manager(make_rollout([ROWS[0]])).token_level_scores.sum().item() == 1.0
    finally:
        manager.close()


def test_hanging_function_raises_timeout(tokenizer, make_rollout, user_reward_file):
    fn = load_custom_reward_fn(user_reward_file, "hang_on_wrong")
    with RewardManager(tokenizer, compute_score=fn, timeout_s=1.0, num_workers=1) as manager:
        start = time.monotonic()
        with pytest.raises(
            TimeoutError, match=r"hang_on_wrong .* took more than 1.0 s on row 1 \(data_source='arith'\)"
        ):
            manager(make_rollout(ROWS))
        assert time.monotonic() - start < 30
        assert manager._pool.killed_pids and all(gone(pid) for pid in manager._pool.killed_pids)


def test_crashing_worker_is_an_error_not_a_hang(tokenizer, make_rollout, user_reward_file):
    fn = load_custom_reward_fn(user_reward_file, "die_on_wrong")
    with (
        RewardManager(tokenizer, compute_score=fn, num_workers=2) as manager,
        pytest.raises(RewardFunctionError, match=r"die_on_wrong .* row 1 .*worker died"),
    ):
        manager(make_rollout(ROWS))
    with RewardManager(tokenizer, compute_score=fn, num_workers=2, on_error="zero") as manager:
        result = manager(make_rollout(ROWS))
        assert result.token_level_scores.sum(-1)[[0, 2]].tolist() == [1.0, 1.0]
        assert result.token_level_scores.sum(-1)[1] == 0.0 and result.metrics["reward/errors"] == 1.0


def test_default_scorer_in_pool(tokenizer, make_rollout):
    with RewardManager(tokenizer, num_workers=1, timeout_s=30) as manager:
        assert manager(make_rollout(ROWS)).token_level_scores.sum(-1).tolist() == [1.0, 0.0, 1.0]
