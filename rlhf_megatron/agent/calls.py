"""Tool calls: parsed out of the model's text (hermes format) and run safely against a tool.

Hermes is the format of Qwen's chat templates: each call is a JSON object between tags,
``<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>``, several
per turn allowed. ``parse_hermes`` never raises: each malformed call becomes an error message
written for the model, which the agent loop returns as that call's tool response, so the policy
learns to write well-formed calls instead of the rollout failing.

``run_tool_call`` is the one place a tool is called: it checks arguments against the tool's
schema, enforces a timeout (cancelling the call), turns exceptions and malformed results into
``Error: ...`` responses, and truncates long text as verl's ``tool_response_truncate_side`` does.

Hostile text is answered, never raised: a call of more than ``MAX_CALL_CHARS`` characters,
JSON nested deeper than ``MAX_DEPTH`` (the parser's own recursion limit is far above what a chat
template can render back), integers past Python's digit limit, control characters and lone
surrogates each give the model an ``Error: ...`` naming the call; names and values are quoted
shortened in messages.

Boundaries: text in, ``ToolResponse`` out; no tokenizer, no rollout engine.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import numbers
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel

from rlhf_megatron.agent.base import BaseTool
from rlhf_megatron.agent.errors import ToolError, ToolTimeout
from rlhf_megatron.agent.schemas import (
    OpenAIFunctionCallSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionToolSchema,
    ToolResponse,
)

__all__ = [
    "MAX_CALL_CHARS",
    "MAX_DEPTH",
    "CallStatus",
    "decode_json",
    "describe_exception",
    "quote",
    "TRUNCATE_SIDES",
    "parse_hermes",
    "run_tool_call",
    "truncate_text",
    "unknown_tool_response",
    "validate_arguments",
]

logger = logging.getLogger(__name__)

CallStatus = Literal["ok", "error", "timeout"]
#: verl's ``tool_response_truncate_side``: keep the head, the tail, or both halves.
TRUNCATE_SIDES = ("left", "right", "middle")

#: The longest tool call (JSON between the tags) parsed; longer ones are answered with an error.
MAX_CALL_CHARS = 1_000_000
#: The deepest nesting of arrays and objects a call's JSON may have (the call itself is depth 1).
MAX_DEPTH = 32
_START, _END = "<tool_call>", "</tool_call>"
_CALL_FORMAT = '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>'
# How long a cancelled call may take to unwind (its finally blocks) before it is abandoned.
_CANCEL_GRACE_S = 0.2
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


def parse_hermes(text: str) -> tuple[str, list[OpenAIFunctionParsedSchema], list[str]]:
    """Split a turn into ``(content without the calls, calls, errors)``.

    Each error is an ``Error: ...`` message for the model naming the call by position. A block
    with no closing tag (the turn was cut off, or a second ``<tool_call>`` opened first) is an
    error and is removed from the content like a well-formed one.
    """
    content: list[str] = []
    calls: list[OpenAIFunctionParsedSchema] = []
    errors: list[str] = []
    pos, ordinal = 0, 0
    while True:
        start = text.find(_START, pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        ordinal += 1
        body_start = start + len(_START)
        end = text.find(_END, body_start)
        reopen = text.find(_START, body_start)
        if end < 0 or 0 <= reopen < end:
            errors.append(f"Error: tool call {ordinal} has no closing </tool_call>; write {_CALL_FORMAT}.")
            if end < 0:
                break
            pos = reopen
            continue
        pos = end + len(_END)
        call, error = _parse_block(text[body_start:end], ordinal)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    return "".join(content).strip(), calls, errors


def _parse_block(body: str, ordinal: int) -> tuple[OpenAIFunctionParsedSchema | None, str]:
    if len(body) > MAX_CALL_CHARS:
        return None, (
            f"Error: tool call {ordinal} is {len(body)} characters long; at most {MAX_CALL_CHARS} are read. "
            f"Write {_CALL_FORMAT}."
        )
    payload, problem = decode_json(body)
    if problem:
        return None, f"Error: tool call {ordinal} {problem}; write {_CALL_FORMAT}."
    if not isinstance(payload, dict):
        return None, (
            f"Error: tool call {ordinal} must be a JSON object, got {_json_type(payload)}; write {_CALL_FORMAT}."
        )
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f'Error: tool call {ordinal} has no "name" (a non-empty string); write {_CALL_FORMAT}.'
    # A call without "arguments" is a call with none, as for a tool that takes no parameters.
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, dict):
        return None, (
            f'Error: tool call {ordinal} ({_label(name)}): "arguments" must be a JSON object, got '
            f"{_json_type(arguments)}; write {_CALL_FORMAT}."
        )
    return OpenAIFunctionParsedSchema(name=name, arguments=json.dumps(arguments, ensure_ascii=False)), ""


def decode_json(text: str) -> tuple[Any, str]:
    """``(value, "")``, or ``(None, what is wrong)`` for text that is not JSON, is nested deeper
    than ``MAX_DEPTH``, holds an integer past Python's digit limit or a lone surrogate. Never
    raises."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
    except RecursionError:
        return None, f"is nested too deeply (at most {MAX_DEPTH} levels of arrays and objects)"
    except ValueError as err:  # e.g. an integer of more than 4,300 digits
        return None, f"cannot be read: {quote(str(err), 120)}"
    except Exception as err:  # anything else the decoder raises: still the call's fault
        return None, f"cannot be read ({type(err).__name__})"
    problem = _check_value(value)
    return (None, problem) if problem else (value, "")


