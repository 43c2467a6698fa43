"""Transports: how shards move between ranks during a weight sync.

``CollectiveTransport`` uses ``torch.distributed`` collectives over the
groups it is given: gloo on CPU, NCCL on GPU (the same code; the backend is
the group's). It only ever communicates inside the group a target needs: the
owning stage's TP group for gathers, the pipeline group for broadcasts.

``CudaIpcTransport`` hands tensors to a colocated process on the same GPU
without a copy, by CUDA IPC handles (``torch.multiprocessing.reductions``);
it is GPU-only and refuses to run without CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

# torch 2.13 renames all_gather_into_tensor to all_gather_single (and warns on the old name).
_all_gather_single = (
    getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
)


class Transport(Protocol):
    def all_gather_tp(self, shard: torch.Tensor) -> torch.Tensor: ...

    def broadcast_pp(self, flat: torch.Tensor, src_stage: int) -> torch.Tensor: ...


class CollectiveTransport:
    """All-gather over a TP group and broadcast over a PP group with torch.distributed."""

    def __init__(self, tp_group, tp_size: int, pp_group, pp_ranks: Sequence[int]):
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.pp_group = pp_group
        self.pp_ranks = tuple(pp_ranks)
        self.bytes_moved = 0

    def all_gather_tp(self, shard: torch.Tensor) -> torch.Tensor:
        """Every TP rank's shard of one parameter, stacked in TP-rank order: ``(tp_size, *shard.shape)``.

        Gathered into one buffer: the list form of ``all_gather`` gathers
        into a flat buffer of its own and copies it out into the per-rank
        tensors (NCCL's ``flatten_for_scatter_gather``; gloo stages through a
        buffer of its own either way), and for a row-split parameter (QKV,
        vocabulary) this buffer already is the full tensor, so the caller
        skips the reassembly copy.
        """
        if self.tp_size == 1:
            return shard.unsqueeze(0)
        shard = shard.contiguous()
        out = shard.new_empty((self.tp_size * shard.shape[0], *shard.shape[1:]))
        _all_gather_single(out, shard, group=self.tp_group)
        self.bytes_moved += shard.numel() * shard.element_size() * (self.tp_size - 1)
        return out.view(self.tp_size, *shard.shape)

    def broadcast_pp(self, flat: torch.Tensor, src_stage: int) -> torch.Tensor:
        """Broadcast a flat buffer from pipeline stage ``src_stage`` to every stage (in place)."""
        if len(self.pp_ranks) == 1:
            return flat
        torch.distributed.broadcast(flat, src=self.pp_ranks[src_stage], group=self.pp_group)
        self.bytes_moved += flat.numel() * flat.element_size()
        return flat


class CudaIpcTransport:
    """Zero-copy hand-off of CUDA tensors to a colocated process (GPU only)."""

    def __init__(self):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaIpcTransport needs CUDA: it shares GPU memory between processes on one device. "
                "On CPU the rollout engine lives in the training process, so no transport is needed."
            )

    @staticmethod
    def export(tensor: torch.Tensor):
        """A picklable handle for ``tensor`` that another process on this GPU can open."""
        from torch.multiprocessing.reductions import reduce_tensor

        if not tensor.is_cuda:
            raise ValueError("CudaIpcTransport.export: tensor must live on a CUDA device")
        return reduce_tensor(tensor.contiguous())

    @staticmethod
    def open(handle) -> torch.Tensor:
        rebuild, args = handle
        return rebuild(*args)
