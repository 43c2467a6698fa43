"""Tiny random Qwen2.5-VL / Qwen2-VL / Qwen3-VL checkpoints, an image batch, and transformers'
outputs on it.

The batch is what RL prompts look like: four chat prompts, left-padded: two with one image
each, of different sizes (grids (1, 6, 4) and (1, 8, 6) patches: 6 and 12 image tokens;
the second spans 4 windows of Qwen2.5-VL's windowed block), one text only, and one with two
images. The video batch has a 4-frame clip, an image, an image before a one-frame clip, and
text only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rlhf_megatron.data.rope_index import get_rope_index
from rlhf_megatron.models.tiny import make_tiny_qwen2_5_vl


def _image(n: int) -> list[dict]:
    return [{"type": "image"}] * n


def _text(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


MESSAGES = [
    [{"role": "user", "content": _image(1) + _text("What is 1+2?")}],
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": _text("Look:") + _image(1) + _text("ok?")}],
    [{"role": "user", "content": _text("Same?") + _image(2)}],
]
# (height, width) in pixels, in order of appearance: grids (1, 6, 4), (1, 8, 6), (1, 4, 4), (1, 6, 4).
IMAGE_SIZES = [(84, 56), (112, 84), (56, 56), (84, 56)]


def make_model_dir(root: Path, family: str = "qwen2_5_vl", **sizes) -> Path:
    return make_tiny_qwen2_5_vl(root / family, family=family, **sizes)


def image_batch(hf_dir: Path) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw`` from the model's
    processor, plus ``position_ids`` ``[B, 3, S]`` from ``data.rope_index``."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(hf_dir)
    processor.tokenizer.padding_side = "left"
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in IMAGE_SIZES]
    texts = [processor.apply_chat_template(m, add_generation_prompt=True) for m in MESSAGES]
    enc = processor(text=texts, images=images, padding=True, return_tensors="pt")
    batch = {k: enc[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")}
    if "mm_token_type_ids" in enc and _frames_apart(hf_dir):
        batch["mm_token_type_ids"] = enc["mm_token_type_ids"]  # transformers' Qwen3-VL positions
    batch["position_ids"] = get_rope_index(
        batch["input_ids"],
        batch["attention_mask"],
        batch["image_grid_thw"],
        image_token_id=processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        spatial_merge_size=processor.image_processor.merge_size,
    )
    return batch


VIDEO_MESSAGES = [
    [{"role": "user", "content": [{"type": "video"}] + _text("Which way?")}],
    [{"role": "user", "content": _text("Look:") + _image(1)}],
    [{"role": "user", "content": _image(1) + _text("then") + [{"type": "video"}]}],
    [{"role": "user", "content": "hi"}],
]
# (frames, height, width) in order of appearance: grids (2, 4, 6) and (1, 4, 4) (one frame, padded).
VIDEO_SHAPES = [(4, 56, 84), (1, 56, 56)]
VIDEO_FPS = [2.0, 0.5]  # seconds per temporal patch: 1 and 4


def video_batch(hf_dir: Path) -> dict[str, torch.Tensor]:
    """``image_batch`` for ``VIDEO_MESSAGES``: rows with a video, an image, both, neither; adds
    ``pixel_values_videos``, ``video_grid_thw`` and ``second_per_grid_ts`` (2 / fps)."""
    from PIL import Image
    from transformers import AutoProcessor

    from rlhf_megatron.planning.model_arch import ModelArch

    processor = AutoProcessor.from_pretrained(hf_dir)
    processor.tokenizer.padding_side = "left"
    rng = np.random.default_rng(1)
    arch = ModelArch.from_hf_dir(hf_dir)
    frames_apart = arch.vision.frames_apart
    images = [Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)) for _ in range(2)]
    shapes = [(max(2, t), h, w) for t, h, w in VIDEO_SHAPES] if frames_apart else VIDEO_SHAPES
    videos = [rng.integers(0, 255, shape + (3,), dtype=np.uint8) for shape in shapes]
    texts = [processor.apply_chat_template(m, add_generation_prompt=True) for m in VIDEO_MESSAGES]
    extra = {}
    if frames_apart:  # Qwen3-VL writes each frame's time from the clip's metadata
        from transformers.video_utils import VideoMetadata

        extra = dict(
            video_metadata=[
                VideoMetadata(total_num_frames=len(v), fps=fps, frames_indices=list(range(len(v))))
                for v, fps in zip(videos, VIDEO_FPS)
            ],
            do_sample_frames=False,
        )
    enc = processor(text=texts, images=images, videos=videos, padding=True, return_tensors="pt", **extra)
    keys = (
        "input_ids",
        "attention_mask",
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
    )
    batch = {k: enc[k] for k in keys}
    if frames_apart:
        batch["mm_token_type_ids"] = enc["mm_token_type_ids"]
    else:
        batch["second_per_grid_ts"] = torch.tensor([2.0 / fps for fps in VIDEO_FPS])
    batch["position_ids"] = get_rope_index(
        batch["input_ids"],
        batch["attention_mask"],
        batch["image_grid_thw"],
        image_token_id=arch.image_token_id,
        spatial_merge_size=arch.vision.spatial_merge_size,
        video_grid_thw=batch["video_grid_thw"],
        video_token_id=arch.video_token_id,
        second_per_grid_ts=batch.get("second_per_grid_ts"),
        tokens_per_second=arch.vision.tokens_per_second,
        frames_apart=frames_apart,
    )
    return batch


def _frames_apart(hf_dir: Path) -> bool:
    from rlhf_megatron.planning.model_arch import ModelArch

    return ModelArch.from_hf_dir(hf_dir).vision.frames_apart


def load_hf(hf_dir: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' logits ``[B, S, V]``, with the batch's M-RoPE positions (HF's own ``[3, B, S]``);
    a batch with ``mm_token_type_ids`` (Qwen3-VL) lets transformers number the positions itself."""
    visuals = (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    )
    if "mm_token_type_ids" in batch:
        positions = {"mm_token_type_ids": batch["mm_token_type_ids"]}
    else:
        positions = {"position_ids": batch["position_ids"].transpose(0, 1)}
    with torch.no_grad():
        return model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            **{k: batch[k] for k in visuals if k in batch},
            **positions,
        ).logits.float()


def loss_weights(batch: dict[str, torch.Tensor], seed: int = 3) -> torch.Tensor:
    """Fixed random per-token weights ``[B, S-1]`` for a weighted log-likelihood (zero off valid pairs)."""
    valid = batch["attention_mask"].bool()
    pair = valid[:, :-1] & valid[:, 1:]
    return torch.rand(pair.shape, generator=torch.Generator().manual_seed(seed)) * pair
