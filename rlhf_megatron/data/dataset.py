"""`RLHFDataset`: prompt rows, text or text + images, tokenized with the model's chat template.

Sources (``data.train_files`` / ``data.val_files``, see `sources`): parquet, JSON/JSONL,
``save_to_disk`` directories and dataset repositories on disk, with EasyR1's ``path@split``.

Two row layouts, told apart per file by the type of the ``data.prompt_key`` column:

* **verl** (a list of chat messages): ``prompt``, ``data_source`` (``data.reward_fn_key``),
  ``reward_model`` (a dict with ``ground_truth``), optional ``extra_info`` (a dict;
  ``extra_info["index"]`` becomes the prompt's ``index``). verl's multimodal parquet adds an
  images column (``data.image_key``) and ``<image>`` placeholders in the message texts.
* **EasyR1** (plain text): ``data.prompt_key`` (EasyR1 sets ``problem``), ``data.answer_key``
  (``answer``) and optionally ``data.image_key`` (``images``). Messages are built as EasyR1
  builds them (``data.format_prompt``, ``data.system_prompt``; see `prompts`). The answer
  becomes ``reward_model={"ground_truth": answer}``; without a ``data.reward_fn_key`` column
  the row's data source is the dataset's name (its directory name or file stem), so the reward
  manager and the per-source validation metrics work unchanged.

Any other column (``ability``...) passes through unchanged; the images column does not.

``dataset[i]`` (``P`` = ``data.max_prompt_length``):

* ``input_ids``, ``attention_mask``: ``[P]`` int64, left padded. With images, each image's pad
  is expanded to one ``<|image_pad|>`` per merged patch (what the processor returns).
* ``position_ids``: ``[P]`` int64 (``cumsum(mask) - 1``) for a text model; ``[3, P]`` M-RoPE
  positions (`rope_index.get_rope_index`) for every row when a `VisionProcessor` is given.
* ``raw_prompt_ids``: list[int], unpadded, with ONE image pad per image (what vLLM takes
  together with the images).
* with a `VisionProcessor` only, on every row (empty for rows without images):
  ``multi_modal_data`` = ``{"image": [PIL.Image, ...]}`` (the prepared RGB images, for vLLM) and
  ``multi_modal_inputs`` = ``{"pixel_values": float32 [num_patches, patch_dim],
  "image_grid_thw": int64 [num_images, 3]}`` (for the model's forward passes). A row with
  videos (``data.video_key``) adds ``"video": [(frames uint8 [T, H, W, 3], timing), ...]`` to
  the first (``Video.metadata``) and ``pixel_values_videos``, ``video_grid_thw`` (and
  Qwen2.5-VL's ``second_per_grid_ts``) to the second; Qwen3-VL's processor expands a video's
  pad into a ``<t seconds>`` timestamp and a run of video tokens per temporal patch.
* ``reward_model``, ``extra_info``, ``index``, the data-source column, the pass-through
  columns, and optionally ``raw_prompt`` (the messages) and ``raw_input_ids``.

`collate_fn` stacks items into a `Batch`; the two multimodal dicts become per-row object
columns, so splitting a batch by row keeps each row's patches with it.

Memory: tables are kept as read (parquet/JSON in memory, ``save_to_disk`` memory-mapped) and
rows are converted to Python, decoded and tokenized only in ``__getitem__``. Filtering overlong
prompts tokenizes once in streaming record batches (images are measured from their headers,
not decoded) and keeps an int32 length per row, so loading N rows costs about the Arrow size of
the files plus a few bytes per row. Datasets larger than memory are out of scope.

Boundaries: reads files, decodes images and tokenizes; knows nothing of Ray, Megatron or the trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rlhf_megatron.choices import Truncation
from rlhf_megatron.config.schema import DataConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.multimodal import (
    IMAGE_PLACEHOLDER,
    ImageError,
    VisionProcessor,
    image_list,
    open_image,
    prepare_image,
    target_size,
)
from rlhf_megatron.data.prompts import (
    DatasetFormatError,
    check_messages,
    count_placeholders,
    easyr1_messages,
    load_format_prompt,
    verl_messages,
    with_image_parts,
)
from rlhf_megatron.data.rope_index import get_rope_index
from rlhf_megatron.data.sources import SourceTable, load_source
from rlhf_megatron.data.video import (
    FRAME_FACTOR,
    VIDEO_PLACEHOLDER,
    Video,
    VideoError,
    load_video,
    video_list,
)

logger = logging.getLogger(__name__)

__all__ = ["DatasetFormatError", "RLHFDataset", "as_data_config", "collate_fn", "left_pad", "truncate_ids"]

TRUNCATION_MODES = Truncation.values()  # data.truncation
_LENGTH_BATCH_ROWS = 1024  # rows tokenized at a time when computing lengths for filtering


def as_data_config(config: DataConfig | Mapping | None) -> DataConfig:
    """The ``data`` section as the typed `DataConfig`.

    A `DataConfig` is used as is; a ``data`` DictConfig (``cfg.data``) or a plain dict of
    ``data.*`` keys is converted, the dataclass filling in what it leaves out.
    """
    if isinstance(config, DataConfig):
        return config
    if config is None:
        return DataConfig()
    from omegaconf import OmegaConf

    if OmegaConf.is_config(config):
        config = OmegaConf.to_object(config)
        if isinstance(config, DataConfig):
            return config
    if not isinstance(config, Mapping):
        raise TypeError(
            f"RLHFDataset: config must be the data section (DataConfig), got {type(config).__name__}."
        )
    known = {f.name for f in dataclasses.fields(DataConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise TypeError(f"RLHFDataset: {unknown} are not data.* keys; DataConfig has {sorted(known)}.")
    return DataConfig(**config)


def _check_config(config: DataConfig, limit_images: int) -> None:
    if config.truncation not in TRUNCATION_MODES:
        raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {config.truncation!r}.")
    if int(config.max_prompt_length) <= 0:
        raise ValueError(f"data.max_prompt_length must be positive, got {config.max_prompt_length}.")
    for key in ("min_pixels", "max_pixels"):
        value = getattr(config, key)
        if value is not None and int(value) <= 0:
            raise ValueError(f"data.{key} must be positive or null, got {value}.")
    if (
        config.min_pixels is not None
        and config.max_pixels is not None
        and config.min_pixels > config.max_pixels
    ):
        raise ValueError(
            f"data.min_pixels={config.min_pixels} is larger than data.max_pixels={config.max_pixels}."
        )
    if limit_images < 0:
        raise ValueError(
            f"actor_rollout_ref.rollout.limit_images must be >= 0 (0: no limit), got {limit_images}."
        )
    if not float(config.video_fps) > 0:
        raise ValueError(
            f"data.video_fps must be positive (frames sampled per second), got {config.video_fps}."
        )
    if int(config.video_max_frames) < FRAME_FACTOR:
        raise ValueError(
            f"data.video_max_frames must be at least {FRAME_FACTOR} (one temporal patch), got {config.video_max_frames}."
        )


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


def _is_list_type(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _check_prompt_type(path: str, key: str, t: pa.DataType, answer_key: str) -> None:
    """Reject a prompt column that cannot hold chat messages, before reading any row."""
    ok = _is_list_type(t)
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
            "[{'role': 'user', 'content': text}] or point data.prompt_key at the messages column. "
            f"(Plain-text prompts are EasyR1's layout, which also needs the answer column "
            f"data.answer_key={answer_key!r}.)"
        )


def _image_count(column: pa.ChunkedArray) -> int:
    """Images in an images column: list lengths, or non-null cells for one image per cell."""
    if _is_list_type(column.type):
        return int(pc.sum(pc.list_value_length(column)).as_py() or 0)
    return len(column) - column.null_count


class RLHFDataset(torch.utils.data.Dataset):
    """Prompts from one or more sources, verl's or EasyR1's layout; see the module docstring.

    ``processor`` (`load_vision_processor(model_path)`) is required for rows with images and
    switches every item to M-RoPE positions plus the multimodal fields. ``limit_images`` is
    ``actor_rollout_ref.rollout.limit_images`` (0: no limit). ``files_key`` names the config
    key the files came from, for error messages.
    """

    def __init__(
        self,
        data_files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        config: DataConfig,
        processor: VisionProcessor | None = None,
        *,
        limit_images: int = 0,
        files_key: str = "data.train_files",
    ):
        if isinstance(data_files, (str, os.PathLike)):
            data_files = [data_files]
        specs = [os.fspath(f) for f in data_files]
        if not specs:
            raise ValueError(
                "RLHFDataset: no parquet files given (data.train_files / data.val_files is empty)."
            )
        self.config = as_data_config(config)
        self.limit_images = int(limit_images)
        _check_config(self.config, self.limit_images)
        self.tokenizer = tokenizer
        self.vision = processor
        self.format_prompt = load_format_prompt(self.config.format_prompt)
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
        if (
            processor is not None
            and tokenizer.convert_tokens_to_ids(processor.image_token) != processor.image_token_id
        ):
            raise ValueError(
                f"RLHFDataset: the tokenizer gives {processor.image_token!r} the id "
                f"{tokenizer.convert_tokens_to_ids(processor.image_token)}, the processor of "
                f"{processor.model_path} {processor.image_token_id}; use the tokenizer of the same checkpoint."
            )

        self._sources: list[SourceTable] = [s for spec in specs for s in load_source(spec, files_key)]
        self.files = [s.name for s in self._sources]
        self._tables: list[pa.Table] = [s.table for s in self._sources]
        self._layouts = [self._check_columns(s) for s in self._sources]
        # Parquet decoding leaves freed buffers in Arrow's allocator (mimalloc/jemalloc keep
        # them); hand them back so a large dataset costs about its Arrow size, not twice that.
        release = getattr(pa.default_memory_pool(), "release_unused", None)
        if release is not None:
            release()
        self._offsets = np.cumsum([0] + [t.num_rows for t in self._tables]).astype(np.int64)
        # Global row numbers of the rows kept; None while every row is kept (saves 8 bytes/row).
        self._rows: np.ndarray | None = None
        self.prompt_lengths: np.ndarray | None = None
        if self.config.filter_overlong_prompts:
            self._filter_overlong()

    # ------------------------------------------------------------------ loading
    def _check_columns(self, source: SourceTable) -> str:
        """The file's layout ('verl' or 'easyr1'), or an error naming the missing/mistyped column."""
        cfg, path, table = self.config, source.name, source.table
        names = table.column_names
        missing = [] if cfg.prompt_key in names else [cfg.prompt_key]
        prompt_type = table.schema.field(cfg.prompt_key).type if not missing else None
        plain_text = prompt_type is not None and _is_string_type(prompt_type)
        if plain_text and cfg.answer_key not in names and "reward_model" not in names:
            raise DatasetFormatError(
                f"{path}: column '{cfg.prompt_key}' holds plain text (EasyR1's layout), which needs the answer "
                f"column data.answer_key={cfg.answer_key!r}; the file has columns {names}. Set data.answer_key."
            )
        if plain_text and cfg.answer_key in names:
            layout = "easyr1"
        else:
            missing += [k for k in (cfg.reward_fn_key, "reward_model") if k not in names]
            if missing:
                raise DatasetFormatError(
                    f"{path}: missing column '{missing[0]}' (in every row); the file has columns {names}. "
                    "Expected verl's format: data_source, prompt, reward_model, extra_info "
                    "(data.prompt_key and data.reward_fn_key rename the first two), or EasyR1's: a text "
                    "prompt column (data.prompt_key), answer (data.answer_key) and optionally images "
                    "(data.image_key)."
                )
            _check_prompt_type(path, cfg.prompt_key, prompt_type, cfg.answer_key)
            if self.format_prompt is not None:
                raise ValueError(
                    f"data.format_prompt={cfg.format_prompt} renders plain-text prompts (EasyR1's layout), but "
                    f"{path} holds chat messages in '{cfg.prompt_key}'. Put the instruction in the messages "
                    "or set data.format_prompt=null."
                )
            layout = "verl"
        videos = cfg.video_key in names and _image_count(table.column(cfg.video_key))
        if videos and (self.vision is None or self.vision.video_token_id is None):
            raise ValueError(
                f"{path}: column '{cfg.video_key}' (data.video_key) holds videos, but "
                + (
                    "the dataset was given no vision processor: the model is text-only. Use a "
                    "vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or drop the videos."
                    if self.vision is None
                    else f"the processor of {self.vision.model_path} takes no videos."
                )
            )
        if cfg.image_key in names and self.vision is None and _image_count(table.column(cfg.image_key)):
            raise ValueError(
                f"{path}: column '{cfg.image_key}' (data.image_key) holds images, but the dataset was given no "
                "image processor: the model is text-only, or the trainer did not pass "
                "processor=load_vision_processor(model path). Use a vision-language model (Qwen2.5-VL) or "
                "drop the images."
            )
        return layout

    def _locate(self, global_row: int) -> tuple[int, int]:
        file_idx = int(np.searchsorted(self._offsets, global_row, side="right")) - 1
        return file_idx, int(global_row - self._offsets[file_idx])

    def _render(self, messages: list[dict], with_images: bool, videos: bool = False) -> str:
        if with_images or videos:  # the processor's template places the pad tokens (EasyR1 does the same)
            return self.vision.processor.apply_chat_template(
                with_image_parts(messages, videos), add_generation_prompt=True, tokenize=False
            )
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _messages(self, file_idx: int, row: int, cell: Any) -> list[dict]:
        """A prompt cell as chat messages with string contents (``<image>`` still in the text)."""
        cfg, path = self.config, self.files[file_idx]
        if self._layouts[file_idx] == "easyr1":
            return easyr1_messages(
                path, row, cfg.prompt_key, cell, template=self.format_prompt, system_prompt=cfg.system_prompt
            )
        return verl_messages(check_messages(path, row, cfg.prompt_key, cell), cfg.system_prompt)

    def _image_values(self, file_idx: int, row: int, messages: list[dict], cell: Any) -> list:
        """The row's raw images, checked against its ``<image>`` placeholders and the rollout limit."""
        if self.config.image_key not in self._tables[file_idx].column_names:
            return []
        path, images = self.files[file_idx], image_list(cell)
        placeholders = count_placeholders(messages)
        if placeholders != len(images):
            raise DatasetFormatError(
                f"{path} row {row}: {len(images)} image(s) in '{self.config.image_key}' but {placeholders} "
                f"'{IMAGE_PLACEHOLDER}' placeholder(s) in the prompt text; put one {IMAGE_PLACEHOLDER} where each "
                "image goes (in order), or fix the images list."
            )
        if self.limit_images and len(images) > self.limit_images:
            raise DatasetFormatError(
                f"{path} row {row}: {len(images)} images, more than actor_rollout_ref.rollout.limit_images="
                f"{self.limit_images} (what vLLM accepts per prompt). Raise the limit (0: none) or drop the row."
            )
        return images

    def _video_values(self, file_idx: int, row: int, messages: list[dict], cell: Any) -> list:
        """The row's raw videos, checked against its ``<video>`` placeholders."""
        if self.config.video_key not in self._tables[file_idx].column_names:
            return []
        path, videos = self.files[file_idx], video_list(cell)
        placeholders = count_placeholders(messages, VIDEO_PLACEHOLDER)
        if placeholders != len(videos):
            raise DatasetFormatError(
                f"{path} row {row}: {len(videos)} video(s) in '{self.config.video_key}' but {placeholders} "
                f"'{VIDEO_PLACEHOLDER}' placeholder(s) in the prompt text; put one {VIDEO_PLACEHOLDER} where each "
                "video goes (in order), or fix the videos list."
            )
        return videos

    def _prepare_videos(self, file_idx: int, row: int, values: list) -> list[Video]:
        base_dir, cfg = self._sources[file_idx].base_dir, self.config
        videos = []
        for i, value in enumerate(values):
            try:
                videos.append(
                    load_video(
                        value,
                        fps=cfg.video_fps,
                        min_pixels=cfg.min_pixels,
                        max_pixels=cfg.max_pixels,
                        max_frames=cfg.video_max_frames,
                        base_dir=base_dir,
                    )
                )
            except VideoError as err:
                raise DatasetFormatError(
                    f"{self.files[file_idx]} row {row}: '{cfg.video_key}'[{i}]: {err}. Fix or drop the video."
                ) from err
        return videos

    def _prepare_images(self, file_idx: int, row: int, values: list) -> list:
        base_dir, cfg = self._sources[file_idx].base_dir, self.config
        images = []
        for i, value in enumerate(values):
            try:
                images.append(prepare_image(value, cfg.min_pixels, cfg.max_pixels, base_dir))
            except ImageError as err:
                raise DatasetFormatError(
                    f"{self.files[file_idx]} row {row}: '{cfg.image_key}'[{i}]: {err}. Fix or drop the image."
                ) from err
        return images

    def _image_token_total(self, file_idx: int, row: int, values: list) -> int:
        """LM tokens of the row's images after preparation, from their headers (no pixel decoding)."""
        cfg, total = self.config, 0
        for i, value in enumerate(values):
            try:
                width, height = open_image(value, self._sources[file_idx].base_dir).size
            except ImageError as err:
                raise DatasetFormatError(
                    f"{self.files[file_idx]} row {row}: '{cfg.image_key}'[{i}]: {err}. Fix or drop the image."
                ) from err
            total += self.vision.image_tokens(*target_size(width, height, cfg.min_pixels, cfg.max_pixels))
        return total

    def _video_token_total(self, file_idx: int, row: int, values: list) -> int:
        """LM tokens of the row's videos after sampling (videos are decoded to count their frames)."""
        return sum(
            self.vision.video_tokens(len(v.frames), v.frames.shape[2], v.frames.shape[1], v.metadata())
            for v in self._prepare_videos(file_idx, row, values)
        )

    def _filter_overlong(self) -> None:
        """Measure every prompt once, in record batches, keeping only an int32 length per row."""
        total = int(self._offsets[-1])
        lengths = np.empty(total, dtype=np.int32)
        cfg = self.config
        for file_idx, table in enumerate(self._tables):
            start, row = int(self._offsets[file_idx]), 0  # global and in-file number of the next row
            columns = [cfg.prompt_key] + [
                k for k in (cfg.image_key, cfg.video_key) if k in table.column_names
            ]
            for record_batch in table.select(columns).to_batches(max_chunksize=_LENGTH_BATCH_ROWS):
                cells = record_batch.to_pydict()
                prompts = cells[cfg.prompt_key]
                texts, extra = [], []
                nothing = [None] * len(prompts)
                for cell, image_cell, video_cell in zip(
                    prompts, cells.get(cfg.image_key, nothing), cells.get(cfg.video_key, nothing)
                ):
                    messages = self._messages(file_idx, row, cell)
                    images = self._image_values(file_idx, row, messages, image_cell)
                    videos = self._video_values(file_idx, row, messages, video_cell)
                    texts.append(self._render(messages, bool(images), bool(videos)))
                    # Each image (video) is one pad in the rendered text and expands to its token count.
                    extra.append(
                        (self._image_token_total(file_idx, row, images) - len(images) if images else 0)
                        + (self._video_token_total(file_idx, row, videos) - len(videos) if videos else 0)
                    )
                    row += 1
                encoded = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)[
                    "input_ids"
                ]
                lengths[start : start + len(encoded)] = [len(ids) + e for ids, e in zip(encoded, extra)]
                start += len(encoded)
        keep = np.flatnonzero(lengths <= cfg.max_prompt_length)
        dropped = total - len(keep)
        logger.info(
            "RLHFDataset: filtered out %d of %d prompts longer than data.max_prompt_length=%d tokens (%s).",
            dropped,
            total,
            cfg.max_prompt_length,
            ", ".join(self.files),
        )
        if len(keep) == 0:
            raise ValueError(
                f"RLHFDataset: every prompt in {self.files} is longer than data.max_prompt_length="
                f"{cfg.max_prompt_length} tokens; raise it."
            )
        self.prompt_lengths = lengths[keep]
        self._rows = keep if dropped else None

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(self._offsets[-1]) if self._rows is None else len(self._rows)

    def _cell(self, file_idx: int, row: int, key: str) -> Any:
        return self._tables[file_idx].column(key)[row].as_py()

    def column_values(self, key: str):
        """``(where, value)`` of column ``key`` in every row of the files that have it, ``where``
        naming the file and row (e.g. for the multi-turn checks of ``extra_info.tools_kwargs`` and
        ``agent_name`` before any worker starts)."""
        for file_idx, table in enumerate(self._tables):
            if key not in table.column_names:
                continue
            for row, value in enumerate(table.column(key).to_pylist()):
                yield f"{self.files[file_idx]} row {row}", value

    def _reward_fields(self, file_idx: int, row: int) -> tuple[dict, dict]:
        """(reward_model, extra_info) of a row; EasyR1 rows get their answer as the ground truth."""
        path, cfg = self.files[file_idx], self.config
        if self._layouts[file_idx] == "easyr1":
            answer = self._cell(file_idx, row, cfg.answer_key)
            if answer is None:
                raise DatasetFormatError(
                    f"{path} row {row}: '{cfg.answer_key}' (data.answer_key) is null; every row needs an answer."
                )
            reward_model = {"ground_truth": answer}
        else:
            reward_model = self._cell(file_idx, row, "reward_model")
            # Arrow gives a row without ground_truth a null one when other rows have it.
            if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
                raise DatasetFormatError(
                    f"{path} row {row}: 'reward_model' must be a dict with a non-null 'ground_truth', got {reward_model!r:.200}."
                )
        has_extra = "extra_info" in self._tables[file_idx].column_names
        extra_info = self._cell(file_idx, row, "extra_info") if has_extra else None
        if extra_info is not None and not isinstance(extra_info, dict):
            raise DatasetFormatError(
                f"{path} row {row}: 'extra_info' must be a dict, got {extra_info!r:.200}."
            )
        return reward_model, extra_info or {}

    def _encode_text(self, path: str, row: int, messages: list[dict]) -> list[int]:
        cfg = self.config
        ids = self.tokenizer.encode(self._render(messages, False), add_special_tokens=False)
        if len(ids) > cfg.max_prompt_length:
            if cfg.truncation == "error":
                raise ValueError(
                    f"{path} row {row}: prompt is {len(ids)} tokens, longer than data.max_prompt_length="
                    f"{cfg.max_prompt_length}. Raise data.max_prompt_length, set data.truncation to "
                    "left/right/middle, or set data.filter_overlong_prompts=True."
                )
            ids = truncate_ids(ids, cfg.max_prompt_length, cfg.truncation)
        return ids

    def _encode_images(
        self, file_idx: int, row: int, messages: list[dict], images: list, videos: list[Video] = ()
    ) -> tuple[list, list, dict]:
        """(expanded ids, raw ids with one pad per image and video, multi_modal_inputs) of a row
        with images or videos."""
        path, cfg, vision = self.files[file_idx], self.config, self.vision
        prompt = self._render(messages, bool(images), bool(videos))
        visual: dict[str, Any] = {"images": images or None}
        if videos:
            from transformers.video_utils import VideoMetadata

            visual["videos"] = [v.frames for v in videos]
            visual["video_metadata"] = [VideoMetadata(**v.metadata()) for v in videos]
            # The frames are sampled already (Qwen3-VL's video processor would sample again by default).
            visual["do_sample_frames"] = False
        inputs = vision.processor(**visual, text=[prompt], add_special_tokens=False, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        raw_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        pads = [(vision.image_token_id, vision.image_token, len(images), "image")]
        if videos:
            pads.append((vision.video_token_id, vision.video_token, len(videos), "video"))
        for token_id, token, count, kind in pads:
            if raw_ids.count(token_id) != count:
                raise DatasetFormatError(
                    f"{path} row {row}: the chat template wrote {raw_ids.count(token_id)} {token!r} for {count} "
                    f"{kind}(s); the processor's chat template must place one per {kind} part."
                )
        if len(ids) > cfg.max_prompt_length:
            image_tokens = ids.count(vision.image_token_id)
            if videos:
                video_tokens = ids.count(vision.video_token_id)
                frames = [len(v.frames) for v in videos]
                raise ValueError(
                    f"{path} row {row}: prompt is {len(ids)} tokens ({video_tokens} of them for {len(videos)} "
                    f"video(s) of {frames} frames, {image_tokens} for {len(images)} image(s)), longer than "
                    f"data.max_prompt_length={cfg.max_prompt_length}. A prompt with videos cannot be truncated "
                    "without cutting their tokens: raise data.max_prompt_length, lower data.video_fps, "
                    "data.video_max_frames or data.max_pixels, or set data.filter_overlong_prompts=True."
                )
            raise ValueError(
                f"{path} row {row}: prompt is {len(ids)} tokens ({image_tokens} of them for {len(images)} image(s)), "
                f"longer than data.max_prompt_length={cfg.max_prompt_length}. A prompt with images cannot be "
                "truncated without cutting image tokens: raise data.max_prompt_length, lower data.max_pixels, or "
                "set data.filter_overlong_prompts=True."
            )
        mm_inputs = self._no_images() if not images else {}
        mm_inputs.update({k: inputs[k] for k in ("pixel_values", "image_grid_thw") if images})
        if videos:
            mm_inputs["pixel_values_videos"] = inputs["pixel_values_videos"]
            mm_inputs["video_grid_thw"] = inputs["video_grid_thw"]
            if "second_per_grid_ts" in inputs:  # Qwen2.5-VL's; Qwen3-VL times frames in text
                mm_inputs["second_per_grid_ts"] = torch.as_tensor(
                    inputs["second_per_grid_ts"], dtype=torch.float32
                )
        return ids, raw_ids, mm_inputs

    def _no_images(self) -> dict:
        """A text row's multi_modal_inputs: zero patches, zero images (keeps every row's keys alike)."""
        return {
            "pixel_values": torch.zeros(0, self.vision.patch_dim, dtype=torch.float32),
            "image_grid_thw": torch.zeros(0, 3, dtype=torch.long),
        }

    def __getitem__(self, item: int) -> dict[str, Any]:
        if not -len(self) <= item < len(self):
            raise IndexError(f"RLHFDataset index {item} is out of range for {len(self)} rows.")
        item %= len(self)
        global_row = item if self._rows is None else int(self._rows[item])
        file_idx, row = self._locate(global_row)
        path, cfg = self.files[file_idx], self.config
        table = self._tables[file_idx]

        messages = self._messages(file_idx, row, self._cell(file_idx, row, cfg.prompt_key))
        image_cell = self._cell(file_idx, row, cfg.image_key) if cfg.image_key in table.column_names else None
        image_values = self._image_values(file_idx, row, messages, image_cell)
        video_cell = self._cell(file_idx, row, cfg.video_key) if cfg.video_key in table.column_names else None
        video_values = self._video_values(file_idx, row, messages, video_cell)
        reward_model, extra_info = self._reward_fields(file_idx, row)

        images: list = []
        videos: list[Video] = []
        if image_values or video_values:
            images = self._prepare_images(file_idx, row, image_values)
            videos = self._prepare_videos(file_idx, row, video_values)
            ids, raw_ids, mm_inputs = self._encode_images(file_idx, row, messages, images, videos)
        else:
            ids = raw_ids = self._encode_text(path, row, messages)
            mm_inputs = self._no_images() if self.vision is not None else None
        input_ids, attention_mask, position_ids = left_pad(ids, cfg.max_prompt_length, self.pad_token_id)
        if self.vision is not None:
            grid = mm_inputs["image_grid_thw"] if images else None
            position_ids = get_rope_index(
                input_ids[None],
                attention_mask[None],
                grid,
                image_token_id=self.vision.image_token_id,
                spatial_merge_size=self.vision.spatial_merge_size,
                video_grid_thw=mm_inputs.get("video_grid_thw"),
                video_token_id=self.vision.video_token_id,
                second_per_grid_ts=mm_inputs.get("second_per_grid_ts"),
                tokens_per_second=self.vision.tokens_per_second,
                frames_apart=self.vision.frames_apart,
            )[0]  # [3, P]

        # Other columns (data_source, ability...) pass through; the fields set below win over a
        # column of the same name. The images column stays behind (raw bytes, for vLLM decoded).
        dropped = {cfg.prompt_key, cfg.image_key, cfg.video_key, "reward_model", "extra_info"}
        if self._layouts[file_idx] == "easyr1":
            dropped.add(cfg.answer_key)
        out: dict[str, Any] = {
            key: self._cell(file_idx, row, key) for key in table.column_names if key not in dropped
        }
        out.setdefault(cfg.reward_fn_key, self._sources[file_idx].dataset_name)
        out["input_ids"], out["attention_mask"], out["position_ids"] = input_ids, attention_mask, position_ids
        out["raw_prompt_ids"] = list(raw_ids)
        out["reward_model"] = reward_model
        out["extra_info"] = extra_info
        out["index"] = extra_info.get("index", global_row)
        if self.vision is not None:
            out["multi_modal_data"] = {"image": images}
            if videos:  # vLLM's video items: the frames and their timing
                out["multi_modal_data"]["video"] = [(v.frames, v.metadata()) for v in videos]
            out["multi_modal_inputs"] = mm_inputs
        if cfg.return_raw_chat:
            out["raw_prompt"] = with_image_parts(messages, bool(videos)) if images or videos else messages
        if cfg.return_raw_input_ids:
            out["raw_input_ids"] = list(raw_ids)
        return out


def collate_fn(items: Sequence[Mapping[str, Any]]) -> Batch:
    """Stack dataset items into a `Batch`: tensors are stacked (``position_ids`` ``[B, P]`` or
    ``[B, 3, P]``), everything else becomes a per-row column, ``multi_modal_data`` and
    ``multi_modal_inputs`` included (their tensors' first dimension is patches, not rows, so
    they stay one dict per row)."""
    if not items:
        raise ValueError("collate_fn: got an empty list of items.")
    keys = list(items[0].keys())
    for i, item in enumerate(items[1:], start=1):
        if set(item.keys()) != set(keys):
            raise ValueError(f"collate_fn: item {i} has keys {sorted(item)}, item 0 has {sorted(keys)}.")
    tensors, non_tensors = {}, {}
    for key in keys:
        values = [item[key] for item in items]
        if isinstance(values[0], torch.Tensor):
            tensors[key] = torch.stack(values)
        else:
            non_tensors[key] = values
    return Batch.from_dict(tensors, non_tensors)
