"""The OpenAI chat-completions wire format of the policy's endpoint: requests checked, replies built.

``parse_chat_request`` takes a request body (bytes or a decoded object) from an agent program and
returns a ``ChatRequest`` or an ``OpenAIError``: the status and the ``{"error": {...}}`` body the
``openai`` SDK raises as ``BadRequestError`` and the like. Whatever the body holds (not JSON, JSON
nested past any chat template's need, 5,000-digit numbers, a message with no role, a tool with no
name, ``n > 1``), the answer is an error the agent sees, never an exception.

The trainer's sampling settings win: ``temperature``, ``top_p`` and ``max_tokens`` (or
``max_completion_tokens``) that an agent sends and that differ from them are recorded in
``ChatRequest.overridden`` (counted by the endpoint) and replaced; the response budget is also
capped by what the episode has left.

``chat_completion`` and ``stream_chunks`` build the reply from what the engine sampled: the text
split by the rollout's tool-call parser into ``content`` and OpenAI ``tool_calls`` (``finish_reason``
``tool_calls``), with ``prompt_token_ids`` and ``token_ids`` as vLLM's own server adds them when
asked (``return_token_ids``).

Boundaries: JSON in, JSON out; no tokenizer, no engine, no HTTP server.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.agent.calls import decode_json, parse_hermes

__all__ = [
    "ChatRequest",
    "OpenAIError",
    "SamplingDefaults",
    "chat_completion",
    "models_list",
    "parse_chat_request",
    "stream_chunks",
]

MAX_BODY_BYTES = 8 << 20
"""The largest request body accepted (an agent's whole conversation, its tools and images as URLs)."""

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class OpenAIError:
    """An error reply: HTTP ``status`` and OpenAI's body."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class SamplingDefaults:
    """The trainer's sampling settings, which requests cannot change."""

    temperature: float
    top_p: float
    max_tokens: int
    """The response budget of one call."""


@dataclass
class ChatRequest:
    """A checked chat-completion request."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    stream: bool
    include_usage: bool
    temperature: float
    top_p: float
    max_tokens: int
    stop: list[str]
    seed: int | None
    overridden: dict[str, Any] = field(default_factory=dict)
    """The agent's values that differed from the trainer's and were replaced, by key."""


def _error(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> OpenAIError:
    return OpenAIError(status=status, message=message, param=param, code=code)


def _content_ok(content: Any, where: str) -> OpenAIError | None:
    """Message content: a string, null, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None or isinstance(content, str):
        return None
    if isinstance(content, list):
        for k, part in enumerate(content):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                return _error(
                    f"{where}.content[{k}] must be a text part ({{'type': 'text', 'text': '...'}}); "
                    "this endpoint serves a text policy",
                    f"{where}.content",
                )
        return None
    return _error(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _message_ok(msg: Any, i: int) -> OpenAIError | None:
    where = f"messages[{i}]"
    if not isinstance(msg, Mapping):
        return _error(f"{where} must be an object with a role", where)
    role = msg.get("role")
    if role not in ROLES:
        return _error(
            f"{where}.role must be one of {', '.join(ROLES)}, not {str(role)[:40]!r}", f"{where}.role"
        )
    bad = _content_ok(msg.get("content"), where)
    if bad is not None:
        return bad
    if role == "tool" and not isinstance(msg.get("tool_call_id", ""), str):
        return _error(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            return _error(f"{where}.tool_calls must be a list on an assistant message", f"{where}.tool_calls")
        for k, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                return _error(
                    f"{where}.tool_calls[{k}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                    f"{where}.tool_calls",
                )
            if not isinstance(fn.get("arguments", "{}"), str | Mapping):
                return _error(
                    f"{where}.tool_calls[{k}].function.arguments must be a JSON string",
                    f"{where}.tool_calls",
                )
    return None


def _tools_ok(tools: Any) -> OpenAIError | None:
    if not isinstance(tools, list):
        return _error("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, Mapping)
        ):
            return _error(f"tools[{k}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{k}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            return _error(f"tools[{k}].function.name must be a non-empty string", f"tools[{k}].function.name")
        if not isinstance(fn.get("parameters", {}), Mapping):
            return _error(f"tools[{k}].function.parameters must be a JSON schema object", f"tools[{k}]")
    return None


def _number(body: Mapping, key: str, lo: float, hi: float) -> tuple[float | None, OpenAIError | None]:
    value = body.get(key)
    if value is None:
        return None, None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not lo <= value <= hi
    ):
        return None, _error(f"{key} must be a number from {lo:g} to {hi:g}", key)
    return float(value), None


def parse_chat_request(
    raw: bytes | str | Mapping, defaults: SamplingDefaults, budget_left: int | None = None
) -> ChatRequest | OpenAIError:
    """Check a ``/v1/chat/completions`` body; ``budget_left``: response tokens the episode has left."""
    if isinstance(raw, bytes | str):
        if len(raw) > MAX_BODY_BYTES:
            return _error(f"the request body is over {MAX_BODY_BYTES} bytes", status=413)
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        body, problem = decode_json(text)
        if problem:
            return _error(f"the request body {problem}")
    else:
        body = raw
    if not isinstance(body, Mapping):
        return _error("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return _error("model is required (a string; GET /v1/models lists it)", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return _error("messages must be a non-empty list", "messages")
    for i, msg in enumerate(messages):
        bad = _message_ok(msg, i)
        if bad is not None:
            return bad
    tools = body.get("tools")
    if tools is not None and (bad := _tools_ok(tools)) is not None:
        return bad
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        return _error(
            f"n must be 1 here, not {str(n)[:20]}: the trainer samples the group itself (rollout.n)", "n"
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return _error("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage")) if isinstance(options, Mapping) else False
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        return _error("stop must be a string or a list of at most 4 strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or abs(seed) >= 2**63):
        return _error("seed must be an integer", "seed")

    overridden: dict[str, Any] = {}
    for key, lo, hi, default in (
        ("temperature", 0.0, 2.0, defaults.temperature),
        ("top_p", 0.0, 1.0, defaults.top_p),
    ):
        value, bad = _number(body, key, lo, hi)
        if bad is not None:
            return bad
        if value is not None and value != default:
            overridden[key] = value
    max_tokens = defaults.max_tokens
    for key in ("max_completion_tokens", "max_tokens"):
        asked = body.get(key)
        if asked is None:
            continue
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
            return _error(f"{key} must be a positive integer", key)
        if asked != defaults.max_tokens:
            overridden[key] = asked
        break
    if budget_left is not None:
        if budget_left <= 0:
            return _error(
                "this episode has used its whole response budget (data.max_response_length)",
                code="context_length_exceeded",
            )
        max_tokens = min(max_tokens, budget_left)
    return ChatRequest(
        model=model,
        messages=[dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools is not None else None,
        stream=stream,
        include_usage=include_usage,
        temperature=defaults.temperature,
        top_p=defaults.top_p,
        max_tokens=max_tokens,
        stop=stop,
        seed=seed,
        overridden=overridden,
    )


def _tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The reply's content and OpenAI ``tool_calls`` from the model's text (hermes). A malformed
    call block stays out of the content and becomes no call: the agent sees the content alone."""
    content, calls, _errors = parse_hermes(text)  # each call's arguments: a JSON object, serialised
    out = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]
    return content.strip() if out else content, out


def _finish(engine_reason: str, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def chat_completion(
    request: ChatRequest,
    text: str,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    engine_reason: str,
    completion_id: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """The ``chat.completion`` object of one sampled reply."""
    content, calls = _tool_calls(text) if request.tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": completion_id or f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": request.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": _finish(engine_reason, bool(calls)),
                "logprobs": None,
                "token_ids": list(output_ids),
            }
        ],
        "usage": _usage(prompt_ids, output_ids),
        "prompt_token_ids": list(prompt_ids),
    }


def _usage(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(output_ids),
        "total_tokens": len(prompt_ids) + len(output_ids),
    }


def stream_chunks(
    request: ChatRequest,
    text: str,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    engine_reason: str,
    completion: Mapping[str, Any] | None = None,
) -> Iterator[str]:
    """The reply as server-sent events (``data: {...}\\n\\n`` ... ``data: [DONE]\\n\\n``): the role,
    the content, each tool call whole, the finish reason, and the usage when asked. ``completion``:
    the ``chat_completion`` of the same reply when already built (its id and tool-call ids are kept)."""
    full = completion or chat_completion(request, text, prompt_ids, output_ids, engine_reason)
    base = {
        "id": full["id"],
        "object": "chat.completion.chunk",
        "created": full["created"],
        "model": request.model,
    }
    message = full["choices"][0]["message"]

    def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

    yield event({"role": "assistant", "content": ""})
    if message.get("content"):
        yield event({"content": message["content"]})
    for k, call in enumerate(message.get("tool_calls", [])):
        yield event({"tool_calls": [{"index": k, **call}]})
    yield event({}, full["choices"][0]["finish_reason"], token_ids=list(output_ids))
    if request.include_usage:
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': full['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def models_list(model: str, created: int | None = None) -> dict[str, Any]:
    """``GET /v1/models``: the one model the endpoint serves."""
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created or int(time.time()),
                "owned_by": "rlhf_megatron",
            }
        ],
    }
