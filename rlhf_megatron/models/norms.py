"""Sequence parallelism with megatron's local (pure PyTorch) layers, for CPU.

Megatron's local layer spec builds its norms through ``WrappedTorchNorm``, which refuses
``sequence_parallel``; every other local module (column/row parallel linears, the
embedding's scatter, the output layer's gather, the MoE dispatcher) supports it with plain
``torch.distributed`` collectives, which gloo has. A norm is per token, so splitting the
tokens over the TP ranks changes nothing but its weight's gradient, which each rank then
holds for its share of the tokens only: megatron sums the gradients of parameters marked
``sequence_parallel`` over the TP group (``finalize_model_grads``), as it does for
transformer-engine's norms. ``SequenceParallelTorchNorm`` is the torch norm with that mark;
``with_sequence_parallel_norms`` puts it into a local spec, including the final norm that
megatron adds to a block built from a layer spec.

With it the CPU runs the layout the GPU runs: MoE training at TP > 1 (which megatron allows
only with sequence parallelism) and TP > 1 dense roles with sequence parallelism on, as
verl's and this project's defaults have it.

Boundaries: megatron-core spec objects only; knows nothing of configs or roles.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

__all__ = ["SequenceParallelTorchNorm", "swap_module", "with_sequence_parallel_norms"]


class SequenceParallelTorchNorm:
    """``torch.nn.RMSNorm`` / ``LayerNorm`` as megatron's ``WrappedTorchNorm`` builds them, with
    ``weight.sequence_parallel = config.sequence_parallel`` (and the bias's) so the TP ranks'
    partial gradients are summed."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError(
                "torch norms support neither zero-centered gamma nor memory-efficient layer norm"
            )
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"normalization {config.normalization!r}: only RMSNorm and LayerNorm are supported"
            )
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def swap_module(obj, old: type, new: type):
    """``obj`` (a layer or block spec, in place) with every module class ``old`` replaced by ``new``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if obj is old:
        return new
    if isinstance(obj, ModuleSpec):
        if obj.module is old:
            obj.module = new
        obj.submodules = swap_module(obj.submodules, old, new)
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            setattr(obj, field.name, swap_module(getattr(obj, field.name), old, new))
        return obj
    if isinstance(obj, list):
        return [swap_module(item, old, new) for item in obj]
    return obj


def with_sequence_parallel_norms(spec, config, vp_stage: int | None, pp_rank: int):
    """A copy of a local layer or block ``spec`` whose torch norms support sequence parallelism.
    A layer spec becomes the block megatron would build from it (this stage's layers plus the
    final norm), so that norm is swapped too."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    spec = copy.deepcopy(spec)
    if isinstance(spec, ModuleSpec) and issubclass(spec.module, BaseTransformerLayer):
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config, vp_stage, pp_rank),
            layer_norm=WrappedTorchNorm,
        )
    return swap_module(spec, WrappedTorchNorm, SequenceParallelTorchNorm)
