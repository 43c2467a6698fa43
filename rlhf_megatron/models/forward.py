"""Forward passes over megatron model chunks, and log-probs/entropy over vocab-parallel logits.

The primitives the actor, critic and reference workers build on:

- ``build_attention_mask``: the 4-D boolean mask megatron's attention takes
  (causal + padding, optional sliding window). Callers never rely on
  megatron's default mask, which hard-codes CUDA and ignores padding.
- ``model_forward``: one chunk, one micro-batch; for use inside a
  ``forward_step_func`` of megatron's pipeline schedules. Chunks built with
  ``causal_rows`` (fused attention; on CUDA from 8K-token micro-batches) get contiguous
  rows rolled to column 0 and no mask, so the causal kernels run (``causal_rows.py``).
- ``forward_logits_or_values``: a whole forward-only pass through megatron's
  schedule (any TP/PP/VPP), returning the last stage's output.
- ``vocab_parallel_log_probs`` / ``vocab_parallel_entropy``: per-token
  log-probs and entropy from each TP rank's vocabulary shard of the logits,
  with all-reduces of ``[B, S]`` statistics only: the full vocabulary is never
  gathered. Both are differentiable.

Megatron's rotary embedding uses positions ``0..S-1`` for every row whatever
``position_ids`` say. With left padding (RL prompts) a row's valid tokens
then sit at positions shifted by the pad count; RoPE scores depend only on
position *differences*, so attention among valid tokens is unchanged
(equal to HF with ``position_ids`` from the mask, up to float rounding).
M-RoPE (vision-language models) does use ``position_ids``: ``[B, 3, S]``
batch-first as in ``Batch`` (``data.rope_index.get_rope_index``), transposed
here to megatron's ``[3, B, S]``, so left padding is handled exactly.

Mixture-of-experts chunks also get the padding mask (``padding_mask``, True =
padding), so padding tokens count neither in the load-balancing loss nor in the
expert load; and forward-only passes run them in eval mode (``moe.eval_mode``).

Multimodal inputs: ``pixel_values`` ``[num_patches, C·T·P·P]`` and
``image_grid_thw`` ``[num_images, 3]`` (videos: ``pixel_values_videos``,
``video_grid_thw`` and ``second_per_grid_ts``), concatenated over the batch's rows in
row order; ``forward_logits_or_values`` hands each micro-batch its rows' images
(``multimodal.select_rows``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlhf_megatron.models.causal_rows import causal_shifts, is_last_stage, roll_rows, takes_causal_rows

__all__ = [
    "build_attention_mask",
    "forward_logits_or_values",
    "model_forward",
    "position_ids_from_mask",
    "vocab_parallel_entropy",
    "vocab_parallel_log_probs",
    "vocab_parallel_log_probs_at",
]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` padding mask (1 = token) -> ``[B, S]`` positions counted from each row's first token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_attention_mask(
    attention_mask: torch.Tensor,
    sliding_window: int | None = None,
    segment_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, S]`` padding mask (True/1 = token) -> ``[B, 1, S, S]`` bool, True = masked out.

    Query ``i`` may attend to key ``j`` when ``j <= i``, ``j`` is a token, and
    (with a window) ``i - j < sliding_window``. Every query also sees itself,
    so padding rows are never empty (an all-masked row gives NaNs in some
    attention kernels, and NaN * 0 is still NaN in a masked loss).

    Packed rows (``data.packing``): ``segment_ids`` ``[B, S]`` (0 = the shared prompt, k = the
    k-th response, -1 = padding) also keep a response from seeing any other response, and the
    window is measured in ``position_ids`` rather than columns.
    """
    valid = attention_mask.bool()
    seq = valid.shape[1]
    i = torch.arange(seq, device=valid.device)[:, None]
    j = torch.arange(seq, device=valid.device)[None, :]
    allowed = (j <= i)[None]
    if segment_ids is not None:
        seg_q, seg_k = segment_ids[:, :, None], segment_ids[:, None, :]
        allowed = allowed & ((seg_k == 0) | (seg_k == seg_q))
    if sliding_window is not None:
        if position_ids is not None and segment_ids is not None:
            allowed = allowed & (position_ids[:, :, None] - position_ids[:, None, :] < sliding_window)
        else:
            allowed = allowed & (i - j < sliding_window)[None]
    allowed = (allowed & valid[:, None, :]) | torch.eye(seq, dtype=torch.bool, device=valid.device)[None]
    return ~allowed[:, None]  # (B, 1, S, S)


