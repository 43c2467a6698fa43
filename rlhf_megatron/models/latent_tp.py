"""Multi-latent attention's rotary key under tensor parallelism, without transformer-engine.

megatron-core 0.16's local MLA (``MLASelfAttention`` with a ``ColumnParallelLinear`` key/value
down-projection) splits ``[kv_lora_rank | qk_pos_emb_head_dim]`` over the TP ranks, all-gathers
it (``gather_from_tensor_model_parallel_region``) and cuts off the rotary key, which every query
head uses. Each rank holds only its own heads, so the rotary key's gradient on a rank is its
heads' share; the gather's backward keeps the rank's own columns of that gradient and drops the
rest. The other heads' share of the rotary key's gradient is lost: at TP=2 the down-projection's
gradient, and everything before it, differ from TP=1's (the forward pass is right).
transformer-engine's spec takes the other branch (a duplicated down-projection, the rotary key
gathered over the sequence, whose backward sums it) and is unaffected.

``sum_rotary_key_gradients`` tags the down-projection's output with the rotary key's width, and
the gather in megatron's MLA module becomes ``_GatherLatent`` for a tagged tensor: the same
all-gather forward; backward, the rotary key's columns summed over the TP group (the latent's
columns are already the same on every rank: their gradient went through ``linear_kv_up_proj``,
whose backward reduces it) before each rank keeps its slice.
"""

from __future__ import annotations

import torch

_ROTARY_COLUMNS = "_rlhf_rotary_key_columns"
"""Attribute on the down-projection's output: the width of the rotary key at its end."""


class _GatherLatent(torch.autograd.Function):
    """All-gather along the last dimension; backward: sum the last ``rotary`` columns over the
    group, then keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rotary: int, group) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import _gather_along_last_dim

        ctx.rotary, ctx.group = rotary, group
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from megatron.core.tensor_parallel.mappings import _split_along_last_dim

        rotary = grad[..., -ctx.rotary :].contiguous()
        torch.distributed.all_reduce(rotary, group=ctx.group)
        grad = torch.cat([grad[..., : -ctx.rotary], rotary], dim=-1)
        return _split_along_last_dim(grad, ctx.group), None, None


def _gather(input_: torch.Tensor, group=None) -> torch.Tensor:
    """``gather_from_tensor_model_parallel_region`` as megatron's MLA module calls it, summing the
    rotary key's gradient for a tensor ``_tag`` marked."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    rotary = getattr(input_, _ROTARY_COLUMNS, 0)
    if not rotary:
        return gather_from_tensor_model_parallel_region(input_, group)
    return _GatherLatent.apply(input_, rotary, get_tensor_model_parallel_group_if_none(group))


def _tag(module: torch.nn.Module, inputs, output):
    out = output[0] if isinstance(output, tuple) else output
    setattr(out, _ROTARY_COLUMNS, module.config.qk_pos_emb_head_dim)
    return output


def sum_rotary_key_gradients(model: torch.nn.Module) -> int:
    """Fix the rotary key's gradient in ``model``'s MLA layers whose key/value down-projection is
    split over TP (megatron's local spec at TP > 1); returns how many layers it applies to."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import multi_latent_attention as mla

    mla.gather_from_tensor_model_parallel_region = _gather  # the name the MLA module calls
    count = 0
    for module in model.modules():
        if not isinstance(module, mla.MLASelfAttention):
            continue
        down = module.linear_kv_down_proj
        if isinstance(down, ColumnParallelLinear) and down.tp_group.size() > 1:
            down.register_forward_hook(_tag)
            count += 1
    return count
