"""Tiny random Qwen2.5-VL / Qwen2-VL checkpoints, an image batch, and transformers' outputs on it.

The batch is what RL prompts look like: four chat prompts, left-padded: two with one image
each, of different sizes (grids (1, 6, 4) and (1, 8, 6) patches: 6 and 12 image tokens;
the second spans 4 windows of Qwen2.5-VL's windowed block), one text only, and one with two
images.
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
    batch["position_ids"] = get_rope_index(
        batch["input_ids"],
        batch["attention_mask"],
        batch["image_grid_thw"],
        image_token_id=processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        spatial_merge_size=processor.image_processor.merge_size,
    )
    return batch


def load_hf(hf_dir: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' logits ``[B, S, V]``, with the batch's M-RoPE positions (HF's own ``[3, B, S]``)."""
    with torch.no_grad():
        return model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            position_ids=batch["position_ids"].transpose(0, 1),
        ).logits.float()


def loss_weights(batch: dict[str, torch.Tensor], seed: int = 3) -> torch.Tensor:
    """Fixed random per-token weights ``[B, S-1]`` for a weighted log-likelihood (zero off valid pairs)."""
    valid = batch["attention_mask"].bool()
    pair = valid[:, :-1] & valid[:, 1:]
    return torch.rand(pair.shape, generator=torch.Generator().manual_seed(seed)) * pair
