"""CalculatorTool (arithmetic by walking the ast, never eval) and AnswerCheckTool (verl's gsm8k tool)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlhf_megatron.agent import OpenAIFunctionCallSchema, ToolError, run_tool_call
from rlhf_megatron.agent.tools import AnswerCheckTool, CalculatorTool
from rlhf_megatron.agent.tools.calculator import evaluate_expression, format_number


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("2 ** -2", 0.25),
        ("-3 ** 2", -9),
        ("(-3) ** 2", 9),
        ("+4 - -2", 6),
        ("1.5 * 4", 6.0),
        ("2 ** 3 ** 2", 512),
        ("10 ** 100", 10**100),
        ("  48 / 2 + 3 ", 27.0),
    ],
)
def test_results(expression, value):
    result = evaluate_expression(expression)
    assert result == value
    assert type(result) is type(value)  # ints stay ints, division gives floats


@pytest.mark.parametrize(
    "value, text",
    [
        (7, "7"),
        (6 / 3, "2"),
        (3.5, "3.5"),
        (0.1 + 0.2, "0.3"),
        (-0.25, "-0.25"),
        (1e20, "1e+20"),
        (10**30, str(10**30)),
    ],
)
def test_format_number(value, text):
    assert format_number(value) == text


@pytest.mark.parametrize(
    "expression, message",
    [
        (
            "x + 1",
            "only numbers, parentheses and the operators + - * / // % ** are allowed; 'x' (a name) is not",
        ),
        ("__import__('os').system('true')", "\"__import__('os').system('true')\" (a function call) is not"),
        ("abs(-1)", "'abs(-1)' (a function call) is not"),
        ("(1).real", "'(1).real' (an attribute) is not"),
        ("'a' * 3", "not 'a'"),
        ("True + 1", "not True"),
        ("1j * 2", "not 1j"),
        ("1 < 2", "'1 < 2' (a comparison) is not"),
        ("1 << 10", "'1 << 10' (an operator) is not"),
        ("[1, 2]", "'[1, 2]' is not"),
        ("lambda: 1", "'lambda: 1' is not"),
        ("9 ** 9 ** 9", "exponents are limited to 10000 in magnitude"),
        ("2 ** 100000", "exponents are limited to 10000 in magnitude"),
        ("10 ** 5000", "the result is too large"),
        ("(10 ** 900) * (10 ** 900)", "the result is too large"),
        ("10.0 ** 400", "the result is too large"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1 +", "cannot parse '1 +'"),
        ("", "the expression is empty"),
        ("1+" * 600 + "1", "longer than 1000 characters"),
        ("(" * 300 + "1" + ")" * 300, "cannot parse"),
    ],
)
def test_refusals(expression, message):
    started = time.monotonic()
    with pytest.raises(ToolError) as info:
        evaluate_expression(expression)
    assert message in str(info.value)
    assert str(info.value).startswith("calculator: ")
    assert time.monotonic() - started < 1.0  # refused before doing the work


def test_calculator_tool_through_run_tool_call():
    tool = CalculatorTool({"type": "native"})
    assert tool.name == "calculator"
    assert tool.tool_schema.function.parameters.required == ["expression"]

    async def call(arguments):
        return await run_tool_call(
            tool, "i", OpenAIFunctionCallSchema(name="calculator", arguments=arguments)
        )

    response, reward, _, status = asyncio.run(call({"expression": "(12 + 30) / 7"}))
    assert (response.text, reward, status) == ("6", 0.0, "ok")
    response, reward, _, status = asyncio.run(call({"expression": "open('/etc/passwd')"}))
    assert status == "error" and reward is None
    assert response.text == (
        "Error: calculator: only numbers, parentheses and the operators + - * / // % ** are allowed; "
        "\"open('/etc/passwd')\" (a function call) is not"
    )


def _answer_session(tool, answers, **create_kwargs):
    async def scenario():
        instance_id, created = await tool.create(**create_kwargs)
        steps = [await tool.execute(instance_id, {"answer": a}) for a in answers]
        final = await tool.calc_reward(instance_id)
        await tool.release(instance_id)
        return instance_id, created, steps, final

    return asyncio.run(scenario())


def test_answer_check_rewards_like_verl():
    tool = AnswerCheckTool({"type": "native"})
    assert tool.name == "calc_gsm8k_reward"
    instance_id, created, steps, final = _answer_session(
        tool, ["70", "1,000", "#### 1000", "72"], ground_truth="1000"
    )
    assert created.is_empty()
    assert [(r.text, step) for r, step, _ in steps] == [
        ("Answer '70' recorded: incorrect (score 0).", -0.05),  # not better than 0: penalised
        ("Answer '1,000' recorded: correct (score 1).", 0.0),  # improved: commas are fine
        ("Answer '#### 1000' recorded: correct (score 1).", -0.05),  # resubmitting earns nothing
        ("Answer '72' recorded: incorrect (score 0).", -0.05),
    ]
    assert final == 0.0  # the last answer counts
    assert instance_id not in tool._instances


def test_answer_check_ground_truth_from_create_kwargs_and_penalty_config():
    tool = AnswerCheckTool({"type": "native", "no_improvement_penalty": 0.0})
    _, _, steps, final = _answer_session(tool, ["18.0", "18"], create_kwargs={"ground_truth": "18"})
    assert [step for _, step, _ in steps] == [0.0, 0.0]
    assert final == 1.0


def test_answer_check_without_ground_truth_scores_zero_and_unknown_instance_is_refused():
    tool = AnswerCheckTool({})
    _, _, steps, final = _answer_session(tool, ["5"])
    assert final == 0.0
    with pytest.raises(KeyError, match="call create\\(\\) before execute\\(\\)"):
        asyncio.run(tool.execute("never-created", {"answer": "1"}))
