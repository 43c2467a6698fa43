"""Qwen3-VL's data side: the tiny processor, frame-by-frame M-RoPE positions against transformers'
``Qwen3VLModel.get_rope_index``, dataset rows with videos, and what vLLM makes of them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from vl_helpers import PROCESSOR_MAX_PIXELS, PROCESSOR_MIN_PIXELS, png, write_clip, write_tiny_vl_model

from rlhf_megatron.config.schema import DataConfig
from rlhf_megatron.data.dataset import RLHFDataset, collate_fn
from rlhf_megatron.data.multimodal import concat_vision_inputs, load_vision_processor
from rlhf_megatron.data.rope_index import get_rope_index
from rlhf_megatron.data.tokenizer import build_tiny_vl_processor

FRAME_PIXELS = 28 * 28 * 4  # dataset frames of 56 x 56: 64 x 64 after the processor, 2 x 2 tokens


@pytest.fixture(scope="module")
def processor():
    return build_tiny_vl_processor(PROCESSOR_MIN_PIXELS, PROCESSOR_MAX_PIXELS, family="qwen3_vl")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_vl_model(tmp_path_factory.mktemp("tiny_qwen3_vl"), family="qwen3_vl")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    return Qwen3VLModel(Qwen3VLConfig.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def vision(model_dir):
    return load_vision_processor(model_dir)


def hf_positions(model, input_ids, attention_mask, mm_token_type_ids, image_grid_thw, video_grid_thw):
    """transformers' positions, ``[B, 3, S]``."""
    pos, _ = model.get_rope_index(
        input_ids,
        mm_token_type_ids,
        image_grid_thw=image_grid_thw,
        video_grid_thw=None if video_grid_thw is None else video_grid_thw.clone(),
        attention_mask=attention_mask,
    )
    return pos.permute(1, 0, 2)


def ours(processor, inputs):
    tok = processor.tokenizer.convert_tokens_to_ids
    return get_rope_index(
        inputs["input_ids"],
        inputs["attention_mask"],
        inputs.get("image_grid_thw"),
        image_token_id=tok("<|image_pad|>"),
        spatial_merge_size=2,
        video_grid_thw=inputs.get("video_grid_thw"),
        video_token_id=tok("<|video_pad|>"),
        frames_apart=True,
    )


def frames(count, width, height, seed=0):
    return np.random.default_rng(seed).integers(0, 255, (count, height, width, 3), dtype=np.uint8)


def timing(count, fps=2.0):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(
        fps=fps,
        total_num_frames=count,
        frames_indices=list(range(count)),
        duration=count / fps,
        video_backend="pyav",
    )


def image(width, height):
    return Image.fromarray(frames(1, width, height, seed=width)[0])


def prompt(processor, *parts):
    content = [{"type": p} if p in ("image", "video") else {"type": "text", "text": p} for p in parts]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