def model_forward(
    chunk: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    *,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """One chunk on one micro-batch (inside a megatron ``forward_step_func``).

    ``position_ids``: ``[B, S]``, or ``[B, 3, S]`` M-RoPE positions for a
    vision-language chunk (computed from the tokens and grids when None; text
    positions are repeated over the three streams). ``pixel_values`` /
    ``image_grid_thw``: this micro-batch's images (vision-language only);
    ``pixel_values_videos`` / ``video_grid_thw`` / ``second_per_grid_ts`` its videos.
    ``segment_ids``: ``[B, S]`` of a packed micro-batch (``data.packing``; text only).

    Returns what the chunk returns: on the last stage logits ``[B, S, V_pad/tp]``
    (this TP rank's vocabulary shard) or values ``[B, S, 1]``; elsewhere the
    hidden states sent to the next stage.
    """
    from rlhf_megatron.models.moe import has_experts
    from rlhf_megatron.models.vision_language import vision_language_model

    vl = vision_language_model(chunk)
    if vl is None:
        if (
            pixel_values is not None
            or pixel_values_videos is not None
            or (position_ids is not None and position_ids.dim() != 2)
        ):
            raise ValueError(
                "model_forward: images, videos or [B, 3, S] M-RoPE positions were given to a text-only model"
            )
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        shifts = _causal_shifts(chunk, attention_mask, sliding_window, segment_ids)
        if shifts is not None:  # contiguous rows: rolled to start at column 0, no mask (causal_rows.py)
            input_ids, attention_mask, position_ids = (
                roll_rows(t, shifts) for t in (input_ids, attention_mask, position_ids)
            )
            mask = None
        else:
            mask = build_attention_mask(attention_mask, sliding_window, segment_ids, position_ids)
        if has_experts(chunk):
            out = chunk(input_ids, position_ids, mask, padding_mask=_moe_padding_mask(chunk, attention_mask))
        else:
            out = chunk(input_ids, position_ids, mask)
        return roll_rows(out, shifts, back=True) if shifts is not None and is_last_stage(chunk) else out
    mask = build_attention_mask(attention_mask, sliding_window, segment_ids, position_ids)
    position_ids = _mrope_positions(
        vl,
        input_ids,
        attention_mask,
        position_ids,
        pixel_values,
        image_grid_thw,
        pixel_values_videos,
        video_grid_thw,
        second_per_grid_ts,
    )
    pos = position_ids.transpose(0, 1).contiguous()  # (3, B, S), megatron's layout
    return chunk(
        input_ids,
        pos,
        mask,
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        pixel_values_videos=pixel_values_videos,
        video_grid_thw=video_grid_thw,
    )


def _causal_shifts(
    chunk: torch.nn.Module,
    attention_mask: torch.Tensor,
    sliding_window: int | None,
    segment_ids: torch.Tensor | None,
) -> list[int] | None:
    """The rows' shifts when ``chunk`` takes a micro-batch this large without a mask and causality
    alone is exact for it (no packed segments, no window shorter than the rows); else None."""
    if not takes_causal_rows(chunk, attention_mask.numel()) or segment_ids is not None:
        return None
    if sliding_window is not None and sliding_window < attention_mask.shape[1]:
        return None
    return causal_shifts(attention_mask)


def _moe_padding_mask(chunk: torch.nn.Module, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool, True = padding: megatron's MoE routers leave these tokens out of the
    load-balancing loss. With sequence parallelism megatron splits it along the sequence on
    the first pipeline stage only; later stages get their split here."""
    padding = ~attention_mask.bool()
    inner = chunk
    while hasattr(inner, "module"):
        inner = inner.module
    if inner.config.sequence_parallel and not inner.pre_process:
        from megatron.core import tensor_parallel

        padding = (
            tensor_parallel.scatter_to_sequence_parallel_region(padding.t().contiguous()).t().contiguous()
        )
    return padding


def _mrope_positions(
    vl,
    input_ids,
    attention_mask,
    position_ids,
    pixel_values,
    image_grid_thw,
    pixel_values_videos=None,
    video_grid_thw=None,
    second_per_grid_ts=None,
) -> torch.Tensor:
    """``[B, 3, S]`` positions for a vision-language model."""
    if position_ids is None:
        from rlhf_megatron.data.rope_index import get_rope_index

        return get_rope_index(
            input_ids,
            attention_mask,
            image_grid_thw,
            image_token_id=vl.image_token_id,
            spatial_merge_size=vl.spatial_merge_size,
            video_grid_thw=video_grid_thw,
            video_token_id=vl.video_token_id,
            second_per_grid_ts=second_per_grid_ts,
            tokens_per_second=vl.tokens_per_second,
            frames_apart=vl.frames_apart,
        )
    if position_ids.dim() == 3:
        return position_ids
    if pixel_values is not None or pixel_values_videos is not None:
        raise ValueError(
            "model_forward: a batch with images or videos needs M-RoPE position_ids [B, 3, S] "
            "(data.rope_index.get_rope_index), not [B, S] text positions"
        )
    return position_ids[:, None].expand(-1, 3, -1)  # text only: the three streams coincide


def forward_logits_or_values(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    micro_batch_size: int | None = None,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Forward-only pass over all pipeline stages; the output on the last stage, None elsewhere.

    ``input_ids``/``attention_mask``: ``[B, S]`` on every rank of the
    model-parallel group; ``position_ids`` ``[B, S]`` or ``[B, 3, S]`` (M-RoPE).
    ``pixel_values``/``image_grid_thw``: the batch's images, rows in order
    (vision-language models); ``pixel_values_videos``/``video_grid_thw``/
    ``second_per_grid_ts`` its videos. Returns, on the last pipeline stage:

    - LM head: logits ``[B, S, V_pad / tp]``, this TP rank's vocabulary shard
      (feed it to ``vocab_parallel_log_probs``/``vocab_parallel_entropy``);
    - value/reward head: values ``[B, S]``, the same on every TP rank.

    ``sliding_window``: pass ``arch.sliding_window`` (Mistral v0.1).
    ``micro_batch_size`` defaults to the whole batch (with VPP, to the batch
    split into as many micro-batches as pipeline stages).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = list(model) if isinstance(model, Sequence) else [model]
    batch, seq = input_ids.shape
    visuals = {
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
        "pixel_values_videos": pixel_values_videos,
        "video_grid_thw": video_grid_thw,
        "second_per_grid_ts": second_per_grid_ts,
    }
    row_images = _row_images(chunks[0], input_ids, visuals)
    if position_ids is None and row_images is not None:
        position_ids = _mrope_positions(row_images[0], input_ids, attention_mask, None, **visuals)
    elif position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if micro_batch_size is None:
        micro_batch_size = batch // pp if len(chunks) > 1 and batch % pp == 0 else batch
    if batch % micro_batch_size:
        raise ValueError(f"batch size {batch} is not a multiple of micro_batch_size {micro_batch_size}")
    num_micro = batch // micro_batch_size
    if len(chunks) > 1 and num_micro < pp:
        raise ValueError(
            f"the interleaved (VPP) schedule needs at least PP={pp} micro-batches, got {num_micro}; "
            "use a smaller micro_batch_size or a larger batch"
        )
    micro = []
    for k in range(0, batch, micro_batch_size):
        rows = range(k, min(k + micro_batch_size, batch))
        micro.append(
            (
                input_ids[k : rows.stop],
                attention_mask[k : rows.stop],
                position_ids[k : rows.stop],
                _select_visuals(visuals, row_images, rows),
            )
        )

    def step(data_iter, chunk):
        ids, mask, pos, chosen = next(data_iter)
        out = model_forward(chunk, ids, mask, pos, sliding_window, **chosen)
        # The schedule hands what the loss function returns to the caller on the last stage.
        return out, lambda output: (output.new_zeros(()), {"output": output.detach()})

    from rlhf_megatron.models.moe import eval_mode, has_experts

    mode = eval_mode(chunks) if has_experts(chunks[0]) else contextlib.nullcontext()
    with torch.no_grad(), mode:
        collected = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=num_micro,
            seq_length=seq,
            micro_batch_size=micro_batch_size,
            forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage():
        return None
    out = torch.cat([c["output"] for c in collected], dim=0)
    return out.squeeze(-1) if out.shape[-1] == 1 and _is_scalar_head(chunks[-1]) else out


def _row_images(chunk, input_ids, visuals: dict):
    """For a vision-language model: ``(the model, each row's image range, each row's video range)``,
    checked; else None."""
    from rlhf_megatron.models.multimodal import check_pixel_values, images_per_row
    from rlhf_megatron.models.vision_language import vision_language_model

    vl = vision_language_model(chunk)
    if vl is None:
        if visuals["pixel_values"] is not None or visuals["pixel_values_videos"] is not None:
            raise ValueError("forward_logits_or_values: images or videos were given to a text-only model")
        return None
    merge = vl.spatial_merge_size
    images = images_per_row(input_ids, visuals["image_grid_thw"], vl.image_token_id, merge)
    if visuals["pixel_values"] is not None:
        check_pixel_values(visuals["pixel_values"], visuals["image_grid_thw"], vl.patch_dim)
    videos = None
    if vl.video_token_id is not None:
        videos = images_per_row(input_ids, visuals["video_grid_thw"], vl.video_token_id, merge, "video")
        if visuals["pixel_values_videos"] is not None:
            check_pixel_values(
                visuals["pixel_values_videos"], visuals["video_grid_thw"], vl.patch_dim, "video"
            )
    return vl, images, videos


def _select_visuals(visuals: dict, row_images, rows: range) -> dict:
    """The images and videos of rows ``rows`` (a micro-batch), as ``model_forward``'s keywords."""
    if row_images is None:
        return {}
    from rlhf_megatron.models.multimodal import select_rows

    _, images, videos = row_images
    pixels, grids = select_rows(visuals["pixel_values"], visuals["image_grid_thw"], images, rows)
    chosen = {"pixel_values": pixels, "image_grid_thw": grids}
    if videos is not None and visuals["video_grid_thw"] is not None:
        pixels, grids = select_rows(visuals["pixel_values_videos"], visuals["video_grid_thw"], videos, rows)
        chosen.update(pixel_values_videos=pixels, video_grid_thw=grids)
        seconds = visuals["second_per_grid_ts"]
        if seconds is not None and grids is not None:
            first, end = videos[rows[0]][0], videos[rows[-1]][1]
            chosen["second_per_grid_ts"] = seconds[first:end]
    return chosen


def _is_scalar_head(chunk: torch.nn.Module) -> bool:
    from rlhf_megatron.models.heads import ScalarHead

    inner = chunk
    while hasattr(inner, "module"):  # DDP / Float16Module wrappers
        inner = inner.module
    inner = getattr(inner, "language_model", inner)  # a vision-language chunk's GPTModel
    return isinstance(getattr(inner, "output_layer", None), ScalarHead)


# -- vocab-parallel statistics -------------------------------------------------


def _tp_group(group):
    if group is not None:
        return group
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


# fp32 elements of one chunk of rows in the loss functions below (128 MiB): their float32
# temporaries are a few chunks, not a few copies of the whole [tokens, vocab] logits.
CHUNK_ELEMENTS = 32 * 2**20


def _blocks(logits: torch.Tensor, chunk_elements: int) -> list[tuple[slice, slice]]:
    """``(rows, positions)`` blocks of ``[B, S, V]`` logits with about ``chunk_elements`` logits
    each: whole rows while a row fits, else pieces of one row (views, no copies)."""
    batch, seq, local = logits.shape
    step = max(1, chunk_elements // max(local, 1))
    if step >= seq:
        rows = step // seq
        return [(slice(b, min(b + rows, batch)), slice(0, seq)) for b in range(0, batch, rows)]
    return [
        (slice(b, b + 1), slice(i, min(i + step, seq))) for b in range(batch) for i in range(0, seq, step)
    ]


def _with_dims(t: torch.Tensor, dims: int) -> torch.Tensor:
    """``t`` with leading dimensions folded or added so that it has ``dims`` dimensions (the loss
    functions work on ``[B, S, V]`` logits and ``[B, S]`` labels)."""
    if t.dim() == dims:
        return t
    if t.dim() < dims:
        return t.reshape((1,) * (dims - t.dim()) + tuple(t.shape))
    return t.reshape(-1, *t.shape[t.dim() - dims + 1 :])


def _masked_fp32(block: torch.Tensor, start: int, vocab_size: int | None) -> torch.Tensor:
    """``block`` in fp32 with Megatron's padded vocabulary columns at -inf (they are not tokens;
    HF's softmax has no such entries)."""
    z = block.float()
    local = block.shape[-1]
    if vocab_size is not None and start + local > vocab_size:
        if z.data_ptr() == block.data_ptr():
            z = z.clone()
        z[..., max(vocab_size - start, 0) :] = float("-inf")
    return z


def _shifted_and_lse(z: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(z - zmax, zmax, log Σ exp(z - zmax))`` with ``zmax`` and the sum over every TP shard."""
    zmax = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
    shifted = z - zmax.unsqueeze(-1)
    sum_exp = _all_reduce(shifted.exp().sum(dim=-1), dist.ReduceOp.SUM, group)
    return shifted, zmax, sum_exp.log()


def _log_probs_of(block: torch.Tensor, ctx, rows, cols) -> torch.Tensor:
    """fp32 log-softmax of a block of the saved logits, from the saved ``zmax`` and ``lse``."""
    z = _masked_fp32(block, ctx.start, ctx.vocab_size)
    return (z - ctx.zmax[rows, cols].unsqueeze(-1)) - ctx.lse[rows, cols].unsqueeze(-1)


def _shard_start(logits: torch.Tensor, group) -> int:
    return (dist.get_rank(group) if group is not None else 0) * logits.shape[-1]


class _VocabParallelLogProb(torch.autograd.Function):
    """Block by block (``_blocks``): forward keeps each position's max and log-sum-exp (and the
    logits it was given); backward recomputes the softmax block by block into the gradient."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_size, group, chunk_elements):
        x, y = _with_dims(logits, 3), _with_dims(labels, 2)
        start, local = _shard_start(logits, group), logits.shape[-1]
        out = torch.empty(y.shape, dtype=torch.float32, device=logits.device)
        zmax, lse = torch.empty_like(out), torch.empty_like(out)
        for rows, cols in _blocks(x, chunk_elements):
            shifted, zmax[rows, cols], lse[rows, cols] = _shifted_and_lse(
                _masked_fp32(x[rows, cols], start, vocab_size), group
            )
            idx = y[rows, cols] - start
            mine = (idx >= 0) & (idx < local)  # this shard holds the label's column
            picked = shifted.gather(-1, idx.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
            picked = _all_reduce(
                torch.where(mine, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group
            )
            out[rows, cols] = picked - lse[rows, cols]
        ctx.save_for_backward(logits, labels)
        ctx.zmax, ctx.lse = zmax, lse
        ctx.vocab_size, ctx.start, ctx.chunk_elements = vocab_size, start, chunk_elements
        return out.view(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        logits, labels = ctx.saved_tensors
        x, y, g_out = _with_dims(logits, 3), _with_dims(labels, 2), _with_dims(grad, 2)
        local = logits.shape[-1]
        grad_logits = torch.empty(x.shape, dtype=logits.dtype, device=logits.device)
        for rows, cols in _blocks(x, ctx.chunk_elements):
            g = g_out[rows, cols]
            # d log p_label / d z_k = 1[k = label] - p_k
            block = -_log_probs_of(x[rows, cols], ctx, rows, cols).exp() * g.unsqueeze(-1)
            idx = y[rows, cols] - ctx.start
            mine = (idx >= 0) & (idx < local)
            block.scatter_add_(-1, idx.clamp(0, local - 1).unsqueeze(-1), (mine * g).unsqueeze(-1))
            grad_logits[rows, cols] = block
        return grad_logits.view(logits.shape), None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """``H = -Σ p log p`` per position, block by block like ``_VocabParallelLogProb``."""

    @staticmethod
    def forward(ctx, logits, vocab_size, group, chunk_elements):
        x = _with_dims(logits, 3)
        start = _shard_start(logits, group)
        entropy = torch.empty(x.shape[:-1], dtype=torch.float32, device=logits.device)
        zmax, lse = torch.empty_like(entropy), torch.empty_like(entropy)
        for rows, cols in _blocks(x, chunk_elements):
            shifted, zmax[rows, cols], lse[rows, cols] = _shifted_and_lse(
                _masked_fp32(x[rows, cols], start, vocab_size), group
            )
            log_probs = shifted - lse[rows, cols].unsqueeze(-1)
            probs = log_probs.exp()
            # p·log p with p = 0 on padding columns (log p = -inf) counts as 0.
            plogp = torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs))
            entropy[rows, cols] = -_all_reduce(plogp.sum(-1), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(logits)
        ctx.zmax, ctx.lse, ctx.entropy = zmax, lse, entropy
        ctx.vocab_size, ctx.start, ctx.chunk_elements = vocab_size, start, chunk_elements
        return entropy.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        x, g_out = _with_dims(logits, 3), _with_dims(grad, 2)
        grad_logits = torch.empty(x.shape, dtype=logits.dtype, device=logits.device)
        for rows, cols in _blocks(x, ctx.chunk_elements):
            log_probs = _log_probs_of(x[rows, cols], ctx, rows, cols)
            probs = log_probs.exp()
            # dH/dz_k = -p_k (log p_k + H)
            entropy = ctx.entropy[rows, cols].unsqueeze(-1)
            inner = torch.where(probs > 0, log_probs + entropy, torch.zeros_like(log_probs))
            grad_logits[rows, cols] = -probs * inner * g_out[rows, cols].unsqueeze(-1)
        return grad_logits.view(logits.shape), None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    tp_group=None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """``log softmax(logits)[..., labels]`` from vocabulary-sharded logits, without gathering them.

    ``logits``: ``[B, S, V_pad/tp]``, this TP rank's contiguous vocabulary
    shard (rank ``r`` holds columns ``[r·V_pad/tp, (r+1)·V_pad/tp)``).
    ``labels``: ``[B, S]`` token ids (already shifted by the caller, e.g.
    ``input_ids[:, 1:]`` against ``logits[:, :-1]``). ``vocab_size``: the real
    vocabulary; columns beyond it (megatron's padding) are excluded from the
    softmax. Returns fp32 ``[B, S]``, identical on every TP rank.
    ``tp_group`` defaults to megatron's tensor-parallel group. Rows go through in chunks of
    about ``chunk_elements`` logits: the fp32 working set is a few chunks, and backward
    recomputes the softmax from the logits it keeps instead of holding fp32 probabilities.
    """
    return _VocabParallelLogProb.apply(logits, labels, vocab_size, _tp_group(tp_group), chunk_elements)


class _VocabParallelLogProbsAt(torch.autograd.Function):
    """``_VocabParallelLogProb`` at ``K`` ids per position (``[B, S, K]``) instead of one label: the
    student's log-probs at a teacher's top-k tokens. One softmax per position serves all ``K``."""

    @staticmethod
    def forward(ctx, logits, ids, vocab_size, group, chunk_elements):
        start, local = _shard_start(logits, group), logits.shape[-1]
        out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)  # (B, S, K)
        zmax = torch.empty(ids.shape[:-1], dtype=torch.float32, device=logits.device)  # (B, S)
        lse = torch.empty_like(zmax)
        for rows, cols in _blocks(logits, chunk_elements):
            shifted, zmax[rows, cols], lse[rows, cols] = _shifted_and_lse(
                _masked_fp32(logits[rows, cols], start, vocab_size), group
            )
            idx = ids[rows, cols] - start  # (b, s, K)
            mine = (idx >= 0) & (idx < local)
            picked = shifted.gather(-1, idx.clamp(0, local - 1))
            picked = _all_reduce(
                torch.where(mine, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group
            )
            out[rows, cols] = picked - lse[rows, cols].unsqueeze(-1)
        ctx.save_for_backward(logits, ids)
        ctx.zmax, ctx.lse = zmax, lse
        ctx.vocab_size, ctx.start, ctx.chunk_elements = vocab_size, start, chunk_elements
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, ids = ctx.saved_tensors
        local = logits.shape[-1]
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for rows, cols in _blocks(logits, ctx.chunk_elements):
            g = grad[rows, cols]  # (b, s, K)
            # d sum_k g_k log p_{id_k} / d z_v = sum_k g_k 1[v = id_k] - p_v sum_k g_k
            block = -_log_probs_of(logits[rows, cols], ctx, rows, cols).exp() * g.sum(-1, keepdim=True)
            idx = ids[rows, cols] - ctx.start
            mine = (idx >= 0) & (idx < local)
            block.scatter_add_(-1, idx.clamp(0, local - 1), (mine * g).to(block.dtype))
            grad_logits[rows, cols] = block
        return grad_logits, None, None, None, None


def vocab_parallel_log_probs_at(
    logits: torch.Tensor,
    ids: torch.Tensor,
    vocab_size: int | None = None,
    tp_group=None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """``log softmax(logits)`` at ``ids`` ``[B, S, K]`` (K token ids per position) from
    vocabulary-sharded ``[B, S, V_pad/tp]`` logits, as ``vocab_parallel_log_probs`` does for one
    label: fp32 ``[B, S, K]``, identical on every TP rank, differentiable."""
    if logits.dim() != 3 or ids.dim() != 3 or ids.shape[:2] != logits.shape[:2]:
        raise ValueError(
            f"vocab_parallel_log_probs_at: logits {tuple(logits.shape)} must be [B, S, V] and ids "
            f"{tuple(ids.shape)} [B, S, K] over the same positions"
        )
    return _VocabParallelLogProbsAt.apply(logits, ids, vocab_size, _tp_group(tp_group), chunk_elements)


def vocab_parallel_entropy(
    logits: torch.Tensor, vocab_size: int | None = None, tp_group=None, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position, ``[B, S]`` fp32, from vocabulary-sharded logits.

    Same sharding conventions as ``vocab_parallel_log_probs``.
    """
    return _VocabParallelEntropy.apply(logits, vocab_size, _tp_group(tp_group), chunk_elements)
