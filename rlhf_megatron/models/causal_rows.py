"""Rows that plain causal attention computes exactly, so that fused attention can drop the mask.

torch's flash-attention kernel, the fastest of ``scaled_dot_product_attention``'s on a GPU, takes
no mask: only ``is_causal``. With an explicit ``[B, 1, S, S]`` mask torch falls back to its
memory-efficient kernel, or to the unfused math path when K and V have fewer heads than Q (GQA).
The mask ``forward.build_attention_mask`` builds is causal + padding. A row whose tokens form one
contiguous run (a left-padded prompt, its response, right padding: what rollouts make) needs
nothing beyond causality once that run starts at column 0: each token's keys are then the tokens
before it, and the padding comes after every token. So a micro-batch whose rows are all
contiguous is rolled left row by row by its leading padding, run without a mask (``is_causal``),
and the last stage's output is rolled back. Positions travel with their tokens
(``gpt.GPTModelWithPositions`` takes RoPE at ``position_ids``), so the valid tokens' outputs are
those of the masked pass up to float rounding; padding positions' outputs differ (every loss
masks them out).

Where it applies: chunks built with ``causal_rows`` (``builder.build_gpt_model``: core attention
``sdpa``, text-only, no context parallelism), micro-batches of at least the chunk's threshold in
tokens (rows x columns), without packed segments (``data.packing``: a response must not see its siblings) and
without a sliding window shorter than the rows. Anything else keeps the explicit mask.

Cost: one host sync per micro-batch (the shifts), and where some row has leading padding, a copy
of the inputs and of the last stage's output (and of its gradient in backward). The sync empties
the queue of GPU work the host had built up: on an H200 (``tools/gpu/mfu.py``) micro-batches of
4,096 tokens (2 rows of 2K) lost more to it than the faster attention saved (3-8% slower
updates), from 8,192 tokens on they gained (8% at 4 rows of 2K, 1.8x at one 16K row, 2.2x at
32K), hence the threshold.

Boundaries: tensors and megatron model chunks; knows nothing of configs or roles.
"""

from __future__ import annotations

import torch

__all__ = ["CAUSAL_ROWS_ATTR", "causal_shifts", "is_last_stage", "roll_rows", "takes_causal_rows"]

CAUSAL_ROWS_ATTR = "causal_rows_from"
"""Attribute of a model chunk whose attention runs mask-free on contiguous rows: the smallest
micro-batch (tokens: rows x columns) that does so (0: every one). Absent or None: never."""


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # megatron's DDP / Float16Module
        chunk = chunk.module
    return chunk


def takes_causal_rows(chunk: torch.nn.Module, tokens: int) -> bool:
    """Whether ``chunk`` (possibly wrapped in DDP) takes a micro-batch of ``tokens`` (rows x columns)
    of contiguous rows without a mask."""
    threshold = getattr(_unwrap(chunk), CAUSAL_ROWS_ATTR, None)
    return threshold is not None and tokens >= threshold


def is_last_stage(chunk: torch.nn.Module) -> bool:
    """Whether ``chunk`` produces the model's output (logits or values), batch-first."""
    return bool(getattr(_unwrap(chunk), "post_process", True))


def causal_shifts(attention_mask: torch.Tensor) -> list[int] | None:
    """``[B, S]`` padding mask (1 = token) -> each row's leading padding, or None when some row's
    tokens are not one contiguous run (then only the explicit mask is exact).

    A row without tokens counts as contiguous (shift 0). One host sync.
    """
    valid = attention_mask.bool()
    count = valid.sum(1)
    first = valid.int().argmax(1)  # the first token's column (0 for an empty row)
    col = torch.arange(valid.shape[1], device=valid.device)[None]
    run = (col >= first[:, None]) & (col < (first + count)[:, None])
    contiguous = (run == valid).all(1)
    flags, shifts = torch.stack([contiguous.long(), first.long()]).tolist()
    return shifts if all(flags) else None


def roll_rows(x: torch.Tensor, shifts: list[int], back: bool = False) -> torch.Tensor:
    """Row ``b`` of batch-first ``x`` ``[B, S, ...]`` rolled left by ``shifts[b]`` along dim 1
    (``back``: rolled right, undoing it). ``x`` itself when no row moves; otherwise one copy,
    differentiable (the gradient is rolled the other way)."""
    if not any(shifts):
        return x
    out = torch.empty_like(x)
    seq = x.shape[1]
    for b, s in enumerate(shifts):
        k = s % seq if back else (seq - s) % seq  # roll right by k: out[j] = x[j - k]
        out[b, k:] = x[b, : seq - k]
        out[b, :k] = x[b, seq - k :]
    return out