CASES = {
    # name: (rows of prompt parts, images, videos as (frames, width, height))
    "text+image": ([("look", "image", "what?")], [(90, 60)], []),
    "text+video": ([("video", "which way?")], [], [(6, 56, 80)]),
    "image+video": ([("image", "then", "video", "same?")], [(64, 64)], [(4, 120, 56)]),
    "two rows, padded": (
        [("video", "a"), ("first", "image", "long text after the image, longer than the other row")],
        [(50, 70)],
        [(2, 56, 56)],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_frames_apart_positions_equal_transformers_qwen3_vl(processor, hf_model, case):
    rows, image_sizes, video_shapes = CASES[case]
    processor.tokenizer.padding_side = "left"  # as the dataset pads
    videos = [frames(*shape) for shape in video_shapes]
    inputs = processor(
        text=[prompt(processor, *parts) for parts in rows],
        images=[image(*size) for size in image_sizes] or None,
        videos=videos or None,
        video_metadata=[timing(len(v)) for v in videos] or None,
        do_sample_frames=False,
        padding=True,
        add_special_tokens=False,
        return_tensors="pt",
    )
    got = ours(processor, inputs)
    want = hf_positions(
        hf_model,
        inputs["input_ids"],
        inputs["attention_mask"],
        inputs["mm_token_type_ids"],
        inputs.get("image_grid_thw"),
        inputs.get("video_grid_thw"),
    )
    assert torch.equal(got, want)
    if videos:
        # Each temporal patch is its own run, after its timestamp, and all at one time position.
        row = inputs["input_ids"][0]
        video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        is_video = (row == video_id).int()
        starts = torch.nonzero(is_video.diff() == 1).flatten() + 1
        t = int(inputs["video_grid_thw"][0, 0])
        assert len(starts) == t
        text = processor.tokenizer.decode(row)
        assert text.count(" seconds>") == t
        for start in starts.tolist():
            run = got[0, 0, start : start + int(is_video[start:].argmin())]
            assert run.unique().tolist() == [got[0, 0, start].item()]


def test_frames_apart_errors_name_the_row():
    video = 8
    kw = dict(image_token_id=7, spatial_merge_size=2, video_token_id=video, frames_apart=True)
    one_frame = [1] + [video] * 4 + [2]
    ids = torch.tensor([one_frame, one_frame])
    mask = torch.ones_like(ids)
    # A 2-frame video whose frames are split over two rows.
    with pytest.raises(ValueError, match=r"row 0: video 0 has 2 frames .* after 1 runs"):
        get_rope_index(ids, mask, None, video_grid_thw=torch.tensor([[2, 4, 4]]), **kw)
    with pytest.raises(
        ValueError, match=r"row 0: frame 0 of video 0 takes 4 placeholder tokens .* implies 6 per frame"
    ):
        get_rope_index(ids, mask, None, video_grid_thw=torch.tensor([[1, 4, 6], [1, 4, 4]]), **kw)
    # Two one-frame videos: each row's run is a whole video; no seconds needed.
    pos = get_rope_index(ids, mask, None, video_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]), **kw)
    assert pos[0].tolist() == [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]


def test_tiny_processor_round_trips_and_bounds_video_frames_like_images(processor, tmp_path):
    from transformers import AutoProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    processor.save_pretrained(tmp_path)
    loaded = AutoProcessor.from_pretrained(tmp_path)
    assert isinstance(loaded, Qwen3VLProcessor)
    assert isinstance(loaded.video_processor, Qwen3VLVideoProcessor)
    for part in (loaded.image_processor, loaded.video_processor):
        assert (part.patch_size, part.temporal_patch_size, part.merge_size) == (16, 2, 2)
    video = frames(4, 400, 300)
    calls = {
        "text": [prompt(processor, "image", "video", "?")],
        "images": [image(400, 300)],
        "videos": [video],
        "video_metadata": [timing(4)],
        "do_sample_frames": False,
        "add_special_tokens": False,
        "return_tensors": "pt",
    }
    first, again = processor(**calls), loaded(**calls)
    assert first.keys() == again.keys()
    for key in first:
        assert torch.equal(first[key], again[key]), key
    # Every frame is bounded by max_pixels as an image of its size is: the same token grid.
    assert first["video_grid_thw"][0, 1:].tolist() == first["image_grid_thw"][0, 1:].tolist()
    assert first["image_grid_thw"][0].prod() * 16**2 <= PROCESSOR_MAX_PIXELS
    # Timestamps: the middle of each temporal patch, frames at 2 fps.
    text = processor.tokenizer.decode(first["input_ids"][0])
    assert "<0.2 seconds><|vision_start|><|video_pad|>" in text and "<1.2 seconds>" in text
    # The Qwen2.5-VL default is untouched.
    default = build_tiny_vl_processor()
    assert isinstance(default, Qwen2_5_VLProcessor) and default.image_processor.patch_size == 14
    with pytest.raises(ValueError, match="family must be one of"):
        build_tiny_vl_processor(family="qwen9_vl")


def write(tmp_path, rows, name):
    path = tmp_path / "data" / name
    path.parent.mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def dataset(vision, tmp_path):
    return build_datasets(vision, tmp_path)


def build_datasets(vision, tmp_path):
    """EasyR1 rows with a decoded clip (and one without video), verl rows with a frame list and an image."""
    clip = write_clip(tmp_path / "a.mp4", frames=8, rate=4)  # 2 s: 4 frames at 2 fps
    easyr1 = [
        {"problem": "<video>Which way does the square move?", "answer": "right", "videos": [clip]},
        {"problem": "What is 2+2?", "answer": "4", "videos": []},
    ]
    verl = [
        {
            "data_source": "moving",
            "prompt": [{"role": "user", "content": "<image><video>Count."}],
            "images": [{"bytes": png(56, 56)}],
            "videos": [[png(56, 56, (10 * i, 0, 0)) for i in range(3)]],  # padded to 4 frames
            "reward_model": {"ground_truth": "3"},
        }
    ]
    cfg = dict(
        max_prompt_length=200, min_pixels=FRAME_PIXELS, max_pixels=FRAME_PIXELS, filter_overlong_prompts=True
    )
    return [
        RLHFDataset(
            write(tmp_path, easyr1, "easyr1.parquet"),
            vision.processor.tokenizer,
            DataConfig(prompt_key="problem", **cfg),
            vision,
        ),
        RLHFDataset(
            write(tmp_path, verl, "verl.parquet"),
            vision.processor.tokenizer,
            DataConfig(prompt_key="prompt", **cfg),
            vision,
        ),
    ]


