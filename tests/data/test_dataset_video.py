"""RLHFDataset on video prompts: EasyR1's and verl's row formats through the real Qwen2.5-VL processor,
the timed M-RoPE positions, what vLLM is handed, and bad videos named by file, row and column."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from vl_helpers import png, write_clip

from rlhf_megatron.config.schema import DataConfig
from rlhf_megatron.data.dataset import RLHFDataset, collate_fn
from rlhf_megatron.data.multimodal import concat_vision_inputs
from rlhf_megatron.data.prompts import DatasetFormatError
from rlhf_megatron.data.rope_index import get_rope_index

MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 4  # every frame 56 x 56: 2 x 2 merged patches
VIDEO = "<|video_pad|>"


def cfg(**overrides):
    base = dict(prompt_key="problem", max_prompt_length=200, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return DataConfig(**{**base, **overrides})


@pytest.fixture
def clips(tmp_path):
    """An 8-frame clip at 4 fps (2 s: 4 frames at 2 fps) and a 4-frame one at 2 fps (2 s)."""
    return write_clip(tmp_path / "a.mp4", frames=8, rate=4), write_clip(tmp_path / "b.mp4", frames=4, rate=2)


def write(tmp_path, rows, name="train.parquet"):
    path = tmp_path / "data" / name
    path.parent.mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_easyr1_video_rows_expand_time_positions_and_hand_vllm_frames_with_their_timing(
    vision, clips, tmp_path
):
    tok = vision.processor.tokenizer
    rows = [
        {"problem": "<video>Which way does the square move?", "answer": "right", "videos": [clips[0]]},
        {"problem": "What is 2+2?", "answer": "4", "videos": []},
        # A relative path, looked up beside the data file.
        {"problem": "First <video> then <video>: same?", "answer": "yes", "videos": ["../a.mp4", clips[1]]},
    ]
    ds = RLHFDataset(write(tmp_path, rows), tok, cfg(return_raw_chat=True), vision)
    item = ds[0]
    video_id = tok.convert_tokens_to_ids(VIDEO)
    # 4 frames sampled at 2 fps -> 2 temporal patches of 2 x 2 merged tokens each.
    grid = item["multi_modal_inputs"]["video_grid_thw"]
    assert grid.tolist() == [[2, 4, 4]]
    assert item["input_ids"].tolist().count(video_id) == 2 * 2 * 2
    assert item["raw_prompt_ids"].count(video_id) == 1  # vLLM expands the one pad itself
    assert item["multi_modal_inputs"]["second_per_grid_ts"].tolist() == [1.0]
    assert item["multi_modal_inputs"]["pixel_values_videos"].shape == (2 * 4 * 4, 3 * 2 * 14 * 14)
    assert item["multi_modal_inputs"]["image_grid_thw"].shape == (0, 3)
    frames, metadata = item["multi_modal_data"]["video"][0]
    assert frames.shape == (4, 56, 56, 3)
    # The source's timing: 4 of its 8 frames at 4 fps (2 fps sampled, what vLLM derives from it).
    timing = (metadata["fps"], metadata["total_num_frames"], metadata["frames_indices"])
    assert timing == (4.0, 8, [0, 2, 5, 7])
    assert item["multi_modal_data"]["image"] == []
    assert item["raw_prompt"][-1]["content"][0] == {"type": "video"}
    expected = get_rope_index(
        item["input_ids"][None],
        item["attention_mask"][None],
        None,
        image_token_id=vision.image_token_id,
        spatial_merge_size=2,
        video_grid_thw=grid,
        video_token_id=video_id,
        second_per_grid_ts=torch.tensor([1.0]),
        tokens_per_second=vision.tokens_per_second,
    )[0]
    assert torch.equal(item["position_ids"], expected)
    times = item["position_ids"][0][item["input_ids"] == video_id].unique()
    assert (times[1] - times[0]).item() == vision.tokens_per_second  # one second per patch

    # Two videos in one row, the text-only row between; the batch keeps each row's own clips.
    batch = collate_fn([ds[i] for i in range(3)])
    joined = concat_vision_inputs(batch["multi_modal_inputs"])
    assert joined["video_grid_thw"].tolist() == [[2, 4, 4], [2, 4, 4], [2, 4, 4]]
    assert joined["second_per_grid_ts"].tolist() == [1.0, 1.0, 1.0]
    assert "pixel_values" not in joined  # no row has an image


def test_verl_video_rows_take_dicts_frame_lists_and_an_image_beside(vision, clips, tmp_path):
    tok = vision.processor.tokenizer
    frames = [png(56, 56, (10 * i, 0, 0)) for i in range(3)]  # padded to 4 frames
    rows = [
        {
            "data_source": "moving",
            "prompt": [{"role": "user", "content": "<image><video>Left or right?"}],
            "images": [{"bytes": png(56, 56)}],
            "videos": [{"video": clips[0], "nframes": 2}],
            "reward_model": {"ground_truth": "right"},
        },
        {
            "data_source": "moving",
            "prompt": [{"role": "user", "content": "<video>Count."}],
            "images": [],
            "videos": [frames],
            "reward_model": {"ground_truth": "3"},
        },
    ]
    # Arrow keeps one type per column: the dict videos and the frame list live in two files.
    files = [write(tmp_path, rows[:1], "dicts.parquet"), write(tmp_path, rows[1:], "frames.parquet")]
    ds = RLHFDataset(files, tok, cfg(prompt_key="prompt", video_fps=2.0), vision)
    first, second = ds[0], ds[1]
    # nframes=2 from the row's dict: 2 frames of the 2 s clip, one temporal patch 2 s long.
    assert first["multi_modal_inputs"]["video_grid_thw"].tolist() == [[1, 4, 4]]
    assert first["multi_modal_inputs"]["second_per_grid_ts"].tolist() == [2.0]
    assert first["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert [k for k in first["multi_modal_data"]] == ["image", "video"]
    assert second["multi_modal_inputs"]["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert second["multi_modal_data"]["video"][0][0].shape[0] == 4


def test_bad_videos_are_named_by_file_row_and_column(vision, clips, tmp_path):
    tok = vision.processor.tokenizer
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x01not a video" * 50)
    cases = [
        (
            {"problem": "<video>?", "answer": "1", "videos": [str(corrupt)]},
            r"row 0: 'videos'\[0\]: .*corrupt.mp4",
        ),
        (
            {"problem": "<video>?", "answer": "1", "videos": ["missing.mp4"]},
            r"row 0: 'videos'\[0\]: .*missing.mp4",
        ),
        (
            {"problem": "two <video><video>", "answer": "1", "videos": [clips[0]]},
            r"row 0: 1 video\(s\) in 'videos' but 2",
        ),
    ]
    for row, pattern in cases:
        path = write(tmp_path, [row], name="bad.parquet")
        with pytest.raises(DatasetFormatError, match=pattern):
            RLHFDataset(path, tok, cfg(), vision)[0]
    # More frames than the prompt budget: the error names the limit and what to lower.
    short = {"problem": "hi", "answer": "1", "videos": []}
    long = {"problem": "<video>?", "answer": "1", "videos": [clips[0]]}
    path = write(tmp_path, [short, long], name="long.parquet")
    lengths = [int(item["attention_mask"].sum()) for item in RLHFDataset(path, tok, cfg(), vision)]
    limit = lengths[1] - 1  # the video row is one token too long, the text row fits
    assert lengths[0] <= limit
    with pytest.raises(
        ValueError,
        match=rf"row 1: prompt is \d+ tokens \(8 of them for 1 video\(s\) of \[4\] frames.*"
        rf"data.max_prompt_length={limit}.*data.video_fps",
    ):
        RLHFDataset(path, tok, cfg(max_prompt_length=limit), vision)[1]
    # ... or, with filter_overlong_prompts, the row is left out before training.
    ds = RLHFDataset(path, tok, cfg(max_prompt_length=limit, filter_overlong_prompts=True), vision)
    assert len(ds) == 1 and ds.prompt_lengths.tolist() == [lengths[0]]


def test_videos_for_a_text_model_or_bad_video_settings_are_refused(vision, clips, tmp_path):
    from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

    path = write(tmp_path, [{"problem": "<video>?", "answer": "1", "videos": [clips[0]]}])
    with pytest.raises(ValueError, match="'videos' \\(data.video_key\\) holds videos.*text-only"):
        RLHFDataset(path, build_tiny_tokenizer(), cfg())
    with pytest.raises(ValueError, match="data.video_fps must be positive"):
        RLHFDataset(path, vision.processor.tokenizer, cfg(video_fps=0), vision)
    with pytest.raises(ValueError, match="data.video_max_frames must be at least 2"):
        RLHFDataset(path, vision.processor.tokenizer, cfg(video_max_frames=1), vision)
