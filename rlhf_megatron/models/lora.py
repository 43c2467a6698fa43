"""LoRA adapters on megatron-core's parallel linears, in PEFT's format on the outside.

An adapter adds ``scale * B(A x)`` (``scale = alpha / rank``) to the output of one of a decoder
layer's four parallel linears. It lives on the linear as a child module (``linear.lora``) and is
applied by a forward hook, so the base weight keeps its name and layout: the HF loader, the
weight converter and dist-checkpointing see the model they always saw, plus parameters under
``*.lora.*``.

One adapter per HF module, as PEFT and vLLM hold them: megatron's fused linears carry one (A, B)
pair per HF projection they fuse (``linear_qkv``: q_proj, k_proj, v_proj; ``linear_fc1``:
gate_proj, up_proj), so an adapter imported from PEFT, exported to PEFT or served by vLLM is the
same numbers, whatever the parallel layout.

Tensor parallelism, exact for any TP (with or without sequence parallelism):

- Column-parallel base (``linear_qkv``, ``linear_fc1``: input whole, output split): A [r, in] is
  replicated, B [out/tp, r] is split like the base's output rows (fused QKV: whole query groups,
  interleaved back into megatron's [q; k; v]-per-group order). ``h = x A^T`` is made whole on
  every rank before B: an identity with an all-reduced gradient (no SP), or an all-gather over
  the sequence (SP; A's gradient is then a partial sum, all-reduced over TP by
  ``finalize_model_grads`` like the norms', through the ``sequence_parallel`` attribute).
- Row-parallel base (``linear_proj``, ``linear_fc2``: input split, output reduced): A [r, in/tp]
  is split like the base's input columns, B [out, r] is replicated; the rank-``r`` partial sums
  ``x_local A_local^T`` are all-reduced (no SP) or reduce-scattered over the sequence (SP; B's
  gradient then all-reduced as above). The collectives carry ``r`` columns, not ``hidden``.

Initialisation is PEFT's (A Kaiming-uniform, B zero), drawn for the whole tensor from a
generator seeded by the module's HF name and then sliced, so every layout starts from the same
adapters. Adapters hold fp32 parameters whatever the base's dtype (PEFT's ``autocast_adapter_dtype``):
a bf16 base stays bf16 and frozen while the adapters and their optimizer state are fp32.

Mixture-of-experts layers: their experts get no adapters (``all-linear`` leaves them out, naming
an expert projection is an error); attention and dense MLPs do. Vision-language models: not yet.

Boundaries: this module builds, switches and (de)serialises adapters; ``models.lora_io`` writes
and reads PEFT directories; the engine (``workers.megatron_engine``) decides when to attach them.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlhf_megatron.config.schema_model import LoraConfig
from rlhf_megatron.planning.lora_targets import (
    FUSED,
    LoraTargetError,
    hf_module_name,
    resolve_targets,
)
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = [
    "LoraTargetError",
    "adapter_modules",
    "adapters_disabled",
    "attach_lora",
    "full_adapter_tensors",
    "hf_module_name",
    "load_full_adapter_tensors",
    "lora_parameter_count",
    "peft_key",
    "peft_keys",
    "resolve_targets",
]


# ------------------------------------------------------------------ the adapter module


@dataclass(frozen=True)
class _Geometry:
    """What one adapter needs to know about its base linear on this rank."""

    column: bool
    in_features: int
    """This rank's input width (row-parallel: the local slice)."""
    out_sizes: tuple[int, ...]
    """This rank's output rows of each HF part of the base (every part, adapted or not)."""
    groups: int | None
    """Fused QKV: this rank's query groups (outputs are interleaved per group); else None."""


