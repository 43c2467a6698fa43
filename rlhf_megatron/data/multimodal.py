"""Images of vision-language prompts: decoding, EasyR1's pixel bounds, and the model's processor.

A dataset row's images (``data.image_key``) may be stored as ``{"bytes": ...}`` (what HF
``datasets`` and their parquet files hold; ``{"path": ...}`` also works), raw bytes, a file
path, or a PIL image. `open_image` opens one lazily (the header only, enough for its size);
`prepare_image` decodes it and applies EasyR1's ``process_image``: scale down to at most
``data.max_pixels`` pixels, then up to at least ``data.min_pixels``, then convert to RGB.

The model's own processor (`VisionProcessor`, from ``AutoProcessor.from_pretrained(model
path)``) then turns the prepared images into ``pixel_values`` / ``image_grid_thw`` and
expands each ``<|image_pad|>`` into one pad per merged patch. The processor is loaded with the
checkpoint's settings, not with ``min_pixels``/``max_pixels`` overrides: the rollout engine
(vLLM) receives the same prepared images and runs the same checkpoint's processor, so both
sides see identical image grids and token counts.

Boundaries: PIL and transformers' processor; no Megatron, Ray or vLLM.
"""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # PIL is imported where images are handled: text-only runs do not need it
    from PIL import Image

__all__ = [
    "IMAGE_PLACEHOLDER",
    "VISUAL_KEYS",
    "concat_vision_inputs",
    "ImageError",
    "VisionProcessor",
    "image_list",
    "locate_file",
    "load_vision_processor",
    "open_image",
    "prepare_image",
    "target_size",
]

# How EasyR1 and verl mark an image's place in a prompt's text.
IMAGE_PLACEHOLDER = "<image>"


class ImageError(ValueError):
    """An image cannot be found or decoded; the dataset adds the file and row."""


def image_list(value: Any) -> list:
    """An images cell as a list: null -> [], one image (bytes/path/dict) -> [it]."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def open_image(value: Any, base_dir: str | None = None) -> Image.Image:
    """A lazily opened PIL image from bytes, ``{"bytes"|"path": ...}``, a path or a PIL image.

    Relative paths are looked up in ``base_dir`` (the data file's directory), then in the
    current directory.
    """
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        else:
            raise ImageError(f"an image dict needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return Image.open(io.BytesIO(bytes(value)))
        except Exception as err:
            raise ImageError(
                f"{len(value)} bytes are not a readable image ({type(err).__name__}: {err})"
            ) from err
    if isinstance(value, (str, os.PathLike)):
        return _open_path(os.fspath(value), base_dir)
    raise ImageError(
        f"an image must be bytes, a path, {{'bytes': ...}} or a PIL image, got {type(value).__name__}"
    )


def locate_file(path: str, base_dir: str | None) -> tuple[str | None, str]:
    """A data row's file: an absolute ``path``, or a relative one looked up in ``base_dir`` (the
    data file's directory), then the current directory. ``(the file or None, where it was looked
    for)``, the second for the caller's "does not exist" error."""
    candidates = [path] if os.path.isabs(path) else [os.path.join(base_dir, path)] if base_dir else []
    if not os.path.isabs(path):
        candidates.append(os.path.abspath(path))
    found = next((c for c in candidates if os.path.isfile(c)), None)
    return found, " and ".join(dict.fromkeys(candidates))


def _open_path(path: str, base_dir: str | None) -> Image.Image:
    from PIL import Image

    found, looked = locate_file(path, base_dir)
    if found is None:
        raise ImageError(
            f"image file {path!r} does not exist (looked for {looked}); "
            "relative image paths are resolved against the data file's directory, then the current directory"
        )
    try:
        return Image.open(found)
    except Exception as err:
        raise ImageError(f"image file {found} is not a readable image ({type(err).__name__}: {err})") from err


