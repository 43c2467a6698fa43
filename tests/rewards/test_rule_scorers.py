"""Rule-based scorers against hand-written cases, adversarial ones included."""

import sys

import numpy as np
import pytest

from rlhf_megatron.rewards import arith, boxed_math, countdown, gsm8k


# ---------------------------------------------------------------- gsm8k
@pytest.mark.parametrize(
    "response, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", 1.0),
        ("#### 5 is a guess, let me redo it... #### 7", 1.0),  # the last marker wins
        ("#### 7 first, but after checking: #### 8", 0.0),
        ("#### 7\n#### is my answer", 1.0),  # a trailing marker without a number is ignored
        ("The total is #### 1,234.", 1.0),  # commas and the sentence period are dropped
        ("#### 1234.00", 1.0),
        ("the answer is 7", 0.0),  # no marker
        ("####7", 0.0),  # strict: "#### " with a space
        ("#### seven", 0.0),
    ],
)
def test_gsm8k(response, expected):
    gt = "7" if "1234" not in response and "1,234" not in response else "1234"
    assert gsm8k.compute_score(response, gt) == expected


def test_gsm8k_scores_configurable_and_negative():
    assert gsm8k.compute_score("#### 3", "7", format_score=0.1, score=2.0) == 0.1
    assert gsm8k.compute_score("#### 7", "7", format_score=0.1, score=2.0) == 2.0
    assert gsm8k.compute_score("no answer", "7", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### -3", "-3") == 1.0
    assert gsm8k.extract_solution("#### 1,000,000 dollars") == "1000000"


# ---------------------------------------------------------------- MATH
@pytest.mark.parametrize(
    "response, ground_truth",
    [
        ("so the answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
        ("$\\boxed{\\frac{1}{2}}$", "0.5"),
        ("first \\boxed{3}, no wait: \\boxed{\\dfrac{1}{2}}.", "\\frac12"),
        ("\\boxed 5$", "5"),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),
        ("\\boxed{10\\text{ cm}}", "10"),
        ("\\boxed{x = 3}", "3"),
        ("\\fbox{42}", "42"),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}"),
    ],
)
def test_math_equivalent(response, ground_truth):
    assert boxed_math.compute_score(response, ground_truth) == 1.0


@pytest.mark.parametrize(
    "response, ground_truth",
    [
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}"),
        ("\\boxed{2} then \\boxed{3}", "2"),  # the last box counts
        ("the answer is 5", "5"),  # no box
        ("\\boxed{5", "5"),  # unbalanced
        ("\\boxed{}", ""),
    ],
)
def test_math_not_equivalent(response, ground_truth):
    assert boxed_math.compute_score(response, ground_truth) == 0.0


def test_last_boxed_nested_braces():
    assert boxed_math.last_boxed_answer("x \\boxed{\\frac{1}{\\sqrt{2}}} y") == "\\frac{1}{\\sqrt{2}}"
    assert boxed_math.last_boxed_answer("\\boxed{a} and \\boxed{b}") == "b"
    assert boxed_math.last_boxed_answer("\\boxed 12 is it") == "12"


@pytest.mark.parametrize(
    "a, b",
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\frac12", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("\\left(1, 2\\right)", "(1,2)"),
        ("10\\text{ cm}", "10"),
        ("90^\\circ", "90"),
        ("5.", "5"),
        ("5.0", "5"),
        (".5", "0.5"),
        ("1,000", "1000"),
        ("\\$20", "20"),
        ("\\text{(C)}", "(C)"),
        ("x=3", "3"),
        ("3\\!\\,x", "3x"),
    ],
)
def test_string_normaliser(a, b):
    assert boxed_math.normalize_answer(a) == boxed_math.normalize_answer(b)
    assert boxed_math.is_equivalent(a, b, use_math_verify=False)


def test_math_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # "import math_verify" now raises ImportError
    assert boxed_math.compute_score("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}") == 1.0
    assert boxed_math.compute_score("\\boxed{3}", "\\frac{1}{2}") == 0.0


def test_math_scores_configurable():
    assert boxed_math.compute_score("\\boxed{3}", "4", format_score=0.1) == 0.1
    assert boxed_math.compute_score("\\boxed{4}", "4", score=2.0) == 2.0


# ---------------------------------------------------------------- countdown
GT = {"target": 24, "numbers": [2, 3, 4, 1]}


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>...</think><answer> (2 + 4) * (3 + 1) </answer>", 1.0),
        ("<answer>(1 + 2) / 3</answer> then <answer>2 * 3 * 4 * 1</answer>", 1.0),  # last answer counts
        ("<answer>2 * 3 * 4</answer>", 0.1),  # 1 unused
        ("<answer>2 * 3 * 4 * 1 * 1</answer>", 0.1),  # 1 reused
        ("<answer>4 * 3 * 2 + 1</answer>", 0.1),  # wrong value
        ("<answer>24</answer>", 0.1),  # numbers not used
        ("<answer>(4 - 4) / (2 - 3 + 1) * 24</answer>", 0.1),
        ("<answer></answer>", 0.0),  # tags without an equation
        ("<answer>I think it is 24</answer>", 0.0),
        ("<answer>2 * 3 * 4 *</answer>", 0.0),  # does not parse
        ("<answer>2 ** 3 * 4 * 1</answer>", 0.0),  # power is not allowed
        ("<answer>__import__('os').system('true')</answer>", 0.0),
        ("(2 + 4) * (3 + 1)", 0.0),  # no tags
    ],
)
def test_countdown(response, expected):
    assert countdown.compute_score(response, GT) == expected


def test_countdown_division_by_zero_and_numpy_ground_truth():
    gt = {"target": np.int64(2), "numbers": np.array([4, 2, 1, 1])}
    assert countdown.compute_score("<answer>4 / 2 * (1 * 1)</answer>", gt) == 1.0
    assert countdown.compute_score("<answer>4 / (1 - 1) + 2</answer>", gt) == 0.1
    assert countdown.compute_score("<answer>(4 / 2) * 1 / 1</answer>", gt, format_score=0.0, score=5.0) == 5.0
    assert countdown.compute_score("<answer>" + "1+" * 5000 + "1</answer>", gt) in (0.0, 0.1)  # no crash


def test_countdown_fraction_tolerance():
    gt = {"target": 1, "numbers": [3, 6, 2]}
    assert countdown.compute_score("<answer>3 / 6 * 2</answer>", gt) == 1.0
    assert countdown.evaluate_equation("1 / 3 * 3") == pytest.approx(1.0)


# ---------------------------------------------------------------- arith
@pytest.mark.parametrize(
    "response, expected",
    [("8", 1.0), (" 8\n", 1.0), ("9", 0.0), ("8 8", 0.0), ("", 0.0), ("eight", 0.0), ("08", 1.0)],
)
def test_arith(response, expected):
    assert arith.compute_score(response, "8") == expected


def test_arith_format_score():
    assert arith.compute_score("9", "8", format_score=0.1) == 0.1
    assert arith.compute_score("x", "8", format_score=0.1) == 0.0


def test_math_verify_used_outside_the_main_thread():
    # Only math-verify (not the string normaliser) equates these; its signal-based timeout must
    # be switched off in worker threads rather than failing there.
    from concurrent.futures import ThreadPoolExecutor

    assert not boxed_math.is_equivalent("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", use_math_verify=False)
    with ThreadPoolExecutor(1) as pool:
        score = pool.submit(boxed_math.compute_score, "\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}").result()
    assert score == 1.0
