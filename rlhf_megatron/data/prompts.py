"""A row's prompt cell -> chat messages, for both dataset layouts.

* verl's layout: the cell (``data.prompt_key``, default ``prompt``) already is a list of
  ``{role, content}`` messages; `check_messages` validates it.
* EasyR1's layout: the cell (EasyR1 uses ``problem``) is plain text. As EasyR1 does, the text
  is first rendered through ``data.format_prompt`` (a Jinja template file, given the text as
  ``content``) and becomes one user message; ``data.system_prompt``, when set, is a system
  message before it (EasyR1's ``data.system_prompt`` of the Qwen2.5-VL geometry3k recipe).

In both layouts, a row with images has each message's text split at ``<image>`` into content
parts, ``[{"type": "text", "text": ...}, {"type": "image"}, ...]`` (empty text parts
dropped), which is how EasyR1 and verl hand images to the processor's chat template: the
template writes ``<|vision_start|><|image_pad|><|vision_end|>`` where each image part was.
A row with videos has ``<video>`` split the same way into ``{"type": "video"}`` parts.
A row without images keeps string contents, so text-only data renders exactly as before.

Boundaries: pure functions of Python values and the template file; no tokenizer.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from rlhf_megatron.data.multimodal import IMAGE_PLACEHOLDER
from rlhf_megatron.data.video import VIDEO_PLACEHOLDER

__all__ = [
    "DatasetFormatError",
    "FormatPrompt",
    "check_messages",
    "count_placeholders",
    "easyr1_messages",
    "load_format_prompt",
    "split_image_placeholders",
    "verl_messages",
    "with_image_parts",
]


class DatasetFormatError(ValueError):
    """A data file does not have the expected columns or a row is malformed."""


def check_messages(path: str, row: int, key: str, messages: Any) -> list[dict]:
    """A verl prompt cell as plain ``{role, content}`` dicts, or an error naming file, row and key."""
    if not isinstance(messages, list) or not messages:
        raise DatasetFormatError(
            f"{path} row {row}: '{key}' must be a non-empty list of {{role, content}} messages, got {messages!r:.200}."
        )
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DatasetFormatError(
                f"{path} row {row}: '{key}'[{i}] must be a dict with string 'role' and 'content', got {message!r:.200}."
            )
    # Arrow structs may carry extra (null) fields from other rows; the template wants role/content.
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@dataclass(frozen=True)
class FormatPrompt:
    """``data.format_prompt``: a Jinja template rendered with ``content=<prompt text>``."""

    path: str
    template: Any

    def render(self, text: str, where: str, key: str) -> str:
        try:
            return self.template.render(content=text)
        except Exception as err:
            raise DatasetFormatError(
                f"{where}: rendering data.format_prompt ({self.path}) with the '{key}' text as content failed: "
                f"{type(err).__name__}: {err}. Fix the template; it receives the prompt text as `content`."
            ) from err


def load_format_prompt(path: str | None) -> FormatPrompt | None:
    """Read and compile ``data.format_prompt`` (its text stripped, as EasyR1 does), or None when unset."""
    if not path:
        return None
    import jinja2

    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"data.format_prompt: template file {path} does not exist. Set it to a Jinja file that renders "
            "the prompt from {{ content }} (EasyR1's examples/format_prompt/math.jinja, say), or to null."
        )
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return FormatPrompt(path, jinja2.Template(text.strip()))
    except jinja2.TemplateError as err:
        line = getattr(err, "lineno", None)
        raise ValueError(
            f"data.format_prompt: {path}{f' line {line}' if line else ''} is not a valid Jinja template: {err}"
        ) from err


def split_image_placeholders(text: str, videos: bool = False) -> list[dict]:
    """``"<image>Find x."`` -> ``[{"type": "image"}, {"type": "text", "text": "Find x."}]`` (EasyR1's split).
    With ``videos``, ``<video>`` becomes a ``{"type": "video"}`` part the same way."""
    marks = {IMAGE_PLACEHOLDER: "image", **({VIDEO_PLACEHOLDER: "video"} if videos else {})}
    pattern = "(" + "|".join(re.escape(m) for m in marks) + ")"
    parts: list[dict] = []
    for piece in re.split(pattern, text):
        if piece in marks:
            parts.append({"type": marks[piece]})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def count_placeholders(messages: list[dict], placeholder: str = IMAGE_PLACEHOLDER) -> int:
    """``<image>`` (or ``placeholder``) occurrences over the (string) contents of ``messages``."""
    return sum(m["content"].count(placeholder) for m in messages)


def easyr1_messages(
    path: str,
    row: int,
    key: str,
    text: Any,
    *,
    template: FormatPrompt | None,
    system_prompt: str | None,
) -> list[dict]:
    """EasyR1's messages for a plain-text prompt: [system], user (contents are strings)."""
    if not isinstance(text, str):
        raise DatasetFormatError(
            f"{path} row {row}: '{key}' must be a string (the prompt text), got {text!r:.200}."
        )
    if template is not None:
        text = template.render(text, f"{path} row {row}", key)
    messages = [{"role": "user", "content": text}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def verl_messages(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """verl's messages, with ``data.system_prompt`` first when the row has no system message of its own."""
    if system_prompt and not any(m["role"] == "system" for m in messages):
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def with_image_parts(messages: list[dict], videos: bool = False) -> list[dict]:
    """Every content split at ``<image>`` (and, with ``videos``, ``<video>``) into typed parts (for
    a row that has images or videos)."""
    return [{"role": m["role"], "content": split_image_placeholders(m["content"], videos)} for m in messages]
