"""The stages' rows: files -> tokenized samples -> the padded batches one optimizer step trains on.

``sft_samples`` reads ``data.train_files`` / ``val_files`` (parquet or jsonl, as the RL dataset
reads them: ``data.sources``) and tokenizes each row (``data.sft``: single-turn
``prompt_key``/``response_key`` or ``multiturn.messages_key``/``tools_key`` transcripts).
``sft_batch`` turns one step's samples into a ``Batch``: packed into rows of ``max_length``
(``data.packing``) or one sample a row, right-padded to the longest row, with ``loss_mask`` and,
packed, ``segment_ids``; the row count is padded to a multiple of the data-parallel size with
empty rows (no tokens, no loss).

``pair_samples`` / ``pair_batch`` do the same for preference pairs (``data.preference``): a pair's
two sides are consecutive rows (chosen, rejected), so a micro-batch of an even size holds whole pairs.

Boundaries: reading and batching; the loss is the worker's (``stages.worker``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from rlhf_megatron.config.schema_stages import RMDataConfig, SFTDataConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.sft import (
    SFTSample,
    pack_samples,
    single_turn_messages,
    tokenize_conversation,
    truncate,
)
from rlhf_megatron.data.sources import load_source

__all__ = ["epoch_order", "pair_batch", "pair_samples", "read_rows", "sft_batch", "sft_samples"]


def read_rows(files: Any, files_key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(``"<file> row <i>"``, row) for every row of every file of ``files`` (a path or a list)."""
    for spec in [files] if isinstance(files, str) else list(files):
        for source in load_source(spec, files_key):
            for i, row in enumerate(source.table.to_pylist()):
                yield f"{files_key}: {source.name} row {i}", row


def _json_list(value: Any) -> Any:
    """A messages or tools column written as JSON text (some writers store nested lists as
    strings) parsed; anything else, text that is not JSON included, as it is."""
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def sft_samples(data: SFTDataConfig, tokenizer, files: Any, files_key: str) -> list[SFTSample]:
    """Every row of ``files`` tokenized per ``data`` (see the module docstring)."""
    from rlhf_megatron.data.sft import SFTDataError

    out = []
    for source, row in read_rows(files, files_key):
        if data.multiturn.enable:
            key = data.multiturn.messages_key
            if key not in row:
                raise SFTDataError(
                    f"{source}: no column {key!r} (data.multiturn.messages_key); it has {sorted(row)}"
                )
            tools = _json_list(row.get(data.multiturn.tools_key))
            sample = tokenize_conversation(tokenizer, _json_list(row[key]), tools, source)
        else:
            for key, name in ((data.prompt_key, "prompt_key"), (data.response_key, "response_key")):
                if key not in row:
                    raise SFTDataError(f"{source}: no column {key!r} (data.{name}); it has {sorted(row)}")
            messages = single_turn_messages(row[data.prompt_key], row[data.response_key], source)
            sample = tokenize_conversation(tokenizer, messages, None, source)
        out.append(truncate(sample, data.max_length, str(data.truncation), source))
    if not out:
        raise SFTDataError(f"{files_key}={files}: no rows")
    return out


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The rows' order in ``epoch``: a permutation seeded by (seed, epoch), or the file order."""
    if not shuffle:
        return list(range(n))
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


def _pad_rows(rows: list[dict[str, list[int]]], multiple: int, width_multiple: int) -> Batch:
    """Right-pad ``rows`` (lists per key) into tensors; add filler rows up to a multiple of
    ``multiple``: one token each, attended (a row with no key to attend to gives fused attention
    NaNs) and never trained (``loss_mask`` 0)."""
    filler = {
        "input_ids": [0],
        "attention_mask": [1],
        "position_ids": [0],
        "loss_mask": [0],
        "segment_ids": [1],
    }
    while len(rows) % multiple:
        rows.append({k: filler[k] for k in rows[0]})
    width = max(len(r["input_ids"]) for r in rows)
    width = -(-width // width_multiple) * width_multiple
    out = {}
    for key in rows[0]:
        t = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            t[i, : len(r[key])] = torch.tensor(r[key], dtype=torch.long)
        out[key] = t
    return Batch.from_dict(out)


def sft_batch(samples: Sequence[SFTSample], data: SFTDataConfig, dp: int, width_multiple: int = 1) -> Batch:
    """One step's samples as a right-padded batch: ``input_ids``, ``attention_mask``,
    ``position_ids``, ``loss_mask`` [rows, width] (and ``segment_ids`` when packed); ``dp`` and
    ``width_multiple`` (sequence parallelism's TP) round the rows and the width up."""
    if data.packing:
        rows = [
            {
                "input_ids": list(r.input_ids),
                "attention_mask": [1] * len(r.input_ids),
                "position_ids": list(r.position_ids),
                "loss_mask": list(r.loss_mask),
                "segment_ids": list(r.segment_ids),
            }
            for r in pack_samples(samples, data.max_length)
        ]
    else:
        rows = [
            {
                "input_ids": list(s.input_ids),
                "attention_mask": [1] * len(s),
                "position_ids": list(range(len(s))),
                "loss_mask": list(s.loss_mask),
            }
            for s in samples
        ]
    return _pad_rows(rows, dp, width_multiple)


def pair_samples(data: RMDataConfig, tokenizer, files: Any, files_key: str) -> list:
    """Every preference pair of ``files`` tokenized (``data.preference.tokenize_pair``)."""
    from rlhf_megatron.data.preference import PreferenceDataError, tokenize_pair

    out = []
    for source, row in read_rows(files, files_key):
        out.append(
            tokenize_pair(
                tokenizer,
                row,
                source,
                prompt_key=data.prompt_key,
                chosen_key=data.chosen_key,
                rejected_key=data.rejected_key,
                max_length=data.max_length,
                truncation=str(data.truncation),
            )
        )
    if not out:
        raise PreferenceDataError(f"{files_key}={files}: no rows")
    return out


def pair_batch(pairs: Sequence, dp: int, width_multiple: int = 1) -> Batch:
    """Pairs as consecutive rows (chosen, rejected), right-padded; ``dp`` data-parallel ranks each
    get whole pairs (empty pairs pad the count: they carry ``pair_mask`` 0)."""
    rows, valid = [], []
    for pair in pairs:
        for ids in (pair.chosen_ids, pair.rejected_ids):
            rows.append(
                {
                    "input_ids": list(ids),
                    "attention_mask": [1] * len(ids),
                    "position_ids": list(range(len(ids))),
                }
            )
        valid += [1, 1]
    while (len(rows) // 2) % dp:
        for _ in range(2):  # one token each, so every row has a last token to read
            rows.append({"input_ids": [0], "attention_mask": [1], "position_ids": [0]})
        valid += [0, 0]
    batch = _pad_rows(rows, 1, width_multiple)
    batch["pair_mask"] = torch.tensor(valid, dtype=torch.float32)
    return batch
