"""The stages' rows: files -> tokenized samples -> the padded batches one optimizer step trains on.

``sft_samples`` reads ``data.train_files`` / ``val_files`` (parquet or jsonl, as the RL dataset
reads them: ``data.sources``) and tokenizes each row (``data.sft``: single-turn
``prompt_key``/``response_key`` or ``multiturn.messages_key``/``tools_key`` transcripts).
``sft_batch`` turns one step's samples into a ``Batch``: packed into rows of ``max_length``
(``data.packing``) or one sample a row, right-padded to the longest row, with ``loss_mask`` and,
packed, ``segment_ids``; the row count is padded to a multiple of the data-parallel size with
empty rows (no tokens, no loss).

A vision-language model (``vision``, the model's processor) reads each row's images
(``data.image_key``) with its messages (``data.sft.tokenize_with_images``), and its batches are
the RL actor's: ``position_ids`` ``[rows, 3, width]`` (M-RoPE, each packed sample's restarting at
its first token) and a per-row ``multi_modal_inputs`` column (``pixel_values``,
``image_grid_thw`` of the row's samples in order; None for a row without images), which
``split_micro_batches`` keeps with its row. A text-only model refuses a row with images.
A row holding videos (a ``videos`` column) is refused: the stages do not train on them yet.

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
from rlhf_megatron.data.multimodal import VisionProcessor, concat_vision_inputs, image_list
from rlhf_megatron.data.rope_index import get_rope_index
from rlhf_megatron.data.sft import (
    SFTDataError,
    SFTImages,
    SFTSample,
    pack_samples,
    single_turn_messages,
    tokenize_conversation,
    tokenize_with_images,
    truncate,
)
from rlhf_megatron.data.sources import SourceTable, load_source
from rlhf_megatron.data.video import video_list

__all__ = ["epoch_order", "pair_batch", "pair_samples", "read_rows", "sft_batch", "sft_samples"]


STAGE_VIDEO_COLUMN = "videos"
"""verl's and EasyR1's videos column: a stage row holding videos there is refused (no video SFT or
reward-model training yet)."""


def read_rows(files: Any, files_key: str) -> Iterator[tuple[str, dict[str, Any], SourceTable]]:
    """(``"<file> row <i>"``, row, its file) for every row of every file of ``files`` (a path or a list)."""
    for spec in [files] if isinstance(files, str) else list(files):
        for source in load_source(spec, files_key):
            for i, row in enumerate(source.table.to_pylist()):
                where = f"{files_key}: {source.name} row {i}"
                if video_list(row.get(STAGE_VIDEO_COLUMN)):
                    # RL trains on videos (data.video_key); the stages do not yet: refused, not dropped.
                    raise SFTDataError(
                        f"{where}: column {STAGE_VIDEO_COLUMN!r} holds videos, which the SFT and reward-model "
                        "stages do not train on yet (RL does, through data.video_key); drop or rename the column"
                    )
                yield where, row, source


def _json_list(value: Any) -> Any:
    """A messages or tools column written as JSON text (some writers store nested lists as
    strings) parsed; anything else, text that is not JSON included, as it is."""
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def sft_samples(
    data: SFTDataConfig, tokenizer, files: Any, files_key: str, vision: VisionProcessor | None = None
) -> list[SFTSample]:
    """Every row of ``files`` tokenized per ``data`` (see the module docstring); ``vision``: the
    model's processor (``multimodal.load_vision_processor``), None for a text-only model."""
    out = []
    for source, row, table in read_rows(files, files_key):
        if data.multiturn.enable:
            key = data.multiturn.messages_key
            if key not in row:
                raise SFTDataError(
                    f"{source}: no column {key!r} (data.multiturn.messages_key); it has {sorted(row)}"
                )
            messages, tools = _json_list(row[key]), _json_list(row.get(data.multiturn.tools_key))
        else:
            for key, name in ((data.prompt_key, "prompt_key"), (data.response_key, "response_key")):
                if key not in row:
                    raise SFTDataError(f"{source}: no column {key!r} (data.{name}); it has {sorted(row)}")
            messages = single_turn_messages(row[data.prompt_key], row[data.response_key], source)
            tools = None
        images = image_list(row.get(data.image_key))
        if vision is not None:
            stored = SFTImages(
                tuple(images),
                f"{source}: {data.image_key!r}",
                table.base_dir,
                data.min_pixels,
                data.max_pixels,
            )
            sample = tokenize_with_images(tokenizer, vision, messages, stored, tools, source)
        elif images:
            raise SFTDataError(
                f"{source}: {data.image_key!r} (data.image_key) holds {len(images)} image(s), but the model is "
                "text-only (its config.json has no vision_config); train a vision-language model (Qwen2.5-VL) "
                "on it, or drop the images column"
            )
        else:
            sample = tokenize_conversation(tokenizer, messages, tools, source)
        out.append(truncate(sample, data.max_length, str(data.truncation), source))
    if not out:
        raise SFTDataError(f"{files_key}={files}: no rows")
    return out


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The rows' order in ``epoch``: a permutation seeded by (seed, epoch), or the file order."""
    if not shuffle:
        return list(range(n))
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