def _check_value(value: Any) -> str:
    """What makes a decoded value unusable downstream (depth, lone surrogates), or ""."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                return f"is nested too deeply (at most {MAX_DEPTH} levels of arrays and objects)"
            children = list(item.items()) if isinstance(item, dict) else item
            for child in children:
                if isinstance(child, tuple):  # a (key, value) pair: the key is a string
                    stack += [(child[0], depth), (child[1], depth + 1)]
                else:
                    stack.append((child, depth + 1))
        elif isinstance(item, str) and not _is_encodable(item):
            return "holds a lone surrogate (\\ud800-\\udfff) in a string; write valid UTF-8"
    return ""


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def describe_exception(err: BaseException, limit: int = 2000) -> str:
    """``"Type: message"``, the message cut to ``limit`` characters; never raises (a hostile or
    recursive ``__str__`` gives the type alone)."""
    try:
        text = str(err)
    except Exception:
        return type(err).__name__
    return f"{type(err).__name__}: {text if len(text) <= limit else text[:limit] + '...'}"


def _label(name: str) -> str:
    """A tool name as written when it is short and printable, else ``quote``d."""
    return name if len(name) <= 64 and name.isprintable() else quote(name)


def quote(value: Any, limit: int = 64) -> str:
    """``repr(value)`` cut to about ``limit`` characters: safe to put in a message whatever the
    value holds (control characters and surrogates are escaped, huge values are shortened)."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"...({len(value)} characters)"
    try:
        text = repr(value)
    except Exception:  # a RecursionError on deep nesting, a hostile __repr__
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def validate_arguments(schema: OpenAIFunctionToolSchema, arguments: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``arguments`` for the tool ``schema``, one message per problem.

    Checks required parameters, unknown ones (only when the schema lists properties), the basic
    JSON type of each value and ``enum``. Types the checker does not know are not checked.
    """
    params = schema.function.parameters
    problems = [f"missing required argument '{name}'" for name in params.required if name not in arguments]
    for name, value in arguments.items():
        prop = params.properties.get(name)
        if prop is None:
            if params.properties:
                problems.append(
                    f"unknown argument {quote(name)}; tool '{schema.function.name}' takes: "
                    f"{', '.join(params.properties)}"
                )
            continue
        expected = _JSON_TYPES.get(prop.type)
        # bool is an int in Python but not a JSON number.
        if expected is not None and (
            not isinstance(value, expected) or (isinstance(value, bool) and prop.type != "boolean")
        ):
            problems.append(f"argument '{name}' must be {_article(prop.type)}, got {_json_type(value)}")
        elif prop.enum is not None and value not in prop.enum:
            problems.append(f"argument '{name}' must be one of: {', '.join(prop.enum)}; got {quote(value)}")
    return problems


def truncate_text(text: str, max_chars: int | None, side: str = "middle") -> tuple[str, bool]:
    """``(text cut to at most max_chars, whether it was cut)``, marker included.

    ``left`` keeps the head, ``right`` the tail, ``middle`` both halves (verl's sides).
    """
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side must be one of {', '.join(TRUNCATE_SIDES)}, got {side!r}")
    if max_chars is None or len(text) <= max_chars:
        return text, False
    marker = {"left": "...(truncated)", "right": "(truncated)...", "middle": "...(truncated)..."}[side]
    if max_chars <= len(marker):  # no room for the marker: a plain cut
        return (text[len(text) - max_chars :] if side == "right" else text[:max_chars]), True
    keep = max_chars - len(marker)
    if side == "left":
        return text[:keep] + marker, True
    if side == "right":
        return marker + text[len(text) - keep :], True
    head = (keep + 1) // 2
    tail = keep - head
    return text[:head] + marker + text[len(text) - tail :], True


def unknown_tool_response(name: str, available: Iterable[str]) -> ToolResponse:
    """The response to a call of a tool that is not configured (the caller looks tools up)."""
    names = ", ".join(sorted(available)) or "(no tools)"
    return ToolResponse(text=f"Error: unknown tool {quote(name)}; available: {names}")


async def run_tool_call(
    tool: BaseTool,
    instance_id: str,
    call: OpenAIFunctionCallSchema | OpenAIFunctionParsedSchema,
    execute_kwargs: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
    max_response_chars: int | None = None,
    truncate_side: str = "middle",
) -> tuple[ToolResponse, float | None, dict[str, Any], CallStatus]:
    """Run one call of ``tool``: ``(response, step reward or None, metrics, status)``.

    Never raises for anything the tool or the model did: bad arguments, an exception, a
    timeout (the call is cancelled) or a malformed result each give an ``Error: ...`` response,
    no step reward and status ``error`` or ``timeout``. ``metrics`` are the tool's own plus
    ``latency_s`` and ``truncated``. A tool that returns a plain ``str`` (older verl) or verl's
    own ``ToolResponse`` is accepted. ``timeout_s`` None or <= 0: no timeout; ``max_response_chars``
    None: no truncation.
    """
    if truncate_side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate_side must be one of {', '.join(TRUNCATE_SIDES)}, got {truncate_side!r}")
    started = time.monotonic()
    response, reward, metrics, status = await _execute(
        tool, instance_id, call, execute_kwargs or {}, timeout_s
    )
    truncated = False
    if response.text:
        text, truncated = truncate_text(response.text, max_response_chars, truncate_side)
        if truncated:
            response = response.model_copy(update={"text": text})
    metrics = {**metrics, "latency_s": time.monotonic() - started, "truncated": truncated}
    return response, reward, metrics, status


class _CallTimeout(Exception):
    """Raised by ``_await_with_timeout``; distinct from a TimeoutError the tool raises itself."""


async def _execute(
    tool: BaseTool,
    instance_id: str,
    call: OpenAIFunctionCallSchema | OpenAIFunctionParsedSchema,
    execute_kwargs: Mapping[str, Any],
    timeout_s: float | None,
) -> tuple[ToolResponse, float | None, dict[str, Any], CallStatus]:
    try:
        arguments, problem = _call_arguments(tool, call)
    except Exception as err:  # validating hostile arguments must not end the rollout either
        arguments, problem = None, f"the arguments of the call cannot be checked ({type(err).__name__})"
    if problem:  # an unknown tool's message is a whole "Error: ..." already; _error keeps it
        return _error(problem), None, {}, "error"
    try:
        pending = tool.execute(instance_id, arguments, **execute_kwargs)
        result = await _await_with_timeout(pending, timeout_s) if inspect.isawaitable(pending) else pending
    except _CallTimeout:
        return _error(f"tool '{tool.name}' timed out after {timeout_s:g} s"), None, {}, "timeout"
    except ToolTimeout as err:
        return _error(str(err)), None, {}, "timeout"
    except ToolError as err:
        return _error(str(err)), None, {}, "error"
    except Exception as err:
        logger.warning("tool %s raised", tool.name, exc_info=True)
        return _error(f"tool '{tool.name}' failed: {describe_exception(err)}"), None, {}, "error"
    return _normalise(tool.name, result)


def _call_arguments(
    tool: BaseTool, call: OpenAIFunctionCallSchema | OpenAIFunctionParsedSchema
) -> tuple[dict[str, Any] | None, str]:
    """``(arguments, "")`` for a call ``tool`` can run, else ``(None, the problem)``."""
    if call.name != tool.name:
        return None, unknown_tool_response(call.name, [tool.name]).text or ""
    if isinstance(call, OpenAIFunctionParsedSchema):
        arguments, problem = decode_json(call.arguments)
        if problem or not isinstance(arguments, dict):
            return None, f"the arguments of the call to '{call.name}' are not a JSON object"
    else:
        arguments = dict(call.arguments)
        problem = _check_value(arguments)
        if problem:
            return None, f"the arguments of the call to '{call.name}' {problem}"
    problems = validate_arguments(tool.tool_schema, arguments)
    return (None, "; ".join(problems)) if problems else (arguments, "")


async def _await_with_timeout(awaitable: Any, timeout_s: float | None) -> Any:
    """Await ``awaitable``; past ``timeout_s`` cancel it and raise ``_CallTimeout``.

    Unlike ``asyncio.wait_for``, a call that ignores its cancellation cannot hold up the caller:
    it gets ``_CANCEL_GRACE_S`` to unwind and is then left behind, with a warning.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s if timeout_s and timeout_s > 0 else None)
    except BaseException:
        task.cancel()  # the caller was cancelled: the call goes with it
        raise
    if task in done:
        return task.result()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)
    if not done:
        logger.warning("a tool call ignored its cancellation after a %s s timeout; abandoning it", timeout_s)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no "never retrieved" noise
    raise _CallTimeout


