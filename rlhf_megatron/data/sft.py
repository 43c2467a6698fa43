"""Supervised fine-tuning rows: chat transcripts to token ids with a loss mask, and their packing.

The first stage before RL (SFT; a cold start on tool-call transcripts for agentic RL) trains on
what the assistant says and nothing else. ``tokenize_conversation`` renders a row's ``messages``
(and the row's ``tools``, as the chat template presents them) with the tokenizer's own chat
template, one message more at a time, so every token is attributed to the message that produced
it: the loss mask is 1 on an assistant message's tokens (its text, its tool calls and its
end-of-turn) and 0 on system, user and tool turns and on the template's assistant header (what
the rollout's generation prompt adds; the model never generates it). A single-turn row
(``prompt_key`` / ``response_key``, verl's SFT dataset) is the conversation user → assistant.

``truncate`` applies verl's ``data.truncation`` to a sample over ``max_length``; ``pack_samples``
puts whole samples into rows of at most ``max_length`` tokens (first fit, longest first), each
sample a segment of its own: ``segment_ids`` keep attention inside a segment and positions
restart at each one (``data.packing``'s convention), so a packed row computes what its samples
would alone.

Boundaries: pure functions of a tokenizer and Python values; reading files and batching are
the SFT stage's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PackedRow", "SFTDataError", "SFTSample", "pack_samples", "tokenize_conversation", "truncate"]


class SFTDataError(ValueError):
    """A row that cannot be trained on; the message names the row and what to change."""


@dataclass(frozen=True)
class SFTSample:
    """One transcript's tokens. input_ids, loss_mask: [T] (1 where the loss trains)."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class PackedRow:
    """Samples side by side in one row. input_ids, loss_mask, position_ids: [L]; segment_ids: [L],
    1, 2, ... per sample (0 on padding, which ``pad_to`` adds)."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    position_ids: tuple[int, ...]
    segment_ids: tuple[int, ...]


def _render(tokenizer, messages: Sequence[Mapping], tools, generation_prompt: bool, source: str) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(
            list(messages), tools=tools or None, add_generation_prompt=generation_prompt, tokenize=True
        )
    except Exception as e:  # jinja's TemplateError, a KeyError from a template reading a missing field
        raise SFTDataError(
            f"{source}: the tokenizer's chat template cannot render it: {type(e).__name__}: {e}"
        ) from e
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def tokenize_conversation(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping] | None = None,
    source: str = "row",
) -> SFTSample:
    """``messages`` (OpenAI chat format: role, content, an assistant's ``tool_calls``) as token ids
    with the loss on the assistant's tokens only (see the module docstring). ``source`` names the
    row in errors."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise SFTDataError(
            f"{source}: the tokenizer has no chat template, and every row (single-turn prompt/response "
            "too) is rendered with it; set tokenizer.chat_template in the model's tokenizer_config.json"
        )
    if not messages or not any(m.get("role") == "assistant" for m in messages):
        raise SFTDataError(f"{source}: no assistant message, so nothing to train on")
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise SFTDataError(
                f"{source}: message {i} has role {role!r}; expected system, user, assistant or tool"
            )
        start = len(ids)
        if role == "assistant":  # the template's header for this turn is the prompt, not the answer
            header = _render(tokenizer, messages[:i], tools, True, source) if i else []
            _check_prefix(ids, header, source, i)
            mask.extend([0] * (len(header) - start))
            ids = header
            start = len(ids)
        full = _render(tokenizer, messages[: i + 1], tools, False, source)
        _check_prefix(ids, full, source, i)
        mask.extend([1 if role == "assistant" else 0] * (len(full) - start))
        ids = full
    return SFTSample(tuple(ids), tuple(mask))


def _check_prefix(before: list[int], after: list[int], source: str, i: int) -> None:
    if after[: len(before)] != before:
        raise SFTDataError(
            f"{source}: rendering message {i} changed the tokens of the messages before it (the chat "
            "template is not prefix-stable, e.g. it drops earlier turns' reasoning); per-message loss "
            "masks need a template that renders earlier turns the same whatever follows"
        )


def single_turn_messages(prompt: Any, response: Any, source: str) -> list[dict[str, str]]:
    """verl's single-turn SFT row (``prompt_key`` / ``response_key``) as a user → assistant chat."""
    for name, value in (("prompt", prompt), ("response", response)):
        if not isinstance(value, str) or not value:
            raise SFTDataError(f"{source}: the {name} must be a non-empty string, got {value!r}")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def truncate(sample: SFTSample, max_length: int, mode: str, source: str) -> SFTSample:
    """verl's ``data.truncation``: ``error`` refuses a sample over ``max_length`` tokens; ``left``
    keeps its last tokens, ``right`` its first."""
    if len(sample) <= max_length:
        return sample
    if mode == "error":
        raise SFTDataError(
            f"{source}: {len(sample)} tokens, more than data.max_length={max_length}; raise max_length, "
            "or set data.truncation=left or right"
        )
    cut = slice(len(sample) - max_length, None) if mode == "left" else slice(0, max_length)
    out = SFTSample(sample.input_ids[cut], sample.loss_mask[cut])
    if not any(out.loss_mask):
        raise SFTDataError(f"{source}: truncated to {max_length} tokens ({mode}), no assistant token is left")
    return out


def pack_samples(samples: Sequence[SFTSample], max_length: int) -> list[PackedRow]:
    """Whole samples into rows of at most ``max_length`` tokens, first fit over the samples sorted
    longest first (deterministic: ties keep their order); see the module docstring."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(samples[i])
        if n > max_length:
            raise SFTDataError(
                f"sample {i}: {n} tokens do not fit a packed row of {max_length}; truncate first"
            )
        slot = next((r for r, free in enumerate(room) if free >= n), None)
        if slot is None:
            rows.append([])
            room.append(max_length)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= n
    out = []
    for members in rows:
        ids, mask, pos, seg = [], [], [], []
        for k, i in enumerate(members, start=1):
            s = samples[i]
            ids += s.input_ids
            mask += s.loss_mask
            pos += range(len(s))
            seg += [k] * len(s)
        out.append(PackedRow(tuple(ids), tuple(mask), tuple(pos), tuple(seg)))
    return out