def test_dataset_builds_qwen3_vl_video_rows_with_transformers_positions(vision, hf_model, dataset):
    assert vision.frames_apart and vision.tokens_per_second is None
    easyr1, verl = dataset
    tok = vision.processor.tokenizer
    items = [easyr1[0], easyr1[1], verl[0]]
    for item, (ds, index) in zip(items, [(easyr1, 0), (easyr1, 1), (verl, 0)]):
        ids, mask = item["input_ids"][None], item["attention_mask"][None]
        inputs = item["multi_modal_inputs"]
        types = (ids == vision.image_token_id).int() + 2 * (ids == vision.video_token_id).int()
        grid = inputs["image_grid_thw"] if inputs["image_grid_thw"].shape[0] else None
        want = hf_positions(hf_model, ids, mask, types, grid, inputs.get("video_grid_thw"))
        assert torch.equal(item["position_ids"], want[0])
        assert "second_per_grid_ts" not in inputs  # Qwen3-VL times its frames in text
        # filter_overlong_prompts measured each prompt as long as it is (timestamps included).
        assert ds.prompt_lengths[index] == int(item["attention_mask"].sum())
    clip = items[0]
    assert clip["multi_modal_inputs"]["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert clip["raw_prompt_ids"].count(vision.video_token_id) == 1  # vLLM expands the one pad
    # Frames 0, 2, 5, 7 of the 4 fps source: temporal patches centred on 0.25 s and 1.5 s.
    text = tok.decode(clip["input_ids"][clip["attention_mask"].bool()])
    assert "<0.2 seconds><|vision_start|>" in text and "<1.5 seconds><|vision_start|>" in text
    _, metadata = clip["multi_modal_data"]["video"][0]
    assert (metadata["fps"], metadata["frames_indices"], metadata["total_num_frames"]) == (
        4.0,
        [0, 2, 5, 7],
        8,
    )
    assert items[2]["multi_modal_inputs"]["video_grid_thw"].tolist() == [[2, 4, 4]]
    joined = concat_vision_inputs(collate_fn(items[:2])["multi_modal_inputs"])
    assert joined["video_grid_thw"].tolist() == [[2, 4, 4]] and "second_per_grid_ts" not in joined


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_vllm_expands_the_dataset_prompts_as_the_dataset_did(family, model_dir, vl_model_dir, tmp_path):
    """vLLM's processor, given ``raw_prompt_ids`` and ``multi_modal_data`` (frames and their
    timing), writes the prompt the trainer numbers: for Qwen3-VL the same timestamps and runs,
    for Qwen2.5-VL the same seconds per temporal patch."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    from rlhf_megatron.rollout.base import prompt_media

    path = model_dir if family == "qwen3_vl" else vl_model_dir
    easyr1, verl = build_datasets(load_vision_processor(path), tmp_path)
    config = ModelConfig(model=path, tokenizer=path, dtype="float32", max_model_len=512)
    engine_side = MULTIMODAL_REGISTRY.create_processor(config)
    batch = collate_fn([easyr1[0], verl[0]])
    for row, media in enumerate(prompt_media(batch)):
        items = engine_side.info.parse_mm_data(media)
        request = ProcessorInputs(prompt=batch["raw_prompt_ids"][row], mm_data_items=items)
        out = engine_side.apply(request, TimingContext())
        mask = batch["attention_mask"][row].bool()
        assert out["prompt_token_ids"] == batch["input_ids"][row][mask].tolist()
        seconds = batch["multi_modal_inputs"][row].get("second_per_grid_ts")
        if family == "qwen2_5_vl":
            assert float(out["mm_kwargs"]["video"][0]["second_per_grid_ts"].data) == float(seconds[0])
