"""megatron's ``GPTModel`` with rotary embeddings taken at ``position_ids``, as HF and vLLM take them.

megatron-core's ``GPTModel`` (``position_embedding_type="rope"``) rotates the token in column
``s`` by position ``s``, whatever ``position_ids`` say. A left-padded row then has its tokens at
positions shifted by its padding; attention scores depend only on position differences, so that
is exact up to float rounding, but a packed row (``data.packing``: one prompt, then each of its
responses restarting at the prompt's length) needs the real positions. ``GPTModelWithPositions``
keeps megatron's table of rotary angles for positions ``0..S-1`` and gathers it per row at
``position_ids`` ``[B, S]``: ``[S, B, 1, D]`` angles, which megatron's (unfused) rotary
application broadcasts over the heads as it does for M-RoPE. Every position id is below the
width ``S`` in the rows this project builds (left padding, packing), so the table covers them.

Context parallelism splits the table along the sequence; there the model falls back to
megatron's own columns (the project packs nothing under CP). M-RoPE (vision-language) and
inference contexts go through megatron unchanged, except that Qwen3-VL's interleaved M-RoPE
(``interleave_mrope``) replaces megatron's consecutive sections.

Boundaries: a model class; knows megatron, not the workers.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding,
    get_pos_emb_on_this_cp_rank,
)
from megatron.core.models.gpt import GPTModel

__all__ = ["GPTModelWithPositions", "InterleavedMultimodalRotaryEmbedding", "interleave_mrope"]


class GPTModelWithPositions(GPTModel):
    """``GPTModel`` whose RoPE follows ``position_ids`` (see the module docstring)."""

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        table = out[1]
        if (
            table is None
            or position_ids is None
            or position_ids.dim() != 2
            or self.position_embedding_type != "rope"
            or self.config.context_parallel_size > 1
            or kwargs.get("inference_context") is not None
        ):
            return out
        # table: [S, 1, 1, D] angles of positions 0..S-1 -> [S, B, 1, D] at each row's positions
        angles = table[position_ids.t().to(table.device)].squeeze(2)
        return (out[0], angles, *out[2:])


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """Qwen3-VL's M-RoPE: frequency pair ``j`` rotates by the height position when ``j % 3 == 1``
    and ``j < 3 x section[1]``, by the width position when ``j % 3 == 2`` and ``j < 3 x
    section[2]``, by the time position otherwise (megatron's parent: consecutive sections)."""

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
        seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = seq[..., None].float() * self.inv_freq.float()  # (3, B, S, D / 2)
        pair = torch.arange(freqs.shape[-1], device=freqs.device)
        stream = torch.zeros_like(pair)
        stream[(pair % 3 == 1) & (pair < 3 * mrope_section[1])] = 1
        stream[(pair % 3 == 2) & (pair < 3 * mrope_section[2])] = 2
        picked = freqs.gather(0, stream.expand_as(freqs[:1]))[0]  # (B, S, D / 2)
        emb = torch.cat((picked, picked), dim=-1)[..., None, :].transpose(0, 1).contiguous()  # (S, B, 1, D)
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb


def interleave_mrope(model: GPTModel) -> None:
    """Switch ``model``'s M-RoPE to Qwen3-VL's interleaved layout (its frequencies stay)."""
    if not isinstance(model.rotary_pos_emb, MultimodalRotaryEmbedding) or model.config.rotary_interleaved:
        raise ValueError("interleaved M-RoPE needs a GPTModel built with position_embedding_type='mrope'")
    model.rotary_pos_emb.__class__ = InterleavedMultimodalRotaryEmbedding