def target_size(width: int, height: int, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    """EasyR1's resize: scale to <= ``max_pixels`` pixels, then to >= ``min_pixels`` (sizes truncated)."""
    if max_pixels is not None and width * height > max_pixels:
        factor = math.sqrt(max_pixels / (width * height))
        width, height = int(width * factor), int(height * factor)
    if min_pixels is not None and width * height < min_pixels:
        factor = math.sqrt(min_pixels / (width * height))
        width, height = int(width * factor), int(height * factor)
    return width, height


def prepare_image(
    value: Any, min_pixels: int | None, max_pixels: int | None, base_dir: str | None = None
) -> Image.Image:
    """Decode, bound the pixel count (`target_size`) and convert to RGB: what the processor and vLLM get."""
    image = open_image(value, base_dir)
    try:
        image.load()  # decode now (and close the file): a corrupt body fails here, not later
    except Exception as err:
        raise ImageError(f"the image cannot be decoded ({type(err).__name__}: {err})") from err
    size = target_size(image.width, image.height, min_pixels, max_pixels)
    if size != image.size:
        image = image.resize(size)
    return image if image.mode == "RGB" else image.convert("RGB")


@dataclass(frozen=True)
class VisionProcessor:
    """A vision-language model's processor plus the two numbers M-RoPE positions need."""

    processor: Any
    """The checkpoint's ``AutoProcessor`` (Qwen2.5-VL's: tokenizer + Qwen2-VL image processor)."""
    image_token_id: int
    """Id of the image pad token (``<|image_pad|>``): one per merged patch after expansion."""
    spatial_merge_size: int
    """Patches merged per side into one LM token (2 for Qwen2-VL/2.5-VL: 2 x 2 -> 1)."""
    model_path: str
    """Where the processor and config.json were read (for error messages)."""
    video_token_id: int | None = None
    """Id of the video pad token (``<|video_pad|>``); None when the processor takes no videos."""
    tokens_per_second: float | None = None
    """Qwen2.5-VL's M-RoPE time positions per second of video; None: one per temporal patch (Qwen2-VL)."""
    frames_apart: bool = False
    """Qwen3-VL: each temporal patch of a video is its own run of video tokens after a ``<t seconds>``
    timestamp, and M-RoPE numbers it as a one-frame image (``get_rope_index(frames_apart=True)``)."""

    @property
    def image_token(self) -> str:
        return self.processor.image_token

    @property
    def patch_dim(self) -> int:
        """Width of one ``pixel_values`` row: channels x temporal patch x patch x patch (3 x 2 x 14 x 14)."""
        ip = self.processor.image_processor
        return 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2

    def pixel_inputs(self, images: list) -> dict:
        """``pixel_values`` [patches, patch_dim] and ``image_grid_thw`` [images, 3] of prepared
        images: the image processor's part of the processor's call (what the text is expanded by)."""
        out = self.processor.image_processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    @property
    def video_token(self) -> str:
        return self.processor.video_token

    def video_tokens(self, frames: int, width: int, height: int, timing: dict | None = None) -> int:
        """LM tokens the processor puts in place of the one ``<|video_pad|>`` of a video of ``frames``
        (prepared) frames of this size: its video tokens, and with ``frames_apart`` (Qwen3-VL) each
        temporal patch's timestamp and markers too, written from ``timing`` (the video's metadata)."""
        patches = int(self.processor.video_processor.get_num_of_video_patches(frames, height, width, {}))
        tokens = patches // self.spatial_merge_size**2
        if not self.frames_apart:
            return tokens
        if timing is None:
            raise ValueError("VisionProcessor.video_tokens: Qwen3-VL's timestamps need the video's timing")
        import torch
        from transformers.video_utils import VideoMetadata

        # The processor's own expansion of a grid with no pads per frame: timestamps and markers only.
        grid_t = -(-frames // int(self.processor.video_processor.temporal_patch_size))
        empty = {
            "video_grid_thw": torch.tensor([[grid_t, 0, 0]]),
            "video_metadata": [VideoMetadata(**timing)],
        }
        text = self.processor.replace_video_token(empty, 0)
        return tokens + len(self.processor.tokenizer.encode(text, add_special_tokens=False))

    def image_tokens(self, width: int, height: int) -> int:
        """LM tokens the processor gives an image of this (already prepared) size."""
        patches = self.processor.image_processor.get_number_of_image_patches(height, width, {})
        return int(patches) // self.spatial_merge_size**2


def load_vision_processor(model_path: str | os.PathLike) -> VisionProcessor | None:
    """The processor of a vision-language checkpoint; None when its config.json has no ``vision_config``.

    ``image_token_id`` and ``spatial_merge_size`` come from config.json and are checked against
    the processor's tokenizer and image processor, which must agree with the model.
    """
    model_path = os.fspath(model_path)
    config_path = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"load_vision_processor: {config_path} does not exist; point it at an HF checkpoint directory."
        )
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    vision = config.get("vision_config")
    if not vision:
        return None
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_path)
    except Exception as err:
        raise ValueError(
            f"load_vision_processor: {model_path} is a vision-language model ({config.get('model_type')}) but its "
            f"processor does not load ({type(err).__name__}: {err}); it needs preprocessor_config.json or "
            "processor_config.json beside the tokenizer files."
        ) from err
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None or not hasattr(processor, "image_token"):
        raise ValueError(
            f"load_vision_processor: {model_path}: {type(processor).__name__} has no image processor."
        )
    image_token_id = _token_id(config, config_path, processor, "image")
    merge = int(vision.get("spatial_merge_size", 2))
    if int(getattr(image_processor, "merge_size", merge)) != merge:
        raise ValueError(
            f"load_vision_processor: {config_path} has vision_config.spatial_merge_size={merge}, but the image "
            f"processor merges {image_processor.merge_size}; the checkpoint's config and processor disagree."
        )
    video_token_id = None
    if getattr(processor, "video_processor", None) is not None and hasattr(processor, "video_token"):
        video_token_id = _token_id(config, config_path, processor, "video")
    # Qwen2.5-VL times its video positions (transformers' default when config.json omits it).
    per_second = (
        float(vision.get("tokens_per_second", 4)) if config.get("model_type") == "qwen2_5_vl" else None
    )
    frames_apart = config.get("model_type") in ("qwen3_vl", "qwen3_vl_moe")  # timestamps between frames
    return VisionProcessor(
        processor, image_token_id, merge, model_path, video_token_id, per_second, frames_apart
    )


