"""Shared-prompt packing: the packed layout, the read-back index, and when a micro-batch stays unpacked."""

import torch

from rlhf_megatron.data.packing import pack_shared_prompts, packed_outputs, prompt_groups

P, R = 5, 4  # prompt and response widths


def _micro(prompts, responses):
    """Rows in the rollout layout: left-padded prompts (width P), right-padded responses (width R)."""
    rows, masks = [], []
    for prompt, response in zip(prompts, responses):
        rows.append([0] * (P - len(prompt)) + prompt + response + [0] * (R - len(response)))
        masks.append(
            [0] * (P - len(prompt)) + [1] * (len(prompt) + len(response)) + [0] * (R - len(response))
        )
    ids, mask = torch.tensor(rows), torch.tensor(masks)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, P:],
        "response_mask": mask[:, P:],
        "advantages": torch.arange(len(rows), dtype=torch.float32)[:, None].expand(-1, R),
    }


# Rows 0, 1 and 3 share prompt [11, 12, 13]; row 2 has its own, shorter one.
PROMPTS = [[11, 12, 13], [11, 12, 13], [21, 22], [11, 12, 13]]
RESPONSES = [[31, 32], [41, 42, 43], [51], [61, 62, 63, 64]]


def test_rows_group_by_their_whole_prompt_in_order_of_first_row():
    micro = _micro(PROMPTS, RESPONSES)
    groups = prompt_groups(micro["input_ids"][:, :P], micro["attention_mask"][:, :P])
    assert groups.tolist() == [0, 0, 1, 0]
    # The same tokens with different padding are different prompts.
    shifted = micro["attention_mask"][:, :P].clone()
    shifted[1, 0] = 1
    assert prompt_groups(micro["input_ids"][:, :P], shifted).tolist() == [0, 1, 2, 0]


def test_each_prompt_once_then_its_responses_with_restarting_positions():
    micro = _micro(PROMPTS, RESPONSES)
    packed = pack_shared_prompts(micro)
    assert packed["input_ids"].tolist() == [
        [11, 12, 13, 31, 32, 41, 42, 43, 61, 62, 63, 64],
        [21, 22, 51, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert packed["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 3, 4, 5, 3, 4, 5, 6],
        [0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert packed["segment_ids"].tolist() == [
        [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3],
        [0, 0, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1],
    ]
    assert packed["attention_mask"].tolist() == (packed["segment_ids"] >= 0).long().tolist()
    # per-row columns are untouched
    for key in ("responses", "response_mask", "advantages"):
        assert torch.equal(packed[key], micro[key])


def test_the_index_reads_the_state_before_each_response_token():
    micro = _micro(PROMPTS, RESPONSES)
    packed = pack_shared_prompts(micro)
    index, width = packed["_response_index"], packed["input_ids"].shape[1]
    assert index.shape == (4, 4)  # the longest response
    flat_ids = packed["input_ids"].flatten()
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        expected = [prompt[-1], *response[:-1]]  # the token each response token follows
        assert flat_ids[index[row, : len(response)]].tolist() == expected
        # past the end: a valid position (the prompt's last token), masked out downstream
        assert flat_ids[index[row, len(response) :]].tolist() == [prompt[-1]] * (4 - len(response))
        assert set((index[row] // width).tolist()) == {0 if row != 2 else 1}
    # the model's outputs read back per row in the unpacked order
    outputs = torch.arange(2 * width * 3, dtype=torch.float32).view(2, width, 3)
    read = packed_outputs(outputs, index)
    assert read.shape == (4, 4, 3)
    assert torch.equal(read[3, 2], outputs[0, 9])  # row 3's third token follows its second, column 9


def test_the_width_rounds_up_to_a_multiple():
    packed = pack_shared_prompts(_micro(PROMPTS, RESPONSES), multiple=5)
    assert packed["input_ids"].shape == (2, 15)
    assert (packed["segment_ids"][:, 12:] == -1).all()


def test_micro_batches_that_cannot_be_packed_are_left_alone():
    # a row without prompt tokens
    micro = _micro(PROMPTS, RESPONSES)
    micro["attention_mask"] = micro["attention_mask"].clone()
    micro["attention_mask"][2, :P] = 0
    assert pack_shared_prompts(micro) is None
    # a response with a hole (not the layout rollout engines write)
    micro = _micro(PROMPTS, RESPONSES)
    micro["attention_mask"] = micro["attention_mask"].clone()
    micro["attention_mask"][1, P + 1] = 0
    assert pack_shared_prompts(micro) is None
    # M-RoPE positions (images)
    micro = _micro(PROMPTS, RESPONSES)
    micro["position_ids"] = micro["position_ids"][:, None].expand(-1, 3, -1)
    assert pack_shared_prompts(micro) is None


def test_one_row_per_prompt_packs_to_the_rows_without_padding():
    packed = pack_shared_prompts(_micro(PROMPTS[1:3], RESPONSES[1:3]))
    assert packed["input_ids"].tolist() == [[11, 12, 13, 41, 42, 43], [21, 22, 51, 0, 0, 0]]
