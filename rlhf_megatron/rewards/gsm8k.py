"""GSM8K scorer: the answer is the number after the last ``#### `` marker (verl's "strict" method).

The model is asked to "output the final answer after ####", so only ``#### <number>`` counts;
the last such marker wins (a response may restate intermediate results). Commas are removed
("1,000" is 1000). Unlike verl's plain string comparison, a trailing sentence period is
dropped and numbers are compared by value, so "#### 18.00" and "#### 18." both match "18".

Boundaries: a pure function of strings.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["compute_score", "extract_solution"]

_STRICT = re.compile(r"#### (-?[0-9.,]+)")


def _clean(number: str) -> str:
    return number.replace(",", "").rstrip(".")


def extract_solution(solution_str: str) -> str | None:
    """The number after the last ``#### `` marker that is followed by one, commas removed."""
    matches = _STRICT.findall(solution_str)
    if not matches:
        return None
    answer = _clean(matches[-1])
    return answer if any(c.isdigit() for c in answer) else None


def _same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def compute_score(
    solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` if the extracted answer equals ``ground_truth``; ``format_score`` if an answer was
    found but is wrong; 0.0 if there is no ``#### <number>``."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return score if _same_number(answer, _clean(str(ground_truth).strip())) else format_score
