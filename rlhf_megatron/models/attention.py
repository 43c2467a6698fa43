"""Core attention through torch's ``scaled_dot_product_attention`` (``megatron.attention_backend=sdpa``).

megatron-core's local layers compute attention unfused (``DotProductAttention``): the scores
of every head as one ``[b * heads, s, s]`` matrix product, the mask written into them, a
softmax, a second product, each a full pass over the scores, and backward keeps the softmax.
At a few dozen tokens that is a few percent of a layer; at ~1,100 tokens (seed 000's prompts
with their 1,024-token answers) it is two thirds of a forward pass on CPU. ``SDPAttention``
is the same module (same constructor, attributes, inputs and output layout) with those steps
done by one fused torch call, which goes through the scores in blocks and keeps only each
row's log-sum-exp for backward. The mask is the one ``models.forward.build_attention_mask``
builds (causality, left padding, shared-prompt segments, a sliding window), so every layout
the local attention supports gives the same outputs up to float rounding; or no mask at all
(``is_causal``) for micro-batches of contiguous rows (``models.causal_rows``). On an H200 with
torch 2.11 both run cuDNN's fused attention, the causal one 2.6x faster than the masked one
(forward + backward of 2 x 2048 tokens, 32 query / 8 KV heads: 0.45 against 1.16 ms,
``docs/gpu_h200_mfu_steps.json``).

Megatron features with no SDPA equivalent here (attention dropout, an off-by-one or learned
softmax offset, query-key layer scaling, a ``window_size`` given to megatron instead of the
mask, attention bias, THD packed sequences) are refused when the module is built or called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = ["LatentSDPAttention", "SDPAttention"]


class SDPAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` computed by ``F.scaled_dot_product_attention``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        unsupported = [
            name
            for name, used in (
                ("attention_dropout", self.attention_dropout.p > 0),
                ("softmax_type", self.config.softmax_type != "vanilla"),
                ("apply_query_key_layer_scaling", self.config.apply_query_key_layer_scaling),
                ("window_size", self.config.window_size is not None),
            )
            if used
        ]
        if unsupported:
            raise ValueError(
                f"megatron.attention_backend=sdpa does not support the transformer config's "
                f"{', '.join(unsupported)}; set the role's megatron.attention_backend=local"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``[s, b, heads, d]`` query and ``[s, b, groups, d]`` key/value (this TP rank's heads),
        megatron's ``[b, 1, s, s]`` boolean mask (True = masked out) -> ``[s, b, heads * d]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                "megatron.attention_backend=sdpa takes neither packed (THD) sequences nor an attention "
                "bias; set the role's megatron.attention_backend=local"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        mask_type = attn_mask_type or self.attn_mask_type
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None and mask_type == AttnMaskType.causal,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        s, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


class _LatentWidths:
    """What multi-latent attention's core attention takes beyond megatron-core's: queries/keys of
    ``k_channels`` per head (``[nope | rope]``) and values of ``v_channels``. Only the output's
    width (heads x ``v_channels``) depends on them; the scores use the query/key width through
    the softmax scale MLA passes."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels


class LatentDotProductAttention(_LatentWidths, DotProductAttention):
    """megatron-core's local ``DotProductAttention`` for multi-latent attention.

    MLA hands its core attention queries/keys of ``k_channels`` (``[nope | rope]``) and values of
    ``v_channels`` per head, plus its own softmax scale (YaRN's mscale included); megatron-core 0.16's
    local attention takes neither width (only transformer-engine's does). The math needs no change:
    the scores use the query/key width through the given scale, and only the output's width
    (heads x ``v_channels``) differs from ``kv_channels x heads``.
    """


class LatentSDPAttention(_LatentWidths, SDPAttention):
    """``SDPAttention`` for multi-latent attention (``megatron.attention_backend=sdpa``): queries and
    keys of ``k_channels`` per head, values of ``v_channels``, MLA's own softmax scale (as
    ``LatentDotProductAttention``). ``F.scaled_dot_product_attention`` takes a value width apart
    from the query/key width, so only the output's width changes; the scores never exist whole,
    where the local module keeps ``[b * heads, s, s]`` of them for backward."""
