"""Preference pairs for reward-model training: one prompt, a chosen and a rejected response, as ids.

A reward model is trained on pairs (Bradley-Terry, ``algorithms.reward_loss``): it scores the
whole prompt + response sequence at its last token, and the chosen sequence should score higher.
``tokenize_pair`` reads a row in either column layout TRL and OpenRLHF preference data use:

* standard: ``prompt``, ``chosen``, ``rejected`` are strings. With a chat template the prompt is
  a user message and each response an assistant message, rendered by the tokenizer's template
  (so a pair looks exactly like an RL rollout: the templated prompt, the response, its
  end-of-turn). Without one, each sequence is the plain text ``prompt + response`` encoded
  without special tokens, then eos (OpenRLHF's convention), so the scored last token marks the
  end of the response whatever it says.
* conversational (TRL): ``chosen`` and ``rejected`` are lists of chat messages ending with the
  assistant's reply; an optional ``prompt`` list of messages is prepended to both.

``max_length`` caps each sequence. ``truncation="error"`` refuses a longer pair; ``"left"``
keeps the last tokens (the score is read at the last token, so it survives; the prompt's start
goes). ``"right"`` is refused for pairs: it would cut the scored token.

Boundaries: pure functions of a tokenizer and Python values; reading files, batching and the
loss are the reward-model stage's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PREFERENCE_TRUNCATION_MODES", "PreferenceDataError", "PreferencePair", "tokenize_pair"]

PREFERENCE_TRUNCATION_MODES: tuple[str, ...] = ("error", "left")


class PreferenceDataError(ValueError):
    """A preference row that cannot be trained on; the message names the row, the column and what
    to change."""


@dataclass(frozen=True)
class PreferencePair:
    """One pair's tokens, prompt included. chosen_ids: [Tc], rejected_ids: [Tr]; the reward
    model's score is read at each sequence's last token."""

    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]


def tokenize_pair(
    tokenizer,
    row: Mapping[str, Any],
    source: str,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    max_length: int | None = None,
    truncation: str = "error",
) -> PreferencePair:
    """``row`` (standard or conversational layout, see the module docstring) as a
    ``PreferencePair``. ``source`` names the row in errors, e.g. ``"prefs.parquet row 12"``."""
    _check_truncation(max_length, truncation, source)
    keys = {"prompt": prompt_key, "chosen": chosen_key, "rejected": rejected_key}
    for name in ("chosen", "rejected"):
        if keys[name] not in row:
            raise PreferenceDataError(
                f"{source}: no column {keys[name]!r} (the {name} response); the row has "
                f"{sorted(row)}. Rename the column or set the {name} key to one of these"
            )
    chosen, rejected = row[chosen_key], row[rejected_key]
    prompt = row.get(prompt_key)
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt_key not in row:
            raise PreferenceDataError(
                f"{source}: no column {prompt_key!r} (the prompt); string responses need a prompt "
                f"column, the row has {sorted(row)}. Set the prompt key, or give chosen and rejected "
                "as lists of chat messages that include the prompt"
            )
        _check_text(prompt, prompt_key, source)
        seqs = [
            _encode_text(tokenizer, prompt, _check_text(r, k, source), k, source)
            for r, k in ((chosen, chosen_key), (rejected, rejected_key))
        ]
    elif _is_messages(chosen) and _is_messages(rejected):
        head = _prompt_messages(prompt, prompt_key, source)
        seqs = [
            _encode_messages(tokenizer, head + _check_messages(r, k, source), k, source)
            for r, k in ((chosen, chosen_key), (rejected, rejected_key))
        ]
    else:
        for value, key in ((chosen, chosen_key), (rejected, rejected_key)):
            if not isinstance(value, str) and not _is_messages(value):
                raise PreferenceDataError(
                    f"{source}: column {key!r} is {_describe(value)}; expected a non-empty string or "
                    "a list of chat messages ({role, content})"
                )
        raise PreferenceDataError(
            f"{source}: column {chosen_key!r} is {_describe(chosen)} but {rejected_key!r} is "
            f"{_describe(rejected)}; both must be strings or both lists of chat messages"
        )
    return _fit_pair(seqs, (chosen_key, rejected_key), max_length, truncation, source)


def _fit_pair(
    seqs: list[list[int]], keys: tuple[str, str], max_length: int | None, truncation: str, source: str
) -> PreferencePair:
    """Apply ``max_length`` / ``truncation`` to both sequences; refuse a pair left without a difference."""
    chosen_key, rejected_key = keys
    truncated = False
    for i, key in enumerate(keys):
        if max_length is not None and len(seqs[i]) > max_length:
            if truncation == "error":
                raise PreferenceDataError(
                    f"{source}: column {key!r} renders to {len(seqs[i])} tokens, more than "
                    f"max_length={max_length}; raise max_length, drop the row, or set truncation=left "
                    "(keeps the last tokens, where the score is read)"
                )
            seqs[i] = seqs[i][-max_length:]
            truncated = True
    if seqs[0] == seqs[1]:
        why = f" after left truncation to {max_length} tokens" if truncated else ""
        raise PreferenceDataError(
            f"{source}: columns {chosen_key!r} and {rejected_key!r} give the same {len(seqs[0])} tokens"
            f"{why}, so there is no preference to learn; drop the row"
            + (" or raise max_length" if truncated else "")
        )
    return PreferencePair(tuple(seqs[0]), tuple(seqs[1]))


def _check_truncation(max_length: int | None, truncation: str, source: str) -> None:
    if truncation == "right":
        raise PreferenceDataError(
            f"{source}: truncation=right is refused for preference pairs: it keeps the first tokens and "
            "would cut the last one, where the reward model's score is read; use truncation=left or "
            "error, or raise max_length"
        )
    if truncation not in PREFERENCE_TRUNCATION_MODES:
        raise PreferenceDataError(
            f"{source}: truncation={truncation!r}; expected one of {list(PREFERENCE_TRUNCATION_MODES)}"
        )
    if max_length is not None and (
        isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
    ):
        raise PreferenceDataError(
            f"{source}: max_length must be a positive integer or None, got {max_length!r}"
        )


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return "an empty string" if not value else "a string"
    if isinstance(value, Sequence) and not value:
        return "an empty list"
    return f"{type(value).__name__} {value!r}"[:120]


def _is_messages(value: Any) -> bool:
    """A list of chat messages (parquet gives numpy arrays of dicts, so any non-string sequence)."""
    if isinstance(value, (str, bytes, Mapping)):
        return False
    try:
        return len(value) > 0 and all(isinstance(m, Mapping) for m in value)
    except TypeError:
        return False


def _check_text(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str) or not value:
        raise PreferenceDataError(
            f"{source}: column {key!r} is {_describe(value)}; expected a non-empty string"
        )
    return value


def _check_messages(value: Any, key: str, source: str) -> list[dict]:
    messages = [dict(m) for m in value]
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise PreferenceDataError(
                f"{source}: column {key!r}, message {i} has no 'role': {message!r}"[:300]
            )
    return messages


def _prompt_messages(prompt: Any, key: str, source: str) -> list[dict]:
    """The optional conversational prompt: absent or None means the responses carry it."""
    if prompt is None:
        return []
    if isinstance(prompt, str):
        raise PreferenceDataError(
            f"{source}: column {key!r} is a string but the responses are lists of chat messages; give "
            "the prompt as a list of messages too (e.g. [{'role': 'user', 'content': ...}])"
        )
    if not _is_messages(prompt):
        raise PreferenceDataError(
            f"{source}: column {key!r} is {_describe(prompt)}; expected a list of chat messages"
        )
    return _check_messages(prompt, key, source)


def _encode_text(tokenizer, prompt: str, response: str, key: str, source: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is not None:
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return _render(tokenizer, chat, key, source)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise PreferenceDataError(
            f"{source}: the tokenizer has neither a chat template nor an eos token, so the end of "
            f"column {key!r}'s response cannot be marked; set one of them"
        )
    ids = list(tokenizer.encode(prompt + response, add_special_tokens=False))
    return ids if ids and ids[-1] == eos else [*ids, eos]


def _encode_messages(tokenizer, messages: list[dict], key: str, source: str) -> list[int]:
    if messages[-1]["role"] != "assistant":
        raise PreferenceDataError(
            f"{source}: column {key!r} ends with a {messages[-1]['role']!r} message; the scored "
            "conversation must end with the assistant's reply"
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise PreferenceDataError(
            f"{source}: column {key!r} is a list of chat messages but the tokenizer has no chat "
            "template; set one, or give prompt / chosen / rejected as strings"
        )
    return _render(tokenizer, messages, key, source)


def _render(tokenizer, messages: list[dict], key: str, source: str) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    except Exception as e:  # jinja's TemplateError, a KeyError from a template reading a missing field
        raise PreferenceDataError(
            f"{source}: the tokenizer's chat template cannot render column {key!r}: {type(e).__name__}: {e}"
        ) from e
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
