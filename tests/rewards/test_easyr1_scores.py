"""EasyR1's math and r1v scores on hand-written responses, reward.score_fn resolution, and the
reward/overall, reward/format, reward/accuracy metrics of the reward manager."""

import pickle

import pytest

from rlhf_megatron.rewards import (
    NamedScoreFn,
    RewardFunctionError,
    RewardManager,
    default_compute_score,
    resolve_compute_score,
    scorer_names,
)
from rlhf_megatron.rewards.easyr1 import extract_boxed_content, math_compute_score, r1v_compute_score


def parts(score):
    return score["overall"], score["format"], score["accuracy"]


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        # (overall, format, accuracy); overall = 0.9 * accuracy + 0.1 * format
        ("<think>x + 1 = 4</think> So x is \\boxed{3}.", "3", (1.0, 1.0, 1.0)),
        ("<think>guess</think>\\boxed{5}", "3", (0.1, 1.0, 0.0)),  # right format, wrong answer
        ("The answer is \\boxed{3}.", "3", (0.9, 0.0, 1.0)),  # no <think>: malformed, still accurate
        ("<think>x</think> the answer is 3", "3", (0.0, 0.0, 0.0)),  # no \boxed at all
        ("<think>a</think>\\boxed{\\frac{1}{2}}", "0.5", (1.0, 1.0, 1.0)),  # math-verify: 1/2 == 0.5
        (
            "<think>a</think>\\boxed{1} then \\boxed{\\dfrac{2}{4}}",
            "\\frac12",
            (1.0, 1.0, 1.0),
        ),  # the last box
        ("< think >a</ think >\\boxed{2}", "2", (1.0, 1.0, 1.0)),  # EasyR1 removes spaces around tags
        ("<think>a</think>\\boxed{2", "2", (0.0, 0.0, 0.0)),  # unclosed box: no answer, no format
        ("\\boxed{2}<think>late</think>", "2", (0.9, 0.0, 1.0)),  # think must come first
    ],
)
def test_math_score(response, ground_truth, expected):
    assert parts(math_compute_score(response, ground_truth)) == pytest.approx(expected)


def test_math_format_weight_and_boxed_extraction():
    assert math_compute_score("\\boxed{7}", "7", format_weight=0.5)["overall"] == 0.5
    assert extract_boxed_content("a \\boxed{ \\frac{1}{2} } b") == "\\frac{1}{2}"
    assert extract_boxed_content("\\boxed{1} and \\boxed{2}") == "2"
    assert extract_boxed_content("no box") is None and extract_boxed_content("\\boxed{x") is None


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        # overall = 0.5 * accuracy + 0.5 * format
        ("<think>count</think> <answer>4</answer>", "4", (1.0, 1.0, 1.0)),
        ("<think>count</think><answer>5</answer>", " 4 ", (0.5, 1.0, 0.0)),
        ("4", "4", (0.5, 0.0, 1.0)),  # no tags: the whole response is the answer
        ("<answer>4</answer>", "4", (0.5, 0.0, 1.0)),  # no <think>
        ("<think>a</think><answer>4</answer> trailing", "4", (0.5, 0.0, 1.0)),  # fullmatch fails
        ("<think>a</think><answer>\n4</answer>", "4", (0.5, 1.0, 0.0)),  # the answer tag does not span lines
    ],
)
def test_r1v_score(response, ground_truth, expected):
    assert parts(r1v_compute_score(response, ground_truth)) == pytest.approx(expected)


