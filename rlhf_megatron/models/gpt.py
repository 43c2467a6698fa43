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
inference contexts go through megatron unchanged.

Boundaries: a model class; knows megatron, not the workers.
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel

__all__ = ["GPTModelWithPositions"]


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
