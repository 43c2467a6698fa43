"""Countdown scorer (TinyZero): reach the target using each given number exactly once.

The equation is the content of the last ``<answer>…</answer>``. It counts as an equation only
if it uses nothing but digits, ``+ - * /``, parentheses and spaces, and parses as arithmetic on
integer literals (checked on the Python AST; nothing is ever ``eval``-ed). Scores:

* ``score`` (1.0): the literals are exactly the given numbers (as a multiset) and the value is
  within 1e-5 of the target;
* ``format_score`` (0.1): an equation, but numbers reused/missing or the value is wrong;
* 0.0: no ``<answer>`` tag, or its content is not an equation (TinyZero gives format credit
  for any tag content; here tags around prose earn nothing).

``ground_truth`` is ``{"target": int, "numbers": [int, ...]}``; numpy arrays and numpy ints (as
pandas-based readers return them) are accepted.

Boundaries: a pure function of strings and numbers.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = ["compute_score", "evaluate_equation", "extract_equation"]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/()\s]+")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def extract_equation(solution_str: str) -> str | None:
    """Content of the last ``<answer>…</answer>``, stripped; None if there is none."""
    matches = _ANSWER.findall(solution_str)
    return matches[-1].strip() if matches else None


def _literals(node: ast.AST) -> list[int] | None:
    """Integer literals of an arithmetic AST, or None if it contains anything else."""
    if isinstance(node, ast.Expression):
        return _literals(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _literals(node.left), _literals(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _literals(node.operand)
    return None


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    return _UNARY[type(node.op)](_evaluate(node.operand))


def _parse(equation: str) -> ast.Expression | None:
    if not equation or not _ALLOWED_CHARS.fullmatch(equation):
        return None
    try:
        tree = ast.parse(equation, mode="eval")
        return tree if _literals(tree) else None
    except (SyntaxError, ValueError):  # e.g. "1 +", "05", "()"
        return None
    except (RecursionError, MemoryError):  # absurdly long or deeply nested input
        return None


def evaluate_equation(equation: str) -> float | None:
    """Value of an arithmetic equation, or None if it is not one (or divides by zero)."""
    tree = _parse(equation)
    if tree is None:
        return None
    try:
        return float(_evaluate(tree))
    except (ZeroDivisionError, OverflowError):
        return None


def _ints(values: Any) -> list[int]:
    values = values.tolist() if hasattr(values, "tolist") else values
    return [int(v) for v in values]


def compute_score(
    solution_str: str, ground_truth: Mapping[str, Any], format_score: float = 0.1, score: float = 1.0
) -> float:
    """See the module docstring."""
    target = float(ground_truth["target"])
    numbers = _ints(ground_truth["numbers"])
    equation = extract_equation(solution_str)
    tree = _parse(equation) if equation is not None else None
    if tree is None:
        return 0.0
    # Check the numbers before evaluating: with only the given (small) numbers the value is
    # cheap to compute, whereas an arbitrary expression could be "9*9*9*...".
    if Counter(_literals(tree)) != Counter(numbers):
        return format_score
    value = evaluate_equation(equation)
    if value is None or abs(value - target) >= 1e-5:
        return format_score
    return score