def _normalise(name: str, result: Any) -> tuple[ToolResponse, float | None, dict[str, Any], CallStatus]:
    """A tool's return value as ``(response, reward, metrics, "ok")``, or an error for garbage."""
    if isinstance(result, tuple):
        if len(result) != 3:
            return _bad_result(name, f"a tuple of {len(result)} items")
        raw_response, reward, metrics = result
    else:
        raw_response, reward, metrics = result, None, {}
    response = _as_response(raw_response)
    if response is None:
        return _bad_result(name, f"a response of type {type(raw_response).__name__}")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)):
        return _bad_result(name, f"a step reward of type {type(reward).__name__}")
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        return _bad_result(name, f"metrics of type {type(metrics).__name__}")
    return response, (None if reward is None else float(reward)), dict(metrics), "ok"


def _as_response(raw: Any) -> ToolResponse | None:
    if isinstance(raw, ToolResponse):
        return raw
    if raw is None:
        return ToolResponse()
    if isinstance(raw, str):
        return ToolResponse(text=raw)
    # verl's own ToolResponse (a tool still importing verl), or any model with the same fields.
    if isinstance(raw, BaseModel) and {"text", "image", "video"} >= set(type(raw).model_fields):
        try:
            return ToolResponse.model_validate(raw.model_dump())
        except ValueError:
            return None
    return None


def _bad_result(name: str, what: str) -> tuple[ToolResponse, None, dict[str, Any], CallStatus]:
    logger.warning("tool %s returned %s", name, what)
    return (
        _error(
            f"tool '{name}' returned {what} instead of (ToolResponse, reward, metrics); "
            "the tool is broken, not the call"
        ),
        None,
        {},
        "error",
    )


def _error(message: str) -> ToolResponse:
    return ToolResponse(text=message if message.startswith("Error:") else f"Error: {message}")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _article(json_type: str) -> str:
    return f"an {json_type}" if json_type[0] in "aeiou" else f"a {json_type}"
