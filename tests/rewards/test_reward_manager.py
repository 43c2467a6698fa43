"""RewardManager: decoding, score placement, metrics, extras, error policy and the RewardFn interface."""

import functools
import logging
import math

import pytest
import torch

from rlhf_megatron.rewards import (
    RewardFn,
    RewardFunctionError,
    RewardManager,
    RewardResult,
    load_custom_reward_fn,
)
from rlhf_megatron.rewards.manager import response_lengths

ROWS = [
    ("<|user|>3+5=</s><|assistant|>", "8", "arith", "8"),
    ("<|user|>1+1=</s><|assistant|>", "3", "arith", "2"),
    ("<|user|>q</s><|assistant|>", "so #### 1,000", "openai/gsm8k", "1000"),
    (
        "<|user|>q</s><|assistant|>",
        "<answer>2 * 3</answer> ok",
        "countdown",
        {"target": 6, "numbers": [2, 3]},
    ),
]


def test_scores_on_last_valid_token_with_metrics(tokenizer, make_rollout):
    batch = make_rollout(ROWS, response_length=20)
    result = RewardManager(tokenizer)(batch)
    assert isinstance(result, RewardResult) and isinstance(RewardManager(tokenizer), RewardFn)
    scores = result.token_level_scores
    assert scores.shape == (4, 20) and scores.dtype == torch.float32
    lengths = batch["response_mask"].sum(-1)  # response + eos
    assert scores.sum(-1).tolist() == [1.0, 0.0, 1.0, 1.0]
    for row, n in enumerate(lengths.tolist()):
        assert torch.count_nonzero(scores[row, n:]) == 0  # nothing after the last valid token
        assert torch.count_nonzero(scores[row, : n - 1]) == 0
    assert scores[0, int(lengths[0]) - 1] == 1.0
    m = result.metrics
    assert m["reward/arith/mean"] == 0.5 and m["reward/arith/max"] == 1.0 and m["reward/arith/min"] == 0.0
    assert m["reward/openai/gsm8k/mean"] == 1.0 and m["reward/countdown/mean"] == 1.0
    assert m["reward/errors"] == 0.0 and m["reward/timeouts"] == 0.0


def test_response_truncated_without_eos_uses_attention_mask(tokenizer, make_rollout):
    batch = make_rollout(ROWS[:2], response_length=1, with_response_mask=False)  # "8" fits, eos cut off
    assert response_lengths(batch).tolist() == [1, 1]
    result = RewardManager(tokenizer)(batch)
    assert result.token_level_scores.tolist() == [[1.0], [0.0]]


def test_dict_scores_give_extras_and_return_dict(tokenizer, make_rollout, user_reward_file):
    fn = load_custom_reward_fn(user_reward_file, "length_reward")
    out = RewardManager(tokenizer, compute_score=fn)(make_rollout(ROWS[:2]), return_dict=True)
    assert set(out) == {"reward_tensor", "reward_extra_info", "metrics"}
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 1.0]
    assert out["reward_extra_info"] == {"chars": [1, 1], "tag": ["x", "x"]}
    assert out["metrics"]["reward/arith/chars/mean"] == 1.0
    assert "reward/arith/tag/mean" not in out["metrics"]


def test_examples_are_logged_per_source(tokenizer, make_rollout, caplog):
    with caplog.at_level(logging.INFO, logger="rlhf_megatron.rewards.manager"):
        RewardManager(tokenizer, num_examine=1)(make_rollout(ROWS))
    assert caplog.text.count("[arith] response") == 1
    assert "[openai/gsm8k] response: 'so #### 1,000'" in caplog.text
    assert "[arith] prompt: '3+5='" in caplog.text


def test_nan_is_rejected_with_row_and_source(tokenizer, make_rollout, user_reward_file):
    fn = load_custom_reward_fn(user_reward_file, "nan_on_wrong")
    with pytest.raises(ValueError, match=r"nan_on_wrong .* returned nan on row 1 \(data_source='arith'\)"):
        RewardManager(tokenizer, compute_score=fn)(make_rollout(ROWS[:2]))
    result = RewardManager(tokenizer, compute_score=fn, on_error="zero")(make_rollout(ROWS[:2]))
    assert result.token_level_scores.sum(-1).tolist() == [1.0, 0.0]
    assert result.metrics["reward/errors"] == 1.0


def test_inf_from_plain_function(tokenizer, make_rollout):
    def inf_score(data_source, solution_str, ground_truth, extra_info=None):
        return math.inf

    with pytest.raises(ValueError, match=r"inf_score returned inf on row 0 \(data_source='arith'\)"):
        RewardManager(tokenizer, compute_score=inf_score)(make_rollout(ROWS[:1]))


def test_scorer_exception_names_function_and_row(tokenizer, make_rollout, user_reward_file):
    rows = [ROWS[0], ("p", "2", "arith", "2")]
    fn = load_custom_reward_fn(user_reward_file, "boom")
    with pytest.raises(
        RewardFunctionError,
        match=r"boom .* raised on row 1 \(data_source='arith'\): RuntimeError: scorer exploded",
    ):
        RewardManager(tokenizer, compute_score=fn)(make_rollout(rows))
    result = RewardManager(tokenizer, compute_score=fn, on_error="zero")(make_rollout(rows))
    assert result.token_level_scores.sum(-1).tolist() == [1.0, 0.0] and result.metrics["reward/errors"] == 1.0


def test_non_numeric_score(tokenizer, make_rollout, user_reward_file):
    fn = load_custom_reward_fn(user_reward_file, "not_a_number")
    with pytest.raises(RewardFunctionError, match="returned str on row 0"):
        RewardManager(tokenizer, compute_score=fn)(make_rollout(ROWS[:1]))


def test_unknown_data_source_propagates(tokenizer, make_rollout):
    with pytest.raises(RewardFunctionError, match=r"row 0 \(data_source='mystery'\).*Known data sources"):
        RewardManager(tokenizer)(make_rollout([("p", "1", "mystery", "1")]))


def test_batch_errors(tokenizer, make_rollout):
    batch = make_rollout(ROWS[:1])
    batch.pop(non_tensor_keys=["reward_model"])
    with pytest.raises(KeyError, match="no non-tensor column 'reward_model'"):
        RewardManager(tokenizer)(batch)
    batch = make_rollout(ROWS[:1])
    with pytest.raises(KeyError, match="no non-tensor column 'source'"):
        RewardManager(tokenizer, reward_fn_key="source")(batch)


def test_constructor_errors(tokenizer):
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'zero'"):
        RewardManager(tokenizer, on_error="ignore")
    with pytest.raises(ValueError, match="timeout_s=1 needs num_workers >= 1"):
        RewardManager(tokenizer, timeout_s=1)
    with pytest.raises(TypeError, match="cannot be pickled"):
        RewardManager(tokenizer, compute_score=lambda **kw: 1.0, num_workers=1)


def test_partial_of_default_scorer_is_accepted(tokenizer, make_rollout):
    from rlhf_megatron.rewards import default_compute_score

    fn = functools.partial(default_compute_score, format_score=0.5)
    result = RewardManager(tokenizer, compute_score=fn)(make_rollout(ROWS[:2]))
    assert result.token_level_scores.sum(-1).tolist() == [1.0, 0.5]