def _token_id(config: dict, config_path: str, processor, kind: str) -> int:
    """config.json's ``<kind>_token_id``, checked against the id the tokenizer gives the processor's
    ``<kind>_token`` (``<|image_pad|>``, ``<|video_pad|>``)."""
    key, token = f"{kind}_token_id", getattr(processor, f"{kind}_token")
    value = config.get(key, config.get("text_config", {}).get(key))
    token_id = processor.tokenizer.convert_tokens_to_ids(token)
    if value is None or int(value) != token_id:
        raise ValueError(
            f"load_vision_processor: {config_path} has {key}={value}, but the tokenizer gives "
            f"{token!r} the id {token_id}; the checkpoint's config and tokenizer disagree."
        )
    return token_id


VISUAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)
"""A row's ``multi_modal_inputs`` keys, as the model's forward takes them: the images' patches and
grids, the videos' patches, grids and seconds per temporal patch (Qwen2.5-VL's M-RoPE times)."""

_GRID_OF = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}


def concat_vision_inputs(rows) -> dict:
    """Concatenate per-row ``multi_modal_inputs`` (``pixel_values`` [patches, D], ``image_grid_thw``
    [images, 3]; for videos ``pixel_values_videos``, ``video_grid_thw`` [videos, 3] and
    ``second_per_grid_ts`` [videos]) in row order, the layout a vision tower takes for a group
    of rows; a pair is left out when none of the rows has one of its kind, ``{}`` when none has
    either."""
    import torch

    rows = [r for r in rows if r is not None]
    out = {}
    for pixels, grid in _GRID_OF.items():
        having = [r for r in rows if grid in r and r[grid].shape[0] > 0]
        if not having:
            continue
        out[pixels] = torch.cat([r[pixels] for r in having])
        out[grid] = torch.cat([r[grid] for r in having])
        if grid == "video_grid_thw" and all("second_per_grid_ts" in r for r in having):
            out["second_per_grid_ts"] = torch.cat([torch.as_tensor(r["second_per_grid_ts"]) for r in having])
    return out
