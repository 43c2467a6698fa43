"""`RLHFDataset`: prompts from verl-format parquet files, tokenized with the model's chat template.

Input format (what verl's preprocessing scripts and `tools/data/` write), one row per prompt:

* ``prompt`` (``data.prompt_key``): a list of chat messages ``{"role": str, "content": str}``.
* ``data_source`` (``data.reward_fn_key``): the name the reward function dispatches on.
* ``reward_model``: a dict with ``ground_truth`` (``style`` is usually ``"rule"``).
* ``extra_info`` (optional): a dict; ``extra_info["index"]`` becomes the prompt's uid.
* any other column (``ability``...) is passed through unchanged.

``dataset[i]`` returns ``input_ids``/``attention_mask``/``position_ids`` (int64, ``[P]``, left
padded to ``data.max_prompt_length``), ``raw_prompt_ids`` (unpadded ids, what vLLM receives),
the non-prompt columns, ``index`` and optionally ``raw_prompt`` (the messages). `collate_fn`
stacks items into a `Batch`.

Memory: the Arrow tables are kept as read (one per file) and rows are converted to Python
and tokenized only in ``__getitem__``. Filtering overlong prompts tokenizes once in streaming
record batches and keeps only an int32 length per row, so loading N rows costs about the
Arrow size of the files plus a few bytes per row. Datasets larger than memory are out of scope.

Boundaries: reads files and tokenizes; knows nothing of Ray, Megatron or the trainer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rlhf_megatron.data.batch import Batch

logger = logging.getLogger(__name__)

__all__ = ["DatasetFormatError", "DatasetOptions", "RLHFDataset", "collate_fn", "left_pad", "truncate_ids"]

TRUNCATION_MODES = ("error", "left", "right", "middle")
_LENGTH_BATCH_ROWS = 1024  # rows tokenized at a time when computing lengths for filtering


class DatasetFormatError(ValueError):
    """A parquet file does not have the expected columns or a row is malformed."""


def _get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None and default is not None else value


@dataclass(frozen=True)
class DatasetOptions:
    """The ``data.*`` keys `RLHFDataset` reads (verl's names and defaults)."""

    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    max_prompt_length: int = 512
    """Prompts are left-padded to this many tokens."""
    truncation: str = "error"
    """What to do with a longer prompt: 'error', or keep the 'left'/'right' end or both ends ('middle')."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length at load time (tokenizes every row once)."""
    return_raw_chat: bool = False
    """Also return the messages as ``raw_prompt`` (for a reward model with another chat template)."""
    return_raw_input_ids: bool = False
    """Also return ``raw_input_ids``: the unpadded prompt ids (same as ``raw_prompt_ids``), for verl parity."""
    reward_fn_key: str = "data_source"
    """Column the reward function dispatches on; must exist in every file."""

    @classmethod
    def from_config(cls, config: Any) -> DatasetOptions:
        """Read from a dict, DictConfig or dataclass: either the ``data`` section or its parent."""
        if config is not None and _get(config, "max_prompt_length", None) is None:
            config = _get(config, "data", config)
        defaults = cls()
        values = {f: _get(config, f, getattr(defaults, f)) for f in cls.__dataclass_fields__}
        options = cls(**values)
        if options.truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"data.truncation must be one of {TRUNCATION_MODES}, got {options.truncation!r}."
            )
        if int(options.max_prompt_length) <= 0:
            raise ValueError(f"data.max_prompt_length must be positive, got {options.max_prompt_length}.")
        return options


