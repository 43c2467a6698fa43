"""M-RoPE positions equal transformers' Qwen2.5-VL get_rope_index; responses extend them."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.data.rope_index import extend_positions, get_rope_index, image_token_counts

IMAGE = 7
VIDEO = 8
TOKENS_PER_SECOND = 2


def _hf_rope_index(input_ids, attention_mask, grid, video_grid=None, seconds=None):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 64,
            "vocab_size": 32,
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "num_heads": 1,
            "intermediate_size": 32,
            "out_hidden_size": 64,
            "tokens_per_second": TOKENS_PER_SECOND,
        },
        image_token_id=IMAGE,
        video_token_id=VIDEO,
    )
    model = Qwen2_5_VLModel(config)
    types = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    pos, _ = model.get_rope_index(
        input_ids,
        types,
        image_grid_thw=grid,
        video_grid_thw=video_grid,
        second_per_grid_ts=seconds,
        attention_mask=attention_mask,
    )
    return pos.permute(1, 0, 2)  # (3, B, S) -> (B, 3, S)


def _row(text_before, grids, text_after, pad):
    ids = [0] * pad + [1] * text_before
    for t, h, w in grids:
        ids += [IMAGE] * (t * h * w // 4) + [2]
    ids += [3] * text_after
    return ids


def test_matches_transformers_with_left_padding_and_two_image_sizes():
    rows = [_row(3, [(1, 4, 6)], 5, pad=4), _row(2, [(1, 2, 2), (1, 6, 4)], 1, pad=0)]
    width = max(map(len, rows))
    input_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (
        torch.arange(width)[None] >= torch.tensor([width - len(r) + r.count(0) for r in rows])[:, None]
    ).long()
    mask[0, : width - len(rows[0]) + 4] = 0
    grid = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4]])
    ours = get_rope_index(input_ids, mask, grid, image_token_id=IMAGE, spatial_merge_size=2)
    theirs = _hf_rope_index(input_ids, mask, grid)
    valid = mask.bool()[:, None, :].expand_as(ours)
    assert torch.equal(ours[valid], theirs[valid])
    assert (ours[~valid] == 0).all()
    assert image_token_counts(grid, 2).tolist() == [6, 1, 6]


def test_text_only_rows_count_like_1d_positions():
    ids = torch.tensor([[0, 0, 5, 6, 7 + 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    pos = get_rope_index(ids, mask, None, image_token_id=IMAGE, spatial_merge_size=2)
    assert pos[0].tolist() == [[0, 0, 0, 1, 2]] * 3


def test_a_placeholder_run_that_does_not_match_its_grid_names_the_row():
    ids = torch.tensor([[1, IMAGE, IMAGE, IMAGE, 2]])
    with pytest.raises(ValueError, match=r"row 0: an image takes 3 placeholder tokens but .* implies 6"):
        get_rope_index(
            ids, torch.ones_like(ids), torch.tensor([[1, 4, 6]]), image_token_id=IMAGE, spatial_merge_size=2
        )
    with pytest.raises(ValueError, match="row 0: an image placeholder run of 3 tokens has no image_grid_thw"):
        get_rope_index(ids, torch.ones_like(ids), None, image_token_id=IMAGE, spatial_merge_size=2)
    with pytest.raises(ValueError, match="2 image_grid_thw entries but only 1"):
        get_rope_index(
            ids,
            torch.ones_like(ids),
            torch.tensor([[1, 2, 6], [1, 2, 2]]),
            image_token_id=IMAGE,
            spatial_merge_size=2,
        )


def test_extend_positions_continues_every_stream_like_the_full_sequence():
    prompt = [1, 1, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 2, 3]
    full = prompt + [4, 4, 4]
    grid = torch.tensor([[1, 4, 6]])
    kw = dict(image_token_id=IMAGE, spatial_merge_size=2)
    p = get_rope_index(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), grid, **kw)
    f = get_rope_index(torch.tensor([full]), torch.ones(1, len(full), dtype=torch.long), grid, **kw)
    assert torch.equal(extend_positions(p, 3), f)
    flat = torch.tensor([[0, 0, 1, 2]])
    assert extend_positions(flat, 2).tolist() == [[0, 0, 1, 2, 3, 4]]


VIDEO_KW = dict(
    image_token_id=IMAGE, spatial_merge_size=2, video_token_id=VIDEO, tokens_per_second=TOKENS_PER_SECOND
)


def test_a_video_between_images_matches_transformers_when_its_times_stay_inside_its_frame():
    # Half a second per temporal patch at 2 tokens per second: one time position per patch.
    # Here transformers and vLLM number alike (the last time position is below the frame's side).
    ids = [1, IMAGE, IMAGE, 2, 3] + [VIDEO] * (2 * 4 * 4 // 4) + [2, 4, 4]
    input_ids, mask = torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)
    grid, video_grid, seconds = torch.tensor([[1, 2, 4]]), torch.tensor([[2, 4, 4]]), torch.tensor([0.5])
    ours = get_rope_index(
        input_ids, mask, grid, video_grid_thw=video_grid, second_per_grid_ts=seconds, **VIDEO_KW
    )
    assert torch.equal(ours, _hf_rope_index(input_ids, mask, grid, video_grid, seconds))
    video = ours[0, :, 5:13]
    assert video[0].unique().tolist() == [5, 6]  # starts at 5: 4 tokens and a 1 x 2 image before it
    assert ours[0, :, 13].tolist() == [7, 7, 7]


def test_video_times_follow_seconds_and_the_text_after_continues_past_the_last_time():
    # Two seconds per temporal patch x 2 tokens per second: patches at +0, +4, +8 (vLLM's and
    # Qwen's numbering: the text after goes on from the largest position, here a time).
    ids = [1] + [VIDEO] * (3 * 2 * 2 // 4) + [2, 3]
    mask = torch.ones(1, len(ids), dtype=torch.long)
    pos = get_rope_index(
        torch.tensor([ids]),
        mask,
        None,
        video_grid_thw=torch.tensor([[3, 2, 2]]),
        second_per_grid_ts=torch.tensor([2.0]),
        **VIDEO_KW,
    )[0]
    assert pos[0].tolist() == [0, 1, 5, 9, 10, 11]
    assert pos[1].tolist() == pos[2].tolist() == [0, 1, 1, 1, 10, 11]
    # Qwen2-VL (no tokens_per_second): one time position per temporal patch.
    plain = {**VIDEO_KW, "tokens_per_second": None}
    pos = get_rope_index(torch.tensor([ids]), mask, None, video_grid_thw=torch.tensor([[3, 2, 2]]), **plain)[
        0
    ]
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 5]


def test_videos_that_do_not_pair_with_their_grids_name_the_row():
    ids = torch.tensor([[1, VIDEO, VIDEO, 2]])
    mask = torch.ones_like(ids)
    with pytest.raises(ValueError, match="row 0: a video placeholder run of 2 tokens has no video_grid_thw"):
        get_rope_index(ids, mask, None, **VIDEO_KW)
    with pytest.raises(ValueError, match=r"row 0: a video takes 2 placeholder tokens but .* implies 4"):
        get_rope_index(
            ids,
            mask,
            None,
            video_grid_thw=torch.tensor([[4, 2, 2]]),
            second_per_grid_ts=torch.ones(1),
            **VIDEO_KW,
        )
    with pytest.raises(ValueError, match="2 second_per_grid_ts entries for 1 video grids"):
        get_rope_index(
            ids,
            mask,
            None,
            video_grid_thw=torch.tensor([[2, 2, 2]]),
            second_per_grid_ts=torch.ones(2),
            **VIDEO_KW,
        )
    with pytest.raises(ValueError, match="without second_per_grid_ts"):
        get_rope_index(ids, mask, None, video_grid_thw=torch.tensor([[2, 2, 2]]), **VIDEO_KW)
