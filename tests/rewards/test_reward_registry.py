"""default_compute_score dispatch, scorer registration and loading custom reward functions."""

import pickle

import pytest

from rlhf_megatron.rewards import (
    default_compute_score,
    known_data_sources,
    load_custom_reward_fn,
    register_scorer,
    registry,
    resolve_compute_score,
)


@pytest.mark.parametrize(
    "data_source, response, ground_truth",
    [
        ("openai/gsm8k", "#### 72", "72"),
        ("lighteval/MATH", "\\boxed{\\frac{1}{2}}", "0.5"),
        ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{4}", "4"),
        ("countdown", "<answer>1 + 2 + 3</answer>", {"target": 6, "numbers": [1, 2, 3]}),
        ("arith", "8", "8"),
    ],
)
def test_dispatch(data_source, response, ground_truth):
    assert default_compute_score(data_source, response, ground_truth, extra_info={"index": 0}) == 1.0


def test_kwargs_reach_the_scorer():
    assert default_compute_score("openai/gsm8k", "#### 3", "4", format_score=0.25) == 0.25


def test_unknown_data_source_lists_known_ones():
    with pytest.raises(
        ValueError,
        match=r"no rule-based scorer for data_source 'my/data'.*'arith'.*'openai/gsm8k'.*custom_reward_function",
    ):
        default_compute_score("my/data", "x", "y")


def test_register_scorer(monkeypatch):
    monkeypatch.setattr(registry, "_SCORERS", dict(registry._SCORERS))
    register_scorer("echo", lambda s, gt: float(s == gt))
    assert "echo" in known_data_sources()
    assert default_compute_score("echo", "a", "a") == 1.0
    with pytest.raises(ValueError, match="already has a scorer"):
        register_scorer("echo", lambda s, gt: 0.0)


def test_load_custom_reward_fn_and_pickle(user_reward_file):
    fn = load_custom_reward_fn(user_reward_file, "length_reward", reward_kwargs={"scale": 2.0})
    assert fn("d", "abc", None)["score"] == 6.0
    assert fn(data_source="d", solution_str="abc", ground_truth=None, scale=1.0)["score"] == 3.0
    clone = pickle.loads(pickle.dumps(fn))
    assert clone("d", "abcd", None)["score"] == 8.0 and "length_reward" in repr(clone)
    assert resolve_compute_score() is default_compute_score
    assert resolve_compute_score(user_reward_file, "boom")("d", "1", None) == 1.0


def test_custom_reward_errors(user_reward_file, tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(FileNotFoundError, match=rf"reward function file {missing} does not exist"):
        load_custom_reward_fn(missing, "compute_score")
    with pytest.raises(
        AttributeError, match=rf"{user_reward_file} has no function 'compute_score'.*'length_reward'"
    ):
        load_custom_reward_fn(user_reward_file, "compute_score")
    with pytest.raises(TypeError, match="'NOT_CALLABLE' .* is a int"):
        load_custom_reward_fn(user_reward_file, "NOT_CALLABLE")
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(ImportError, match=rf"importing {broken} failed: SyntaxError"):
        load_custom_reward_fn(str(broken), "f")
