"""split_micro_batches: by count, and by token budget (use_dynamic_bsz), keeping every row once."""

import pytest
import torch

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.workers.megatron_engine import split_micro_batches


def _batch(lengths, width=16):
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    ids = torch.arange(len(lengths))[:, None].expand(-1, width).clone()
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1)})


def test_by_count_keeps_order_and_weights_sum_to_the_micro_batch_count():
    micros = split_micro_batches(_batch([3] * 10), ("input_ids",), micro_batch_size=4)
    assert [m["_rows"].tolist() for m in micros] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # megatron divides each micro-batch loss by their count; the weights make it a per-row mean
    assert [float(m["_weight"]) for m in micros] == pytest.approx([4 * 3 / 10, 4 * 3 / 10, 2 * 3 / 10])


def test_by_token_budget_respects_the_budget_and_covers_every_row():
    lengths = [16, 2, 9, 7, 3, 12, 5, 1, 8]
    micros = split_micro_batches(_batch(lengths), ("input_ids", "attention_mask"), max_tokens=20)
    rows = sorted(r for m in micros for r in m["_rows"].tolist())
    assert rows == list(range(len(lengths)))
    for m in micros:
        assert int(m["attention_mask"].sum()) <= 20
        assert m["_rows"].tolist() == sorted(m["_rows"].tolist()), "row order kept inside a micro-batch"
        assert torch.equal(m["input_ids"][:, 0], m["_rows"])
    assert len(micros) == 4  # 63 tokens need at least ceil(63 / 20) = 4 micro-batches


def test_a_sequence_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="a sequence of 16 tokens exceeds the token budget 10"):
        split_micro_batches(_batch([16, 2]), ("input_ids",), max_tokens=10)


def _rollout_micro():
    """Prompt width 6 (left padded), response width 5 (right padded)."""
    prompt_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    ids = torch.arange(22).view(2, 11)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, 6:],
        "response_mask": response_mask,
    }


def test_trim_padding_cuts_columns_that_are_padding_in_every_row():
    from rlhf_megatron.workers.megatron_engine import pad_responses, response_outputs, trim_padding

    micro = _rollout_micro()
    trimmed = trim_padding(micro)
    # prompt columns 0-1 are padding everywhere; response columns 3-4 too
    assert torch.equal(trimmed["input_ids"], micro["input_ids"][:, 2:9])
    assert trimmed["_response_width"] == 3 and torch.equal(trimmed["responses"], micro["responses"])
    # the outputs that predict the kept responses, and their padding back to R = 5
    out = trimmed["input_ids"].float()
    assert torch.equal(response_outputs(out, trimmed), micro["input_ids"][:, 5:8].float())
    assert pad_responses(response_outputs(out, trimmed), trimmed).shape == (2, 5)
    # sequence parallelism: a multiple of TP by extending into the prompt padding
    assert trim_padding(micro, multiple=4)["input_ids"].shape[1] == 8
    # ... and where the prompt padding is not enough, into the response padding
    wide = trim_padding(micro, multiple=5)
    assert wide["input_ids"].shape[1] == 10 and wide["_response_width"] == 4
    # M-RoPE positions [b, 3, S] are cut along the last dim
    micro3 = {**micro, "position_ids": micro["position_ids"][:, None].expand(-1, 3, -1)}
    assert trim_padding(micro3)["position_ids"].shape == (2, 3, 7)
