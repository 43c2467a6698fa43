"""Fill megatron model chunks from an HF safetensors checkpoint, each rank reading only its shards.

For every parameter of every local chunk, ``load_hf_weights`` maps the local
name to its global one (pipeline/virtual-pipeline layer offset), asks the spec
for this TP rank's slice (``spec.hf_to_mcore``) and copies it in. Reads go
through ``safe_open(...).get_slice`` one tensor slice at a time, so a rank's
memory during loading is its own shard plus one slice in flight, never the
whole model. Next-token-prediction layers past ``num_hidden_layers`` are not loaded
(``models/mtp.py``: a message says so; checkpoints keep them aside). A mixture-of-experts rank reads only its own experts (its
expert-parallel rank's share, global expert numbers from ``stages``), sliced for
its expert tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf_megatron.models.hf_io import HFCheckpoint, HFCheckpointError
from rlhf_megatron.models.mtp import warn_untrained_mtp
from rlhf_megatron.models.spec import (
    hf_names,
    hf_source,
    hf_to_mcore,
    is_expert_param,
    local_to_global_expert,
    local_to_global_layer,
)
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = ["LoadReport", "is_scalar_head_param", "load_hf_weights", "unwrap_model"]


@dataclass
class LoadReport:
    """What ``load_hf_weights`` did on this rank (global megatron names)."""

    loaded: list[str] = field(default_factory=list)
    kept_initialised: list[str] = field(default_factory=list)
    """Head parameters absent from the checkpoint (a critic started from an LM): left at their init."""


def is_scalar_head_param(name: str, arch: ModelArch) -> bool:
    """A critic/reward head parameter, which an LM checkpoint does not have (it keeps its init)."""
    return arch.head != "lm" and name.removeprefix("language_model.").startswith("output_layer.")


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model chunk (``GPTModel`` or ``VisionLanguageModel``) inside megatron's DDP /
    Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


LOADED_BUFFERS = ("router.expert_bias",)
"""Buffers that come from the checkpoint too: DeepSeekMoE's score-correction bias."""


def loadable_tensors(module: torch.nn.Module):
    """``(name, tensor)`` of every parameter, then of the buffers in ``LOADED_BUFFERS``."""
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if n.endswith(LOADED_BUFFERS))


def _ranks(tp_rank, tp_size, pp_rank, pp_size, vpp_size):
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank,
        ps.get_tensor_model_parallel_world_size() if tp_size is None else tp_size,
        ps.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank,
        ps.get_pipeline_model_parallel_world_size() if pp_size is None else pp_size,
        ps.get_virtual_pipeline_model_parallel_world_size() if vpp_size is None else vpp_size,
    )


def _expert_ranks(arch: ModelArch, tp_rank: int, tp_size: int) -> tuple[int, int, int, int]:
    """(ep_rank, ep_size, etp_rank, etp_size) from megatron's state; dense models: (0, 1, TP rank, TP size)."""
    if arch.moe is None:
        return 0, 1, tp_rank, tp_size
    from megatron.core import parallel_state as ps

    return (
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
    )


@torch.no_grad()
def load_hf_weights(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    hf_dir: str | Path | HFCheckpoint,
    arch: ModelArch,
    *,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    pp_rank: int | None = None,
    pp_size: int | None = None,
    vpp_size: int | None = None,
    progress: bool = False,
) -> LoadReport:
    """Copy this rank's slices of an HF checkpoint into ``model_chunks`` (in place).

    Ranks and sizes default to megatron's initialised parallel state. Every
    parameter must be found, except a critic/reward head missing from an LM
    checkpoint, which keeps its initial values (listed in the report).
    Raises ``HFCheckpointError``/``SpecError`` naming the tensor and file on a
    missing tensor or a shape that does not match ``arch``.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, Sequence) else [model_chunks]
    tp_rank, tp_size, pp_rank, pp_size, vpp_size = _ranks(tp_rank, tp_size, pp_rank, pp_size, vpp_size)
    ep_rank, ep_size, etp_rank, etp_size = _expert_ranks(arch, tp_rank, tp_size)
    if vpp_size is not None and len(chunks) != vpp_size:
        raise ValueError(f"load_hf_weights: got {len(chunks)} model chunks for VPP size {vpp_size}")
    checkpoint = hf_dir if isinstance(hf_dir, HFCheckpoint) else HFCheckpoint(hf_dir)
    source = hf_source(checkpoint, arch)  # also finds a family's alternative HF names
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        warn_untrained_mtp(checkpoint, arch)  # layers past num_hidden_layers: kept aside, not loaded
    work = []
    for vp_stage, chunk in enumerate(chunks):
        for local_name, param in loadable_tensors(unwrap_model(chunk)):
            global_name = local_to_global_layer(
                local_name, arch.num_layers, pp_rank, pp_size, vp_stage if vpp_size else None, vpp_size
            )
            if arch.moe is not None:
                global_name = local_to_global_expert(global_name, arch.moe.num_experts, ep_rank, ep_size)
            work.append((global_name, param))
    if progress:
        from tqdm import tqdm

        work = tqdm(work, desc="loading HF weights", unit="tensor")
    report = LoadReport()
    for global_name, param in work:
        sources = hf_names(global_name, arch)
        missing = [s for s in sources if s not in source]
        if missing:
            if is_scalar_head_param(global_name, arch):
                report.kept_initialised.append(global_name)
                continue
            raise HFCheckpointError(
                f"megatron parameter {global_name} needs HF tensor(s) {missing}, which {checkpoint.dir} does not "
                f"contain; is the checkpoint a complete {arch.architecture}?"
            )
        # A routed expert is split over the expert tensor-parallel group, everything else over TP.
        rank, size = (etp_rank, etp_size) if is_expert_param(global_name, arch) else (tp_rank, tp_size)
        shard = hf_to_mcore(global_name, arch, source, rank, size)
        if tuple(shard.shape) != tuple(param.shape):
            raise HFCheckpointError(
                f"megatron parameter {global_name} on (expert) TP rank {rank}/{size} has shape "
                f"{list(param.shape)}, but {', '.join(sources)} give(s) {list(shard.shape)}"
            )
        param.copy_(shard)
        report.loaded.append(global_name)
    return report
