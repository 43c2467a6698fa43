"""Shared-prompt packing: each prompt once per row, followed by all of its responses.

GRPO and its family sample ``n`` responses per prompt, and every forward pass over the rollout
(old and reference log-probs, values, the updates) would otherwise run each prompt ``n`` times,
once per row, plus the padding between a row's real tokens and the micro-batch's width. Packed,
a micro-batch's rows that carry the same prompt become one row::

    unpacked (b = 3 rows, width P + R)        packed (1 row)
    . . p p p | r r . .                       p p p | r r | r r r | r
    . . p p p | r r r .             ->        segment:  0 0 0 | 1 1 | 2 2 2 | 3
    . . p p p | r . . .                       position: 0 1 2 | 3 4 | 3 4 5 | 3

A response token attends to the prompt (segment 0) and to the earlier tokens of its own
segment, never to another response (``forward.build_attention_mask`` with ``segment_ids``);
positions restart after the prompt for every response, so rotary embeddings see exactly what
they see unpacked (``models.gpt.GPTModelWithPositions`` applies RoPE by ``position_ids``). The
prompt's keys and values are computed once and read by every response, and in backward their
gradients from all responses add up, which is what the unpacked rows' separate gradients sum
to. So the outputs (log-probs, values) and the gradients are those of the unpacked rows, up to
float rounding; the work drops from ``b x (P + R)`` columns to ``prompt + sum of responses`` per
group.

``pack_shared_prompts(micro)`` returns the packed micro-batch: ``input_ids``, ``attention_mask``
(1 = token), ``position_ids`` and ``segment_ids`` of shape ``[G, W]`` for the model, and
``_response_index`` ``[b, w]`` for reading the per-row outputs back (``w`` = the longest
response): the flat index into the model's ``[G * W]`` positions of the state that predicts
each response token (the prompt's last token for the first one). Everything per row
(``responses``, ``response_mask``, advantages, ...) stays ``[b, ...]`` as it was.

Boundaries: pure tensor functions; the model and the engine read what they return.
"""

from __future__ import annotations

import torch

__all__ = ["pack_shared_prompts", "packed_outputs", "prompt_groups"]

PACKED_KEYS = ("input_ids", "attention_mask", "position_ids", "segment_ids")


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """``[b]`` group of each row: rows with the same prompt (tokens and padding alike) share one,
    numbered in order of their first row.

    ``prompt_ids`` / ``prompt_mask``: ``[b, P]``, the prompt columns of a batch.
    """
    key = torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), inverse.numel(), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(inverse.numel()), reduce="amin")
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(first.numel())
    return rank[inverse]


def pack_shared_prompts(
    micro: dict[str, torch.Tensor], multiple: int = 1, pad_token_id: int = 0
) -> dict[str, torch.Tensor] | None:
    """``micro`` with its model inputs packed per prompt (see the module docstring), or None when
    it cannot be packed: a row without prompt tokens, or responses that are not a prefix of their
    columns (the layout every rollout engine writes).

    ``micro`` holds ``input_ids``, ``attention_mask``, ``position_ids`` ``[b, P + R]`` and
    ``responses`` ``[b, R]``. ``multiple``: the packed width is rounded up to it (sequence
    parallelism splits it over the TP ranks).
    """
    ids, mask, pos = micro["input_ids"], micro["attention_mask"].bool(), micro["position_ids"]
    if pos.dim() != 2:  # M-RoPE positions (images): not packed
        return None
    b = ids.shape[0]
    prompt_width = ids.shape[1] - micro["responses"].shape[1]
    prompt_mask, resp_mask = mask[:, :prompt_width], mask[:, prompt_width:]
    prompt_len, resp_len = prompt_mask.sum(-1), resp_mask.sum(-1)  # (b,)
    if not bool((prompt_len > 0).all()) or not torch.equal(resp_mask.long().cumprod(-1).sum(-1), resp_len):
        return None
    group = prompt_groups(ids[:, :prompt_width], prompt_mask.long())  # (b,)
    n_groups = int(group.max()) + 1
    rows = torch.arange(b)
    # The group's first row lends its prompt; each row's response follows the earlier rows' ones.
    first = torch.full((n_groups,), b, dtype=torch.long).scatter_reduce_(0, group, rows, reduce="amin")
    group_prompt = prompt_len[first]  # (G,)
    order = torch.argsort(group * b + rows)  # rows by group, in row order within it
    ends = torch.zeros(b, dtype=torch.long)
    ends[order] = torch.cumsum(resp_len[order], 0)
    group_resp = torch.zeros(n_groups, dtype=torch.long).index_add_(0, group, resp_len)
    group_end = torch.cumsum(group_resp, 0)
    # (b,) the column of each row's first response token in its group's row
    start = group_prompt[group] + ends - resp_len - (group_end - group_resp)[group]
    width = int((group_prompt + group_resp).max())
    width = -(-width // multiple) * multiple

    out_ids = torch.full((n_groups, width), pad_token_id, dtype=ids.dtype)
    out_pos = torch.zeros((n_groups, width), dtype=pos.dtype)
    out_seg = torch.full((n_groups, width), -1, dtype=torch.long)
    # prompts: each group's first row, its tokens in order from column 0
    p_rows, p_cols = prompt_mask[first].nonzero(as_tuple=True)
    p_dest = torch.cumsum(prompt_mask[first].long(), -1)[p_rows, p_cols] - 1
    out_ids[p_rows, p_dest] = ids[first[p_rows], p_cols]
    out_pos[p_rows, p_dest] = pos[first[p_rows], p_cols]
    out_seg[p_rows, p_dest] = 0
    # responses: row r's token t at column start[r] + t of its group's row, segment = its rank + 1
    r_rows, r_cols = resp_mask.nonzero(as_tuple=True)
    r_dest = start[r_rows] + r_cols
    member = torch.zeros(b, dtype=torch.long)
    member[order] = rows - torch.searchsorted(group[order], group[order])
    out_ids[group[r_rows], r_dest] = ids[r_rows, prompt_width + r_cols]
    out_pos[group[r_rows], r_dest] = pos[r_rows, prompt_width + r_cols]
    out_seg[group[r_rows], r_dest] = member[r_rows] + 1
    # Token t of a response is predicted by the state before it: the prompt's last token for
    # t = 0, the response's own token t - 1 after that; past the response's end, the prompt's last
    # token again (any valid state: response_mask drops those positions downstream).
    resp_width = max(1, int(resp_len.max()))
    t = torch.arange(resp_width)[None]  # (1, w)
    last_prompt = (group * width + group_prompt[group] - 1)[:, None]  # (b, 1)
    inside = (t >= 1) & (t < resp_len[:, None])
    index = torch.where(inside, (group * width + start)[:, None] + t - 1, last_prompt)
    out = dict(micro)
    out.update(
        input_ids=out_ids,
        attention_mask=(out_seg >= 0).to(micro["attention_mask"].dtype),
        position_ids=out_pos,
        segment_ids=out_seg,
        _response_index=index,
    )
    return out


def packed_outputs(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[G, W, ...]`` model outputs of a packed micro-batch -> ``[b, w, ...]`` per row and response
    token (``index`` is the micro-batch's ``_response_index``)."""
    return output.reshape(-1, *output.shape[2:])[index]
