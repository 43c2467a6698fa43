"""Two small math tools: a calculator and a gsm8k answer checker (verl's ``calc_gsm8k_reward``).

``CalculatorTool`` evaluates arithmetic by walking Python's ``ast`` (never ``eval``): numbers,
parentheses, unary minus/plus and ``+ - * / // % **``; anything else (names, calls, attributes,
strings, comparisons) is refused with a message the model can act on. Sizes are bounded so a
call cannot eat the rollout worker's memory or CPU (``9**9**9``).

``AnswerCheckTool`` records the model's answer per trajectory and scores it with a scorer the
tool config names (``score_fn``; the project's gsm8k scorer by default, imported by name: the
agent layer sits below ``rewards/`` and does not import it); ``calc_reward`` gives the final
score. Boundaries: pure Python, no I/O.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any
from uuid import uuid4

from rlhf_megatron.agent.base import BaseTool
from rlhf_megatron.agent.config import import_object
from rlhf_megatron.agent.errors import ToolConfigError, ToolError
from rlhf_megatron.agent.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["AnswerCheckTool", "CalculatorTool", "evaluate_expression", "format_number"]

MAX_EXPRESSION_CHARS = 1000
#: ``AnswerCheckTool``'s scorer unless its config names another: ``(solution, ground_truth,
#: format_score=, score=) -> float``, verl's ``compute_score`` signature.
DEFAULT_ANSWER_SCORER = "rlhf_megatron.rewards.gsm8k.compute_score"
# Integer results are capped at about 1000 digits; exponents are checked before computing.
MAX_INT_BITS = 3400
MAX_EXPONENT = 10_000

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_ALLOWED = "numbers, parentheses and the operators + - * / // % **"


def evaluate_expression(expression: str) -> int | float:
    """The value of an arithmetic expression; ``ToolError`` says why one is refused."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("calculator: the expression is empty; write e.g. (3 + 4) * 2")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"calculator: the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"calculator: cannot parse {expression!r}: {err.msg}; use only {_ALLOWED}") from err
    except (ValueError, RecursionError, MemoryError) as err:  # null bytes, absurd nesting
        raise ToolError(f"calculator: cannot parse {expression!r}; use only {_ALLOWED}") from err
    try:
        value = _eval(tree.body, expression.strip())
    except ZeroDivisionError as err:
        raise ToolError("calculator: division by zero") from err
    except (OverflowError, MemoryError) as err:
        raise ToolError("calculator: the result is too large") from err
    except RecursionError as err:
        raise ToolError("calculator: the expression is nested too deeply") from err
    if isinstance(value, complex):
        raise ToolError(
            "calculator: the result is not a real number (a fractional power of a negative number)"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("calculator: the result is not a finite number")
    return value


def _eval(node: ast.AST, source: str) -> int | float | complex:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ToolError(f"calculator: only {_ALLOWED} are allowed, not {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, source))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, source), _eval(node.right, source)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
            raise ToolError("calculator: the result is too large (more than about 1000 digits)")
        return result
    raise ToolError(f"calculator: only {_ALLOWED} are allowed; {_describe(node, source)} is not")


def _check_power(base: int | float | complex, exponent: int | float | complex) -> None:
    """Refuse a power whose result would be huge before computing it (``10**10**8`` would hang)."""
    if isinstance(exponent, complex) or abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"calculator: exponents are limited to {MAX_EXPONENT} in magnitude")
    int_power = isinstance(base, int) and isinstance(exponent, int) and exponent > 0
    # bit_length - 1 bounds log2(|base|) from below, so only results surely too large are refused.
    if int_power and abs(base) > 1 and (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
        raise ToolError("calculator: the result is too large (more than about 1000 digits)")


_KINDS = {
    ast.Name: "a name",
    ast.Call: "a function call",
    ast.Attribute: "an attribute",
    ast.Subscript: "indexing",
    ast.Compare: "a comparison",
    ast.BoolOp: "a boolean operator",
}


def _describe(node: ast.AST, source: str) -> str:
    """The refused part as the model wrote it, and what kind of thing it is."""
    text = ast.get_source_segment(source, node) or type(node).__name__
    kind = _KINDS.get(type(node), "an operator" if isinstance(node, ast.BinOp | ast.UnaryOp) else "allowed")
    text = repr(text if len(text) <= 60 else text[:57] + "...")
    return f"{text} ({kind})" if kind != "allowed" else text


def format_number(value: int | float) -> str:
    """Ints as they are; floats to 12 significant digits, whole floats without ``.0`` (6/3 -> 2)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


class CalculatorTool(BaseTool):
    """``calculator(expression)``: exact integer arithmetic and float division, as text."""

    default_tool_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "The expression, e.g. (12 + 30) / 7"}
                },
                "required": ["expression"],
            },
        },
    }

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        value = evaluate_expression(parameters.get("expression", ""))
        return ToolResponse(text=format_number(value)), 0.0, {}


class AnswerCheckTool(BaseTool):
    """verl's gsm8k tool: ``calc_gsm8k_reward(answer)`` records the answer and reports its score.

    ``create(instance_id, ground_truth=...)`` (or ``create_kwargs={"ground_truth": ...}``, as
    verl's agent loop passes it) opens a trajectory. A submission that does not raise the score
    costs ``config.no_improvement_penalty`` (default 0.05, verl's value) as a step reward, so the
    policy is not paid for resubmitting; ``calc_reward`` is the score of the last answer.
    """

    default_tool_schema = {
        "type": "function",
        "function": {
            "name": "calc_gsm8k_reward",
            "description": "Submit the final answer to the math problem (a number) and get its score.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "The final answer, digits only"}},
                "required": ["answer"],
            },
        },
    }

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        self.no_improvement_penalty = float(self.config.get("no_improvement_penalty", 0.05))
        scorer = self.config.get("score_fn", DEFAULT_ANSWER_SCORER)
        try:
            self.score_fn = import_object(scorer)
        except (ImportError, AttributeError) as err:
            raise ToolConfigError(f"config.score_fn={scorer!r} cannot be imported: {err}") from err
        if not callable(self.score_fn):
            raise ToolConfigError(f"config.score_fn={scorer!r} is not a function")
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id if instance_id is not None else str(uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"answer": "", "ground_truth": ground_truth, "score": 0.0}
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        state = self._state(instance_id)
        answer = str(parameters.get("answer", "")).strip()
        # The scorer reads the number after "#### ", the marker gsm8k solutions end with.
        state["answer"] = answer if answer.startswith("#### ") else f"#### {answer}"
        score = await self.calc_reward(instance_id)
        step_reward = 0.0 if score > state["score"] else -self.no_improvement_penalty
        state["score"] = score
        verdict = "correct" if score > 0 else "incorrect"
        return ToolResponse(text=f"Answer {answer!r} recorded: {verdict} (score {score:g})."), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._state(instance_id)
        if state["ground_truth"] is None:
            return 0.0
        return float(self.score_fn(state["answer"], str(state["ground_truth"]), format_score=0.0, score=1.0))

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)

    def _state(self, instance_id: str) -> dict[str, Any]:
        if instance_id not in self._instances:
            raise KeyError(f"{self.name}: no instance '{instance_id}'; call create() before execute()")
        return self._instances[instance_id]