_FILLER = {"input_ids": 0, "attention_mask": 1, "position_ids": 0, "loss_mask": 0, "segment_ids": 1}
"""Each column's value in a filler row's one token."""


def _pad_rows(rows: list[dict[str, Any]], multiple: int, width_multiple: int) -> Batch:
    """Right-pad ``rows`` (per key a list, or a tensor ``[..., T]``: M-RoPE positions are
    ``[3, T]``) into tensors ``[rows, ..., width]``; add filler rows up to a multiple of
    ``multiple``: one token each, attended (a row with no key to attend to gives fused attention
    NaNs) and never trained (``loss_mask`` 0)."""
    rows = [{k: torch.as_tensor(v, dtype=torch.long) for k, v in r.items()} for r in rows]
    while len(rows) % multiple:
        rows.append({k: torch.full((*v.shape[:-1], 1), _FILLER[k]) for k, v in rows[0].items()})
    width = max(r["input_ids"].shape[-1] for r in rows)
    width = -(-width // width_multiple) * width_multiple
    out = {}
    for key, first in rows[0].items():
        t = torch.zeros(len(rows), *first.shape[:-1], width, dtype=torch.long)
        for i, r in enumerate(rows):
            t[i, ..., : r[key].shape[-1]] = r[key]
        out[key] = t
    return Batch.from_dict(out)


def sft_batch(
    samples: Sequence[SFTSample],
    data: SFTDataConfig,
    dp: int,
    width_multiple: int = 1,
    vision: VisionProcessor | None = None,
) -> Batch:
    """One step's samples as a right-padded batch: ``input_ids``, ``attention_mask``,
    ``position_ids``, ``loss_mask`` [rows, width] (and ``segment_ids`` when packed); ``dp`` and
    ``width_multiple`` (sequence parallelism's TP) round the rows and the width up. With
    ``vision``, M-RoPE ``position_ids`` [rows, 3, width] and ``multi_modal_inputs`` (one entry a
    row, filler rows included)."""
    if data.packing:
        packed = pack_samples(samples, data.max_length)
        groups = [r.members for r in packed]
        rows = [
            {
                "input_ids": list(r.input_ids),
                "attention_mask": [1] * len(r.input_ids),
                "position_ids": list(r.position_ids),
                "loss_mask": list(r.loss_mask),
                "segment_ids": list(r.segment_ids),
            }
            for r in packed
        ]
    else:
        groups = [(i,) for i in range(len(samples))]
        rows = [
            {
                "input_ids": list(s.input_ids),
                "attention_mask": [1] * len(s),
                "position_ids": list(range(len(s))),
                "loss_mask": list(s.loss_mask),
            }
            for s in samples
        ]
    if vision is None:
        return _pad_rows(rows, dp, width_multiple)
    images = []
    for row, members in zip(rows, groups):
        parts = [samples[i] for i in members]
        row["position_ids"] = torch.cat([_mrope_positions(s, vision) for s in parts], dim=-1)
        inputs = [s.images.pixel_inputs(vision) for s in parts if s.images is not None]
        images.append(concat_vision_inputs(inputs) or None)
    batch = _pad_rows(rows, dp, width_multiple)
    batch["multi_modal_inputs"] = images + [None] * (len(batch) - len(images))
    return batch


def _mrope_positions(sample: SFTSample, vision: VisionProcessor) -> torch.Tensor:
    """``[3, T]`` M-RoPE positions of one sample on its own (text: three equal streams)."""
    ids = torch.tensor(sample.input_ids)[None]
    grid = torch.tensor(sample.images.grid_thw) if sample.images is not None else None
    return get_rope_index(
        ids,
        torch.ones_like(ids),
        grid,
        image_token_id=vision.image_token_id,
        spatial_merge_size=vision.spatial_merge_size,
        frames_apart=vision.frames_apart,
    )[0]


def pair_samples(data: RMDataConfig, tokenizer, files: Any, files_key: str) -> list:
    """Every preference pair of ``files`` tokenized (``data.preference.tokenize_pair``)."""
    from rlhf_megatron.data.preference import PreferenceDataError, tokenize_pair

    out = []
    for source, row, _ in read_rows(files, files_key):
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
