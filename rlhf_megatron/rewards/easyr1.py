"""EasyR1's ``math`` and ``r1v`` scores: a format score, an accuracy score and their weighted sum.

Both return ``{"overall", "format", "accuracy"}``; the reward manager takes ``overall`` as the
score and logs the batch means as ``reward/overall``, ``reward/format``, ``reward/accuracy``.

* ``math`` (EasyR1's ``examples/reward_function/math.py``): whitespace around ``<``, ``>``
  and ``/`` is removed first (EasyR1's fix for Qwen2.5-VL-32B writing ``< think >``). Format
  is 1 when the whole response matches ``<think>...</think>...\\boxed{...}...``. Accuracy is
  1 when the content of the last ``\\boxed{...}`` equals the ground truth. ``overall =
  (1 - format_weight) * accuracy + format_weight * format``, ``format_weight`` 0.1.
* ``r1v`` (EasyR1's ``r1v.py``): format is 1 when the whole response is
  ``<think>...</think>`` then (after optional whitespace) ``<answer>...</answer>``. Accuracy
  compares the first ``<answer>...</answer>`` on one line (or, without one, the whole
  response), stripped, with the stripped ground truth. ``format_weight`` 0.5.

One deliberate difference: EasyR1 decides "equal" with mathruler's ``grade_answer``; here it
is `boxed_math.is_equivalent` (math-verify's symbolic check, then normalised strings), the
checker this project's other math scores use, so a geometry3k run and a MATH run grade alike.
It runs in ``strict`` mode: the candidate is parsed as LaTeX only, so (like ``grade_answer``)
a whole untagged r1v response is not searched for a number that happens to match.

Boundaries: pure functions of strings; no torch.
"""

from __future__ import annotations

import re

from rlhf_megatron.rewards.boxed_math import is_equivalent

__all__ = ["extract_boxed_content", "math_compute_score", "r1v_compute_score"]

_MATH_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_R1V_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_R1V_ANSWER = re.compile(r"<answer>(.*?)</answer>")  # no DOTALL, as in EasyR1: one line
_TAG_SPACING = re.compile(r"\s*(<|>|/)\s*")


def extract_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, stripped; None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip()
            depth -= 1
    return None


def _weighted(accuracy: float, format_score: float, format_weight: float) -> dict[str, float]:
    return {
        "overall": (1 - format_weight) * accuracy + format_weight * format_score,
        "format": format_score,
        "accuracy": accuracy,
    }


def math_compute_score(solution_str: str, ground_truth: str, format_weight: float = 0.1) -> dict[str, float]:
    """EasyR1's ``math`` score of one response (see the module docstring)."""
    response = _TAG_SPACING.sub(r"\1", solution_str)
    format_score = 1.0 if _MATH_FORMAT.fullmatch(response) else 0.0
    answer = extract_boxed_content(response)
    accuracy = 1.0 if answer and is_equivalent(answer, str(ground_truth), strict=True) else 0.0
    return _weighted(accuracy, format_score, format_weight)


def r1v_compute_score(solution_str: str, ground_truth: str, format_weight: float = 0.5) -> dict[str, float]:
    """EasyR1's ``r1v`` score of one response (see the module docstring)."""
    format_score = 1.0 if _R1V_FORMAT.fullmatch(solution_str) else 0.0
    match = _R1V_ANSWER.search(solution_str)
    answer = match.group(1).strip() if match else solution_str.strip()
    accuracy = 1.0 if answer and is_equivalent(answer, str(ground_truth).strip(), strict=True) else 0.0
    return _weighted(accuracy, format_score, format_weight)