def test_score_fn_resolution(user_reward_file):
    math = resolve_compute_score(score_fn="math")
    assert isinstance(math, NamedScoreFn) and "math" in scorer_names() and "r1v" in scorer_names()
    # Applied whatever the data source, with reward_kwargs reaching the scorer.
    assert math("geometry3k", "<think>a</think>\\boxed{3}", "3")["overall"] == 1.0
    weighted = resolve_compute_score(reward_kwargs={"format_weight": 0.5}, score_fn="math")
    assert weighted("any", "\\boxed{3}", "3")["overall"] == 0.5
    clone = pickle.loads(pickle.dumps(weighted))  # what the scoring pool does
    assert clone("any", "\\boxed{3}", "3")["overall"] == 0.5 and repr(clone) == "math (reward.score_fn)"
    # A data-source scorer by name, for every row.
    gsm8k = resolve_compute_score(score_fn="openai/gsm8k")
    assert (
        gsm8k("not/gsm8k", "#### 72", "72") == default_compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    )
    # A file and a function in it (without ':name' the function is compute_score, see the errors test).
    assert resolve_compute_score(score_fn=f"{user_reward_file}:length_reward")("d", "abc", None)["score"] == 3
    assert resolve_compute_score(score_fn=f"{user_reward_file}:boom")("d", "1", None) == 1.0
    assert resolve_compute_score() is default_compute_score


def test_score_fn_errors(user_reward_file, tmp_path):
    with pytest.raises(
        ValueError, match=r"reward.score_fn: unknown scorer 'maths'.*'math'.*'r1v'.*path/to/reward.py"
    ):
        resolve_compute_score(score_fn="maths")
    with pytest.raises(
        ValueError, match="reward.score_fn='math' and custom_reward_function.path=.* are both set"
    ):
        resolve_compute_score(user_reward_file, "boom", score_fn="math")
    missing = tmp_path / "nope.py"
    with pytest.raises(
        FileNotFoundError, match=rf"reward.score_fn.path: reward function file {missing} does not exist"
    ):
        resolve_compute_score(score_fn=f"{missing}:f")
    with pytest.raises(AttributeError, match=r"reward.score_fn.name: .* has no function 'compute_score'"):
        resolve_compute_score(score_fn=user_reward_file)


ROWS = [
    ("<|user|>q</s><|assistant|>", "<think>a</think>\\boxed{3}", "geometry3k", "3"),  # 1.0
    ("<|user|>q</s><|assistant|>", "\\boxed{3}", "geometry3k", "3"),  # 0.9: no think
    ("<|user|>q</s><|assistant|>", "<think>a</think>\\boxed{4}", "geometry3k", "3"),  # 0.1: wrong
    ("<|user|>q</s><|assistant|>", "3", "geometry3k", "3"),  # 0.0: neither
]


def test_manager_logs_easyr1_metrics_and_scores_overall(tokenizer, make_rollout):
    batch = make_rollout(ROWS, response_length=40)
    result = RewardManager(tokenizer, compute_score=resolve_compute_score(score_fn="math"))(batch)
    assert result.token_level_scores.sum(-1).tolist() == pytest.approx([1.0, 0.9, 0.1, 0.0])
    m = result.metrics
    assert m["reward/overall"] == pytest.approx(0.5)
    assert m["reward/format"] == pytest.approx(0.5) and m["reward/accuracy"] == pytest.approx(0.5)
    assert m["reward/geometry3k/mean"] == pytest.approx(0.5)
    assert result.extra["accuracy"] == [1.0, 1.0, 0.0, 0.0]
    # A scorer returning neither 'score' nor 'overall' is still refused.
    with pytest.raises(RewardFunctionError, match=r"without 'score' \(or EasyR1's 'overall'\)"):
        RewardManager(tokenizer, compute_score=lambda **kw: {"format": 1.0})(batch)


def test_manager_without_easyr1_parts_logs_no_easyr1_metrics(tokenizer, make_rollout):
    batch = make_rollout([("<|user|>3+5=</s><|assistant|>", "8", "arith", "8")])
    assert not {"reward/overall", "reward/format", "reward/accuracy"} & set(
        RewardManager(tokenizer)(batch).metrics
    )


def test_pooled_scoring_with_a_named_scorer(tokenizer, make_rollout):
    batch = make_rollout(ROWS, response_length=40)
    score = resolve_compute_score(score_fn="math")
    with RewardManager(tokenizer, compute_score=score, num_workers=1, timeout_s=60) as pooled:
        result = pooled(batch)
    assert result.token_level_scores.sum(-1).tolist() == pytest.approx([1.0, 0.9, 0.1, 0.0])