class LoraAdapter(nn.Module):
    """The (A, B) pairs of one megatron linear; ``forward(x)`` is the delta added to its output."""

    def __init__(
        self,
        layer: int,
        linear: str,
        parts: tuple[str, ...],
        geometry: _Geometry,
        rank: int,
        scale: float,
        tp_rank: int,
        tp_size: int,
        sequence_parallel: bool,
        seed: int = 0,
    ):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.layer, self.linear, self.parts, self.geometry = layer, linear, parts, geometry
        self.all_parts = FUSED[linear]
        self.rank, self.scale = rank, scale
        self.tp_size, self.sequence_parallel = tp_size, sequence_parallel
        self.enabled = True
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for part in parts:
            out_local = geometry.out_sizes[self.all_parts.index(part)]
            in_full = geometry.in_features * (1 if geometry.column else tp_size)
            gen = torch.Generator().manual_seed(seed + zlib.crc32(hf_module_name(layer, part).encode()))
            a = torch.empty(rank, in_full)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            if not geometry.column:  # row-parallel: this rank's input columns of A
                a = a[:, tp_rank * geometry.in_features : (tp_rank + 1) * geometry.in_features]
            self.lora_A[part] = nn.Parameter(a.contiguous().to(device))
            self.lora_B[part] = nn.Parameter(torch.zeros(out_local, rank, device=device))
            # Column-parallel: B split along the output rows, A whole; row-parallel: A split along
            # the input columns, B whole.
            if geometry.column:
                split, split_dim, whole = self.lora_B[part], 0, self.lora_A[part]
            else:
                split, split_dim, whole = self.lora_A[part], 1, self.lora_B[part]
            set_tensor_model_parallel_attributes(split, True, split_dim, 1)
            set_tensor_model_parallel_attributes(whole, False, -1, 1)
            # Under SP the whole factor's gradient is a sum over the sequence shards of the TP
            # ranks: finalize_model_grads all-reduces parameters flagged like this over TP.
            whole.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: [s(/tp), b, in(/tp)] -> delta [s(/tp), b, out/tp (column) or out (row)], or None when off."""
        if not self.enabled:
            return None
        from megatron.core.tensor_parallel import mappings

        a = torch.cat([self.lora_A[p] for p in self.parts])  # [P*r, in]
        h = x.to(a.dtype) @ a.t()  # [s, b, P*r]
        g = self.geometry
        if g.column:
            if self.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h)
            elif self.tp_size > 1:
                h = mappings.copy_to_tensor_model_parallel_region(h)
        elif self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h)
        elif self.tp_size > 1:
            h = mappings.reduce_from_tensor_model_parallel_region(h)
        hs = dict(zip(self.parts, h.split(self.rank, dim=-1)))
        outs = []
        for part, size in zip(self.all_parts, g.out_sizes):
            if part in hs:
                outs.append(hs[part] @ self.lora_B[part].t())
            else:
                outs.append(h.new_zeros(*h.shape[:-1], size))
        if g.groups is not None:  # QKV: [q | k | v] per query group, megatron's row order
            outs = [o.reshape(*o.shape[:-1], g.groups, -1) for o in outs]
            y = torch.cat(outs, dim=-1).flatten(-2)
        else:
            y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return y * self.scale


def _add_adapter_output(module: nn.Module, args, output):
    delta = module.lora(args[0])
    if delta is None:
        return output
    out, bias = output
    return out + delta.to(out.dtype), bias


def _geometry(linear_name: str, module: nn.Module, arch: ModelArch, tp_size: int) -> _Geometry:
    weight = module.weight  # [out_local, in_local]
    out_local, in_local = weight.shape
    if linear_name == "self_attention.linear_qkv":
        groups = arch.num_kv_heads // tp_size
        d = arch.head_dim
        sizes = (groups * arch.queries_per_group * d, groups * d, groups * d)
        return _Geometry(True, in_local, sizes, groups)
    if linear_name == "mlp.linear_fc1":
        return _Geometry(True, in_local, (out_local // 2, out_local // 2), None)
    return _Geometry(False, in_local, (out_local,), None)


def _decoder_layers(chunk: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """(global layer index, TransformerLayer) of a model chunk."""
    from rlhf_megatron.models.loader import unwrap_model

    model = unwrap_model(chunk)
    model = getattr(model, "language_model", model)
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", []):
        yield layer.layer_number - 1, layer


def attach_lora(
    chunks: Sequence[nn.Module],
    arch: ModelArch,
    lora: LoraConfig,
    *,
    tp_rank: int,
    tp_size: int,
    sequence_parallel: bool,
    key: str = "actor_rollout_ref.model",
) -> int:
    """Give this rank's chunks their adapters and freeze everything else; returns the number of
    adapter parameters on this rank. Call after the base weights are loaded and before DDP and
    the optimizer are set up (they then see the adapters only)."""
    targets = resolve_targets(arch, lora, key)
    count = 0
    for chunk in chunks:
        chunk.requires_grad_(False)
        for layer, block in _decoder_layers(chunk):
            for linear_name, parts in targets.get(layer, {}).items():
                module = block.get_submodule(linear_name)
                if not hasattr(module, "weight") or module.weight is None:
                    raise LoraTargetError(
                        f"{key}.target_modules: layer {layer}'s {linear_name} has no plain weight to adapt "
                        "(transformer-engine's fused layers are not supported; megatron.transformer_impl=local)"
                    )
                adapter = LoraAdapter(
                    layer,
                    linear_name,
                    parts,
                    _geometry(linear_name, module, arch, tp_size),
                    lora.rank,
                    lora.scale,
                    tp_rank,
                    tp_size,
                    sequence_parallel,
                )
                module.lora = adapter
                module.register_forward_hook(_add_adapter_output)
                count += sum(p.numel() for p in adapter.parameters())
    return count


def adapter_modules(chunks: Sequence[nn.Module]) -> list[LoraAdapter]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, LoraAdapter)]


def lora_parameter_count(chunks: Sequence[nn.Module]) -> int:
    return sum(p.numel() for m in adapter_modules(chunks) for p in m.parameters())


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[nn.Module]):
    """The base model: every adapter of ``chunks`` off inside the block (the reference policy)."""
    modules = adapter_modules(chunks)
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.enabled = True


# ------------------------------------------------------------------ whole tensors, PEFT names


def peft_key(layer: int, part: str, factor: str) -> str:
    """PEFT's state-dict key of one factor (``A`` or ``B``) of a causal LM's adapter."""
    return f"base_model.model.{hf_module_name(layer, part)}.lora_{factor}.weight"


def full_adapter_tensors(
    chunks: Sequence[nn.Module], tp_group=None, pp_group=None
) -> dict[str, torch.Tensor]:
    """Every adapter of the model as whole fp32 tensors under PEFT's keys (A [r, in], B [out, r]),
    on every rank. Collective over this rank's TP group (the split factor is all-gathered) and
    pipeline group (each stage's adapters are exchanged as objects: they are small)."""
    import torch.distributed as dist

    local: dict[str, torch.Tensor] = {}
    for m in adapter_modules(chunks):
        for part in m.parts:
            a, b = m.lora_A[part].detach(), m.lora_B[part].detach()
            if m.tp_size > 1:
                if m.geometry.column:
                    b = _all_gather(b, 0, tp_group)
                else:
                    a = _all_gather(a, 1, tp_group)
            local[peft_key(m.layer, part, "A")] = a.float().cpu()
            local[peft_key(m.layer, part, "B")] = b.float().cpu()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        stages: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, local, group=pp_group)
        local = {k: v for stage in stages for k, v in stage.items()}
    return dict(sorted(local.items(), key=lambda kv: _order(kv[0])))


