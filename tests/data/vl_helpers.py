"""A tiny Qwen2.5-VL checkpoint directory without weights (processor + config.json) and test images.

Enough for everything that reads only the processor and the config (the dataset,
`load_vision_processor`); shared by tests/data, tests/rewards and tests/reliability (loaded by path
there, since test directories are not packages).
"""

from __future__ import annotations

import io
import os

from PIL import Image

from rlhf_megatron.data.tokenizer import build_tiny_vl_processor

# The processor's own pixel bounds: 4 to 64 merged 28 x 28 patches per image.
PROCESSOR_MIN_PIXELS = 28 * 28 * 4
PROCESSOR_MAX_PIXELS = 28 * 28 * 64


def write_tiny_vl_model(path: str | os.PathLike, family: str = "qwen2_5_vl") -> str:
    """Save the tiny VL processor and a matching tiny config.json into ``path``; no weights.

    ``qwen2_5_vl``: ``Qwen2_5_VLConfig`` with 14-pixel patches. ``qwen3_vl``: ``Qwen3VLConfig`` with
    16-pixel patches, one vision block feeding DeepStack, interleaved M-RoPE."""
    import transformers

    processor = build_tiny_vl_processor(
        min_pixels=PROCESSOR_MIN_PIXELS, max_pixels=PROCESSOR_MAX_PIXELS, family=family
    )
    processor.save_pretrained(path)
    tok = processor.tokenizer
    token = tok.convert_tokens_to_ids
    text = {
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "intermediate_size": 64,
        "vocab_size": 128,
        "bos_token_id": None,
        "eos_token_id": token("<|im_end|>"),
        "pad_token_id": tok.pad_token_id,
        "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 10000.0},
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 1,
        "intermediate_size": 32,
        "out_hidden_size": 64,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
    }
    config_cls = transformers.Qwen2_5_VLConfig
    if family == "qwen3_vl":
        text.update(num_attention_heads=2, head_dim=32, vocab_size=512)
        text["rope_parameters"].update(mrope_section=[4, 6, 6], mrope_interleaved=True)
        vision.update(patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0])
        config_cls = transformers.Qwen3VLConfig
    config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
    ).save_pretrained(path)
    return os.fspath(path)


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """PNG bytes of a ``width x height`` image with a gradient, so resizing changes pixel values."""
    image = Image.new("RGB", (width, height), color)
    for x in range(0, width, 7):
        image.putpixel((x, x % height), (x % 256, 255 - x % 256, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_clip(
    path: str | os.PathLike, frames: int = 8, rate: int = 4, width: int = 56, height: int = 56
) -> str:
    """An mpeg4 clip of ``frames`` frames at ``rate`` fps whose square moves left to right, for the video rows."""
    import av
    import numpy as np

    with av.open(os.fspath(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            array = np.full((height, width, 3), 30, np.uint8)
            x = i * (width - 16) // max(frames - 1, 1)
            array[height // 2 - 8 : height // 2 + 8, x : x + 16] = (230, 200, 40)
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return os.fspath(path)
