"""Scalar heads for critics and reward models, in place of megatron's vocabulary output layer.

A critic (``head="value"``) and a reward model (``head="reward"``) are the
same ``GPTModel`` body with ``output_layer`` swapped for ``ScalarHead``: one
output per token instead of one per vocabulary entry. The head is small, so
it is *not* split over tensor-parallel ranks: every TP rank holds the whole
``[1, hidden]`` weight and computes the same values, which keeps the output
independent of the TP layout and lets megatron's checkpointing treat it as an
ordinary replicated tensor (``output_layer.weight``/``output_layer.bias``).

``GPTModel`` calls ``output_layer(hidden, weight=..., runtime_gather_output=...)``
and expects ``(output, bias)`` back; ``ScalarHead`` keeps that call signature,
so the rest of ``GPTModel.forward`` (and the pipeline schedules) are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig

__all__ = ["ScalarHead", "attach_scalar_head"]


class ScalarHead(torch.nn.Module):
    """``[s, b, h] -> [s, b, 1]``, replicated over TP ranks.

    With sequence parallelism the hidden states arrive split along the
    sequence, so they are gathered first. The backward of that gather is a
    plain split (``tensor_parallel_output_grad=False``): every TP rank computes
    the same loss on the same full sequence, so its gradient is already whole
    and summing across ranks would count it ``tp`` times.
    """

    def __init__(self, config: TransformerConfig, bias: bool, device: torch.device, seed: int = 0):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.weight = torch.nn.Parameter(
            torch.empty(1, config.hidden_size, dtype=config.params_dtype, device=device)
        )
        self.bias = (
            torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device)) if bias else None
        )
        # Same initial values on every rank: the head is replicated, so it must
        # not draw from megatron's per-TP-rank RNG stream.
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=g) * config.init_method_std)

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight, self.bias), None


def attach_scalar_head(model: torch.nn.Module, bias: bool, seed: int = 0) -> ScalarHead:
    """Replace a last-stage ``GPTModel``'s ``output_layer`` by a ``ScalarHead``."""
    if not getattr(model, "post_process", False):
        raise ValueError(
            "attach_scalar_head: only the last pipeline stage (post_process=True) has an output layer"
        )
    if model.share_embeddings_and_output_weights:
        raise ValueError("attach_scalar_head: build the model with share_embeddings_and_output_weights=False")
    device = next(model.parameters()).device
    head = ScalarHead(model.config, bias=bias, device=device, seed=seed)
    model.output_layer = head
    return head
