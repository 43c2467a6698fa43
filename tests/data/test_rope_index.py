"""M-RoPE positions equal transformers' Qwen2.5-VL get_rope_index; responses extend them."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.data.rope_index import extend_positions, get_rope_index, image_token_counts

IMAGE = 7


def _hf_rope_index(input_ids, attention_mask, grid):
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
        },
        image_token_id=IMAGE,
    )
    model = Qwen2_5_VLModel(config)
    types = (input_ids == IMAGE).int()
    pos, _ = model.get_rope_index(input_ids, types, image_grid_thw=grid, attention_mask=attention_mask)
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