def _order(key: str) -> tuple[int, str]:
    layer = re.search(r"layers\.(\d+)\.", key)
    return (int(layer.group(1)) if layer else -1, key)


def _all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    import torch.distributed as dist

    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def peft_keys(targets: dict[int, dict[str, tuple[str, ...]]]) -> set[str]:
    """Every PEFT key of a model adapted as ``resolve_targets`` says."""
    return {
        peft_key(layer, part, factor)
        for layer, linears in targets.items()
        for parts in linears.values()
        for part in parts
        for factor in "AB"
    }


def load_full_adapter_tensors(
    chunks: Sequence[nn.Module],
    tensors: dict[str, torch.Tensor],
    tp_rank: int,
    source: str,
    expected: set[str] | None = None,
) -> None:
    """Copy whole PEFT-keyed tensors into this rank's adapters (its slices of them). Every
    adapter of this rank must be present with the right shape; with ``expected`` (the model's
    ``peft_keys``), a tensor outside it is an error too (the adapter was trained on other modules).
    ``source`` names the file in messages."""
    used = set()
    with torch.no_grad():
        for m in adapter_modules(chunks):
            for part in m.parts:
                for factor, param in (("A", m.lora_A[part]), ("B", m.lora_B[part])):
                    key = peft_key(m.layer, part, factor)
                    if key not in tensors:
                        raise LoraTargetError(
                            f"{source}: no tensor {key}; the adapter does not cover {hf_module_name(m.layer, part)}, "
                            "which this run adapts (is it an adapter of this model, with the same target_modules?)"
                        )
                    full = tensors[key]
                    split_dim = 0 if (m.geometry.column and factor == "B") else 1
                    split = (m.geometry.column and factor == "B") or (not m.geometry.column and factor == "A")
                    want = list(param.shape)
                    if split:
                        want[split_dim] *= m.tp_size
                    if list(full.shape) != want:
                        raise LoraTargetError(
                            f"{source}: {key} has shape {list(full.shape)}, this model's adapter needs {want} "
                            "(rank and the base model's sizes must match: was it trained on another base model?)"
                        )
                    if split:
                        size = param.shape[split_dim]
                        full = full.narrow(split_dim, tp_rank * size, size)
                    param.copy_(full.to(param.dtype))
                    used.add(key)
    extra = sorted(set(tensors) - (expected if expected is not None else used))
    if extra:
        raise LoraTargetError(
            f"{source}: {len(extra)} tensor(s) have no adapter in this model, e.g. {extra[0]}; the adapter "
            "targets modules this run does not adapt (check target_modules / exclude_modules)"
        )
