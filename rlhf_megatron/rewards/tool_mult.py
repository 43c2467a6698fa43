"""Scorer for the ``tool_mult`` task (``tools/data/tool_mult.py``, the tool-use CPU quickstart).

The prompt asks for a product of two 2-digit numbers (``"What is 37*48?"``), and the policy may
call the calculator first. A multi-turn response is decoded whole with special tokens skipped,
so a trajectory that used the tool reads::

    <tool_call>{"name": "calculator", ...}</tool_call><tool_response>1776</tool_response>1776

The final answer is the text after the last ``</tool_response>`` (the whole response when the
tool was never answered), with any unanswered ``<tool_call>`` block removed so that the
operands written into a call never count as an answer; its first integer must equal the ground
truth. Only the final answer is scored: reading the tool response is the skill being learned,
and a trajectory that calls the tool but never answers gets nothing.

Boundaries: a pure function of strings.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "final_answer"]

_INTEGER = re.compile(r"-?\d+")
_RESPONSE_END = "</tool_response>"
# A call block, closed or cut off (the response ran out of tokens inside it).
_CALL = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.DOTALL)


def final_answer(solution_str: str) -> str:
    """The text the answer is read from: after the last tool response, tool calls removed."""
    _, _, tail = solution_str.rpartition(_RESPONSE_END)
    return _CALL.sub(" ", tail).strip()


def compute_score(
    solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` if the final answer's first integer is the ground truth, ``format_score`` if it is
    another integer, 0.0 if there is none."""
    match = _INTEGER.search(final_answer(solution_str))
    if match is None:
        return 0.0
    return score if int(match.group()) == int(str(ground_truth).strip()) else format_score
