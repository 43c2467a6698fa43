"""Scorer for the synthetic ``arith`` task (`rlhf_megatron.data.synthetic`, CPU quickstart).

The prompt is ``"a+b="`` and the expected response is just the sum followed by eos (the eos is
removed when responses are decoded with ``skip_special_tokens``). The whole stripped response
must be an integer: a tiny model that keeps emitting digits after the answer gets nothing,
which teaches it to stop.

Boundaries: a pure function of strings.
"""

from __future__ import annotations

import re

__all__ = ["compute_score"]

_INTEGER = re.compile(r"-?\d+")


def compute_score(
    solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` if the response is exactly the right integer, ``format_score`` if it is another
    integer, 0.0 otherwise."""
    answer = solution_str.strip()
    if not _INTEGER.fullmatch(answer):
        return 0.0
    return score if int(answer) == int(str(ground_truth).strip()) else format_score