def truncate_ids(ids: list[int], max_length: int, mode: str) -> list[int]:
    """Cut ``ids`` to ``max_length``: 'left' keeps the end, 'right' the start, 'middle' both ends."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise ValueError(f"truncate_ids: unknown mode {mode!r}; expected one of {TRUNCATION_MODES[1:]}.")


def left_pad(
    ids: list[int], length: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad to ``length``; returns (input_ids, attention_mask, position_ids), each ``[length]`` int64."""
    pad = length - len(ids)
    input_ids = torch.tensor([pad_token_id] * pad + list(ids), dtype=torch.long)
    attention_mask = torch.zeros(length, dtype=torch.long)
    attention_mask[pad:] = 1
    # Real tokens are numbered from 0; padding positions are clipped to 0.
    position_ids = (attention_mask.cumsum(0) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def _is_string_type(t: pa.DataType) -> bool:
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    return pa.types.is_string(t) or pa.types.is_large_string(t) or is_view(t)


def _check_prompt_type(path: str, key: str, t: pa.DataType) -> None:
    """Reject a prompt column that cannot hold chat messages, before reading any row."""
    ok = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    if ok:
        item = t.value_type
        ok = pa.types.is_struct(item) and all(
            item.get_field_index(name) >= 0 and _is_string_type(item.field(name).type)
            for name in ("role", "content")
        )
    if not ok:
        raise DatasetFormatError(
            f"{path}: column '{key}' has Arrow type {t}; expected a list of chat messages "
            "{role: string, content: string} (verl format). Convert plain-text prompts to "
            "[{'role': 'user', 'content': text}] or point data.prompt_key at the messages column."
        )


def _check_messages(path: str, row: int, key: str, messages: Any) -> list[dict]:
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


class RLHFDataset(torch.utils.data.Dataset):
    """Prompts from one or more verl-format parquet files; see the module docstring."""

    def __init__(
        self,
        parquet_files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        config: Any = None,
    ):
        if isinstance(parquet_files, (str, os.PathLike)):
            parquet_files = [parquet_files]
        self.files = [os.fspath(f) for f in parquet_files]
        if not self.files:
            raise ValueError(
                "RLHFDataset: no parquet files given (data.train_files / data.val_files is empty)."
            )
        self.tokenizer = tokenizer
        self.options = DatasetOptions.from_config(config)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"RLHFDataset: tokenizer {type(tokenizer).__name__} has no chat template "
                "(tokenizer.chat_template is None), and every prompt is a list of chat messages that "
                "must be rendered with one. Set tokenizer.chat_template to a Jinja template "
                "(e.g. the one from the model's instruct/chat variant) or load a tokenizer that has one."
            )
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        if self.pad_token_id is None:
            raise ValueError(
                "RLHFDataset: the tokenizer has neither a pad token nor an eos token to pad with."
            )

        self._tables: list[pa.Table] = [self._read(path) for path in self.files]
        # Parquet decoding leaves freed buffers in Arrow's allocator (mimalloc/jemalloc keep
        # them); hand them back so a large dataset costs about its Arrow size, not twice that.
        release = getattr(pa.default_memory_pool(), "release_unused", None)
        if release is not None:
            release()
        self._offsets = np.cumsum([0] + [t.num_rows for t in self._tables]).astype(np.int64)
        # Global row numbers of the rows kept; None while every row is kept (saves 8 bytes/row).
        self._rows: np.ndarray | None = None
        self.prompt_lengths: np.ndarray | None = None
        if self.options.filter_overlong_prompts:
            self._filter_overlong()

    # ------------------------------------------------------------------ loading
    def _read(self, path: str) -> pa.Table:
        if not os.path.exists(path):
            raise FileNotFoundError(f"RLHFDataset: parquet file {path} does not exist.")
        table = pq.read_table(path)
        if table.num_rows == 0:
            raise ValueError(f"RLHFDataset: parquet file {path} has no rows.")
        opts = self.options
        for key in (opts.prompt_key, opts.reward_fn_key, "reward_model"):
            if key not in table.column_names:
                raise DatasetFormatError(
                    f"{path}: missing column '{key}' (in every row); the file has columns {table.column_names}. "
                    "Expected verl's format: data_source, prompt, reward_model, extra_info "
                    "(data.prompt_key and data.reward_fn_key rename the first two)."
                )
        _check_prompt_type(path, opts.prompt_key, table.schema.field(opts.prompt_key).type)
        return table

    def _locate(self, global_row: int) -> tuple[int, int]:
        file_idx = int(np.searchsorted(self._offsets, global_row, side="right")) - 1
        return file_idx, int(global_row - self._offsets[file_idx])

    def _render(self, messages: list[list[dict]] | list[dict]) -> Any:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _filter_overlong(self) -> None:
        """Tokenize every prompt once, in record batches, keeping only an int32 length per row."""
        total = int(self._offsets[-1])
        lengths = np.empty(total, dtype=np.int32)
        key = self.options.prompt_key
        for file_idx, table in enumerate(self._tables):
            start = int(self._offsets[file_idx])
            for record_batch in table.select([key]).to_batches(max_chunksize=_LENGTH_BATCH_ROWS):
                prompts = record_batch.column(0).to_pylist()
                chats = [
                    _check_messages(self.files[file_idx], start + i, key, m) for i, m in enumerate(prompts)
                ]
                texts = self._render(chats)
                encoded = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)[
                    "input_ids"
                ]
                lengths[start : start + len(encoded)] = [len(ids) for ids in encoded]
                start += len(encoded)
        keep = np.flatnonzero(lengths <= self.options.max_prompt_length)
        dropped = total - len(keep)
        logger.info(
            "RLHFDataset: filtered out %d of %d prompts longer than data.max_prompt_length=%d tokens (%s).",
            dropped,
            total,
            self.options.max_prompt_length,
            ", ".join(self.files),
        )
        if len(keep) == 0:
            raise ValueError(
                f"RLHFDataset: every prompt in {self.files} is longer than data.max_prompt_length="
                f"{self.options.max_prompt_length} tokens; raise it."
            )
        self.prompt_lengths = lengths[keep]
        self._rows = keep if dropped else None

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(self._offsets[-1]) if self._rows is None else len(self._rows)

    def _cell(self, file_idx: int, row: int, key: str) -> Any:
        return self._tables[file_idx].column(key)[row].as_py()

    def __getitem__(self, item: int) -> dict[str, Any]:
        if not -len(self) <= item < len(self):
            raise IndexError(f"RLHFDataset index {item} is out of range for {len(self)} rows.")
        item %= len(self)
        global_row = item if self._rows is None else int(self._rows[item])
        file_idx, row = self._locate(global_row)
        path, opts = self.files[file_idx], self.options
        table = self._tables[file_idx]

        messages = _check_messages(path, row, opts.prompt_key, self._cell(file_idx, row, opts.prompt_key))
        reward_model = self._cell(file_idx, row, "reward_model")
        # Arrow gives a row without ground_truth a null one when other rows have it.
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise DatasetFormatError(
                f"{path} row {row}: 'reward_model' must be a dict with a non-null 'ground_truth', got {reward_model!r:.200}."
            )
        extra_info = self._cell(file_idx, row, "extra_info") if "extra_info" in table.column_names else None
        if extra_info is not None and not isinstance(extra_info, dict):
            raise DatasetFormatError(
                f"{path} row {row}: 'extra_info' must be a dict, got {extra_info!r:.200}."
            )
        extra_info = extra_info or {}

        ids = self.tokenizer.encode(self._render(messages), add_special_tokens=False)
        if len(ids) > opts.max_prompt_length:
            if opts.truncation == "error":
                raise ValueError(
                    f"{path} row {row}: prompt is {len(ids)} tokens, longer than data.max_prompt_length="
                    f"{opts.max_prompt_length}. Raise data.max_prompt_length, set data.truncation to "
                    "left/right/middle, or set data.filter_overlong_prompts=True."
                )
            ids = truncate_ids(ids, opts.max_prompt_length, opts.truncation)
        input_ids, attention_mask, position_ids = left_pad(ids, opts.max_prompt_length, self.pad_token_id)

        # Other columns (data_source, ability...) pass through; the fields set below win over a
        # column of the same name.
        out: dict[str, Any] = {
            key: self._cell(file_idx, row, key)
            for key in table.column_names
            if key not in (opts.prompt_key, "reward_model", "extra_info")
        }
        out["input_ids"], out["attention_mask"], out["position_ids"] = input_ids, attention_mask, position_ids
        out["raw_prompt_ids"] = list(ids)
        out["reward_model"] = reward_model
        out["extra_info"] = extra_info
        out["index"] = extra_info.get("index", global_row)
        if opts.return_raw_chat:
            out["raw_prompt"] = messages
        if opts.return_raw_input_ids:
            out["raw_input_ids"] = list(ids)
        return out


def collate_fn(items: Sequence[Mapping[str, Any]]) -> Batch:
    """Stack dataset items into a `Batch`: tensors are stacked, everything else becomes a column."""
    if not items:
        raise ValueError("collate_fn: got an empty list of items.")
    keys = list(items[0].keys())
    for i, item in enumerate(items[1:], start=1):
        if list(item.keys()) != keys:
            raise ValueError(f"collate_fn: item {i} has keys {sorted(item)}, item 0 has {sorted(keys)}.")
    tensors, non_tensors = {}, {}
    for key in keys:
        values = [item[key] for item in items]
        if isinstance(values[0], torch.Tensor):
            tensors[key] = torch.stack(values)
        else:
            non_tensors[key] = values
    return Batch.from_dict(tensors, non_tensors)
