"""Hermes tool-call parsing and run_tool_call: argument checks, errors, timeouts, odd results,
truncation. Every failure must come back as a message for the model, never an exception."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pydantic import BaseModel

from rlhf_megatron.agent import (
    BaseTool,
    OpenAIFunctionCallSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionToolSchema,
    ToolError,
    ToolResponse,
    parse_hermes,
    run_tool_call,
    truncate_text,
    unknown_tool_response,
    validate_arguments,
)


def _call_block(payload) -> str:
    return f"<tool_call>{json.dumps(payload)}</tool_call>"


# ---------------------------------------------------------------- parse_hermes


def test_parse_one_call_with_text_around():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\nDone.'
    content, calls, errors = parse_hermes(text)
    assert content == "Let me compute.\n\nDone."
    assert errors == []
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("calculator", {"expression": "2+2"})]


def test_parse_several_calls_keeps_order_and_unicode():
    text = (
        _call_block({"name": "search", "arguments": {"query": "Paris café"}})
        + "\n"
        + _call_block({"name": "calculator", "arguments": {"expression": "1/3"}})
        + _call_block({"name": "ping"})  # no "arguments": a call with none
    )
    content, calls, errors = parse_hermes(text)
    assert (content, errors) == ("", [])
    assert [c.name for c in calls] == ["search", "calculator", "ping"]
    assert calls[0].arguments == '{"query": "Paris café"}'  # not \\u-escaped
    assert calls[2].arguments == "{}"


def test_parse_text_without_calls():
    assert parse_hermes("  The answer is 4.  ") == ("The answer is 4.", [], [])


def test_parse_malformed_json():
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>after'
    content, calls, errors = parse_hermes(text)
    assert (content, calls) == ("after", [])
    [error] = errors
    assert error.startswith("Error: tool call 1 is not valid JSON (")
    assert (
        "line 1 column" in error
        and '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>' in error
    )


def test_parse_missing_name_and_non_object_payloads():
    text = (
        _call_block({"arguments": {"x": 1}})
        + _call_block({"name": "", "arguments": {}})
        + _call_block(["calculator", {"expression": "1"}])
        + _call_block({"name": "calculator", "arguments": {"expression": "1"}})
    )
    content, calls, errors = parse_hermes(text)
    assert [c.name for c in calls] == ["calculator"]
    assert errors[0].startswith('Error: tool call 1 has no "name"')
    assert errors[1].startswith('Error: tool call 2 has no "name"')
    assert errors[2].startswith("Error: tool call 3 must be a JSON object, got array")


@pytest.mark.parametrize(
    "arguments, kind", [('"2+2"', "string"), ("[1, 2]", "array"), ("7", "integer"), ("null", "null")]
)
def test_parse_arguments_that_are_not_an_object(arguments, kind):
    content, calls, errors = parse_hermes(
        f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'
    )
    assert calls == []
    assert errors == [
        f'Error: tool call 1 (calculator): "arguments" must be a JSON object, got {kind}; '
        'write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>.'
    ]


def test_parse_unterminated_block_at_the_end():
    good = _call_block({"name": "calculator", "arguments": {"expression": "1"}})
    content, calls, errors = parse_hermes("Thinking. " + good + ' <tool_call>{"name": "calculator", "argu')
    assert content == "Thinking."
    assert [c.name for c in calls] == ["calculator"]
    assert errors == [
        "Error: tool call 2 has no closing </tool_call>; "
        'write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>.'
    ]


def test_parse_block_reopened_before_it_closed():
    text = '<tool_call>{"name": "a"' + _call_block({"name": "b", "arguments": {}}) + " tail"
    content, calls, errors = parse_hermes(text)
    assert [c.name for c in calls] == ["b"]
    assert errors[0].startswith("Error: tool call 1 has no closing </tool_call>")
    assert content == "tail"


# ---------------------------------------------------------------- run_tool_call

CALC_SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "test tool",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string"},
                    "digits": {"type": "integer"},
                    "scale": {"type": "number"},
                    "exact": {"type": "boolean"},
                    "mode": {"type": "string", "enum": ["fast", "slow"]},
                },
                "required": ["expression"],
            },
        },
    }
)


class FakeTool(BaseTool):
    """A tool whose ``execute`` is the coroutine function given to it."""

    def __init__(self, behaviour, schema=CALC_SCHEMA):
        super().__init__({}, schema)
        self.behaviour = behaviour
        self.seen: list = []

    async def execute(self, instance_id, parameters, **kwargs):
        self.seen.append((instance_id, parameters, kwargs))
        return await self.behaviour(parameters)


async def _ok(parameters):
    return ToolResponse(text=f"got {parameters['expression']}"), 0.25, {"calls": 1}


def _run(tool, arguments, **kwargs):
    call = OpenAIFunctionCallSchema(name=tool.name, arguments=arguments)
    return asyncio.run(run_tool_call(tool, "inst", call, **kwargs))


def test_ok_call_passes_arguments_and_execute_kwargs():
    tool = FakeTool(_ok)
    response, reward, metrics, status = _run(
        tool, {"expression": "1+1", "digits": 3}, execute_kwargs={"trace": 7}
    )
    assert (response.text, reward, status) == ("got 1+1", 0.25, "ok")
    assert metrics["calls"] == 1 and metrics["truncated"] is False and metrics["latency_s"] >= 0
    assert tool.seen == [("inst", {"expression": "1+1", "digits": 3}, {"trace": 7})]


def test_parsed_call_is_decoded_and_bad_json_arguments_are_reported():
    tool = FakeTool(_ok)
    parsed = OpenAIFunctionParsedSchema(name="calc", arguments='{"expression": "6*7"}')
    response, _, _, status = asyncio.run(run_tool_call(tool, "i", parsed))
    assert (response.text, status) == ("got 6*7", "ok")
    bad = OpenAIFunctionParsedSchema(name="calc", arguments="[1]")
    response, reward, _, status = asyncio.run(run_tool_call(tool, "i", bad))
    assert (response.text, reward, status) == (
        "Error: the arguments of the call to 'calc' are not a JSON object",
        None,
        "error",
    )


def test_missing_argument():
    tool = FakeTool(_ok)
    response, reward, metrics, status = _run(tool, {})
    assert (response.text, reward, status) == ("Error: missing required argument 'expression'", None, "error")
    assert tool.seen == []  # never executed


def test_unknown_and_wrong_typed_arguments():
    tool = FakeTool(_ok)
    response, _, _, status = _run(tool, {"expression": "1", "precision": 2})
    assert status == "error"
    assert response.text == (
        "Error: unknown argument 'precision'; tool 'calc' takes: expression, digits, scale, exact, mode"
    )
    response, _, _, _ = _run(
        tool, {"expression": 5, "digits": "3", "scale": True, "exact": 1, "mode": "medium"}
    )
    assert response.text == (
        "Error: argument 'expression' must be a string, got integer; "
        "argument 'digits' must be an integer, got string; "
        "argument 'scale' must be a number, got boolean; "
        "argument 'exact' must be a boolean, got integer; "
        "argument 'mode' must be one of: fast, slow; got 'medium'"
    )
    assert tool.seen == []
    # ints are numbers; a float is not an integer
    assert validate_arguments(CALC_SCHEMA, {"expression": "x", "scale": 2}) == []
    assert validate_arguments(CALC_SCHEMA, {"expression": "x", "digits": 2.0}) == [
        "argument 'digits' must be an integer, got number"
    ]


def test_schema_without_properties_accepts_any_argument():
    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "f", "description": "d"}}
    )
    assert validate_arguments(schema, {"anything": [1, 2]}) == []


def test_unknown_tool_helper():
    response = unknown_tool_response("y", ["b", "a"])
    assert response.text == "Error: unknown tool 'y'; available: a, b"
    assert unknown_tool_response("y", []).text == "Error: unknown tool 'y'; available: (no tools)"


def test_tool_that_raises():
    async def boom(parameters):
        raise ValueError("division went sideways")

    response, reward, metrics, status = _run(FakeTool(boom), {"expression": "1"})
    assert (response.text, reward, status) == (
        "Error: tool 'calc' failed: ValueError: division went sideways",
        None,
        "error",
    )
    assert "latency_s" in metrics


def test_tool_error_message_goes_to_the_model_as_is():
    async def refuse(parameters):
        raise ToolError("calc: names are not allowed")

    response, _, _, status = _run(FakeTool(refuse), {"expression": "x"})
    assert (response.text, status) == ("Error: calc: names are not allowed", "error")


def test_tool_own_timeout_error_is_an_error_not_a_timeout():
    async def upstream_timeout(parameters):
        raise TimeoutError("retriever did not answer")

    response, _, _, status = _run(FakeTool(upstream_timeout), {"expression": "x"}, timeout_s=5)
    assert (
        status == "error"
        and response.text == "Error: tool 'calc' failed: TimeoutError: retriever did not answer"
    )


def test_hanging_tool_is_cancelled_at_the_timeout():
    state = {"cancelled": False, "finished": False}

    async def hang(parameters):
        try:
            await asyncio.sleep(60)
            state["finished"] = True
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    started = time.monotonic()
    response, reward, metrics, status = _run(FakeTool(hang), {"expression": "1"}, timeout_s=0.3)
    elapsed = time.monotonic() - started
    assert (response.text, reward, status) == ("Error: tool 'calc' timed out after 0.3 s", None, "timeout")
    assert state == {"cancelled": True, "finished": False}
    assert 0.3 <= elapsed < 0.8


def test_tool_that_ignores_cancellation_does_not_hold_up_the_call():
    cancels = []

    async def stubborn(parameters):
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancels.append(time.monotonic())
                if len(cancels) > 1:  # the event loop's shutdown: give up
                    raise

    async def scenario():
        started = time.monotonic()
        result = await run_tool_call(
            FakeTool(stubborn),
            "i",
            OpenAIFunctionCallSchema(name="calc", arguments={"expression": "1"}),
            timeout_s=0.2,
        )
        return result, time.monotonic() - started

    (response, _, _, status), elapsed = asyncio.run(scenario())
    assert status == "timeout" and response.text == "Error: tool 'calc' timed out after 0.2 s"
    assert elapsed < 0.7
    assert len(cancels) == 2  # cancelled at the timeout, again when asyncio.run cleaned up


def test_cancelling_the_caller_cancels_the_tool():
    state = {"cancelled": False}

    async def hang(parameters):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    async def scenario():
        call = OpenAIFunctionCallSchema(name="calc", arguments={"expression": "1"})
        task = asyncio.create_task(run_tool_call(FakeTool(hang), "i", call, timeout_s=30))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # let the tool's task run its except block

    asyncio.run(scenario())
    assert state["cancelled"] is True


@pytest.mark.parametrize(
    "side, head, tail, marker",
    [
        ("left", "A", "...(truncated)", None),
        ("right", "(truncated)...", "B", None),
        ("middle", "A", "B", "...(truncated)..."),
    ],
)
def test_ten_megabytes_are_truncated_per_side(side, head, tail, marker):
    big = "A" * 5_000_000 + "B" * 5_000_000

    async def flood(parameters):
        return ToolResponse(text=big), 0.0, {}

    response, _, metrics, status = _run(
        FakeTool(flood), {"expression": "1"}, max_response_chars=1000, truncate_side=side
    )
    assert status == "ok" and metrics["truncated"] is True
    assert len(response.text) == 1000
    assert response.text.startswith(head) and response.text.endswith(tail)
    if marker:
        assert response.text.count(marker) == 1
        before, after = response.text.split(marker)
        assert set(before) == {"A"} and set(after) == {"B"}
        assert abs(len(before) - len(after)) <= 1


def test_truncate_text_edges():
    assert truncate_text("short", 10, "left") == ("short", False)
    assert truncate_text("x" * 20, None, "middle") == ("x" * 20, False)
    assert truncate_text("abcdefghij", 4, "right") == ("ghij", True)  # no room for the marker
    assert truncate_text("abcdefghij", 0, "right") == ("", True)
    with pytest.raises(ValueError, match="left, right, middle"):
        truncate_text("abc", 1, "top")


def test_plain_str_results_are_wrapped():
    async def bare(parameters):
        return "just text"

    async def old_verl(parameters):
        return "old style", 0.5, {"k": 1}

    response, reward, metrics, status = _run(FakeTool(bare), {"expression": "1"})
    assert (response, reward, status) == (ToolResponse(text="just text"), None, "ok")
    response, reward, metrics, status = _run(FakeTool(old_verl), {"expression": "1"})
    assert (response.text, reward, metrics["k"], status) == ("old style", 0.5, 1, "ok")


def test_verls_own_tool_response_is_accepted():
    class ToolResponseFromVerl(BaseModel):  # same fields as verl.tools.schemas.ToolResponse
        text: str | None = None
        image: list | None = None
        video: list | None = None

    async def verl_style(parameters):
        return ToolResponseFromVerl(text="from verl", image=["img"]), 1, None

    response, reward, metrics, status = _run(FakeTool(verl_style), {"expression": "1"})
    assert isinstance(response, ToolResponse)
    assert (response.text, response.image, reward, status) == ("from verl", ["img"], 1.0, "ok")


@pytest.mark.parametrize(
    "result, what",
    [
        (42, "a response of type int"),
        ((ToolResponse(text="x"), 0.0), "a tuple of 2 items"),
        ((ToolResponse(text="x"), "high", {}), "a step reward of type str"),
        ((ToolResponse(text="x"), 0.0, ["m"]), "metrics of type list"),
        (({"text": "x"}, 0.0, {}), "a response of type dict"),
    ],
)
def test_garbage_results_become_errors(result, what):
    async def garbage(parameters):
        return result

    response, reward, metrics, status = _run(FakeTool(garbage), {"expression": "1"})
    assert status == "error" and reward is None
    assert response.text == (
        f"Error: tool 'calc' returned {what} instead of (ToolResponse, reward, metrics); the tool is broken, not the call"
    )


def test_error_messages_are_truncated_too():
    async def loud(parameters):
        raise RuntimeError("x" * 10_000)

    response, _, metrics, status = _run(
        FakeTool(loud), {"expression": "1"}, max_response_chars=100, truncate_side="left"
    )
    assert status == "error" and len(response.text) == 100 and metrics["truncated"] is True
    assert response.text.startswith("Error: tool 'calc' failed: RuntimeError: xxx")


def test_bad_truncate_side_is_a_programming_error():
    with pytest.raises(ValueError, match="truncate_side must be one of left, right, middle"):
        _run(FakeTool(_ok), {"expression": "1"}, truncate_side="both")


def test_a_tool_timeout_error_counts_as_a_timeout():
    from rlhf_megatron.agent import ToolTimeout

    class Slow(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            raise ToolTimeout("slow: the search backend did not answer in 5 s")

    schema = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {"name": "slow", "description": "d", "parameters": {"type": "object"}},
        }
    )
    call = OpenAIFunctionCallSchema(name="slow", arguments={})
    response, reward, _, status = asyncio.run(run_tool_call(Slow({}, schema), "i", call))
    assert status == "timeout" and reward is None
    assert response.text == "Error: slow: the search backend did not answer in 5 s"
