"""Prompt ids for an agent's chat-completion request, token-exact where the agent continues a reply.

An agent sends its whole conversation with every call. Rendering it afresh through the chat
template can give other tokens than the policy sampled for its earlier replies (a tokenizer's
merges differ between sampled and re-encoded text; arguments are re-serialised; Qwen3's template
drops earlier ``<think>`` blocks), and a sample built from such calls would train on tokens the
policy never produced. So ``PromptRenderer.render`` continues in tokens where it can: when the
request's messages are an earlier call's messages, then the reply that call returned (compared
as meaning, not bytes: the content, each tool call's name and decoded arguments), then tool or
user turns only, under the same tools, the prompt is that call's prompt ids + its output ids (+
the end-of-sequence token if the reply was cut off) + the new turns rendered by
``render_turn_ids``. ``agent.proxy_records`` then merges the calls into one sample. Anything else
is rendered whole (``apply_chat_template``) and starts a new sample unless it happens to extend
one in tokens.

Boundaries: the tokenizer and messages in, ids out; no engine, no HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_megatron.agent.calls import decode_json
from rlhf_megatron.agent.loop import render_turn_ids

__all__ = ["PromptRenderer", "ServedCall", "canonical_message"]

CONTINUED, RENDERED = "continued", "rendered"


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return content or ""


def canonical_message(message: Mapping[str, Any]) -> str:
    """A message as what it means to the template: role, text, tool calls by name and decoded
    arguments, the tool call it answers. Ids, nulls and key order do not count."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _text(message.get("content"))}
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            decoded, problem = decode_json(arguments)
            arguments = arguments if problem else decoded
        calls.append({"name": fn.get("name"), "arguments": arguments})
    if calls:
        out["tool_calls"] = calls
    return json.dumps(out, sort_keys=True, ensure_ascii=False)


def _tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class ServedCall:
    """What a served call leaves for the next: its messages, the reply it returned, its tools and
    its tokens."""

    messages: tuple[str, ...]
    """``canonical_message`` of each message it was sent."""
    reply: str
    """``canonical_message`` of the assistant message it returned."""
    tools: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]

    @classmethod
    def of(cls, messages, tools, reply: Mapping[str, Any], prompt_ids, output_ids) -> ServedCall:
        return cls(
            messages=tuple(canonical_message(m) for m in messages),
            reply=canonical_message(reply),
            tools=_tools_key(tools),
            prompt_ids=tuple(prompt_ids),
            output_ids=tuple(output_ids),
        )


class PromptRenderer:
    """Renders requests of one episode (``served``: its earlier calls, oldest first)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        served: Sequence[ServedCall] = (),
    ) -> tuple[list[int], str]:
        """``(prompt ids, "continued" or "rendered")``."""
        call = self._continued_call(messages, tools, served)
        if call is not None:
            rest = [dict(m) for m in messages[len(call.messages) + 1 :]]
            eos = self.tokenizer.eos_token_id
            cut = [eos] if eos is not None and (not call.output_ids or call.output_ids[-1] != eos) else []
            return [
                *call.prompt_ids,
                *call.output_ids,
                *cut,
                *render_turn_ids(self.tokenizer, rest),
            ], CONTINUED
        ids = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=list(tools) if tools else None,
            tokenize=True,
            add_generation_prompt=True,
        )
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
        return list(ids), RENDERED

    @staticmethod
    def _continued_call(messages, tools, served: Sequence[ServedCall]) -> ServedCall | None:
        """The latest-reaching earlier call the request continues, or None."""
        canon = [canonical_message(m) for m in messages]
        key = _tools_key(tools)
        best = None
        for call in served:
            n = len(call.messages)
            if (
                call.tools == key
                and len(canon) > n + 1
                and tuple(canon[:n]) == call.messages
                and canon[n] == call.reply
                and all(m.get("role") in ("tool", "user") for m in messages[n + 1 :])
                and (best is None or n >= len(best.messages))
            ):
                best = call
        return best
