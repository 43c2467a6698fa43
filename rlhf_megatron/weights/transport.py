"""Transports: how shards move between ranks during a weight sync.

``CollectiveTransport`` uses ``torch.distributed`` collectives over the
groups it is given: gloo on CPU, NCCL on GPU (the same code; the backend is
the group's). It only ever communicates inside the group a target needs: the
owning stage's TP group for gathers (a routed expert's: its expert TP group),
the expert-parallel group to share experts within a stage, the pipeline group
for broadcasts.

With the rollout engine colocated in the training processes (vLLM's external
launcher), nothing ever crosses a process boundary after the gather, so no
other transport is needed; a cross-pool transport joins this one when the
rollout runs on its own resource pool.
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

    def all_gather_etp(self, shard: torch.Tensor) -> torch.Tensor: ...

    def broadcast_ep(self, flat: torch.Tensor, src_ep_rank: int) -> torch.Tensor: ...

    def broadcast_pp(self, flat: torch.Tensor, src_stage: int) -> torch.Tensor: ...


class CollectiveTransport:
    """All-gather over a TP (or expert TP) group and broadcast over an EP or PP group with torch.distributed."""

    def __init__(
        self,
        tp_group,
        tp_size: int,
        pp_group,
        pp_ranks: Sequence[int],
        ep_group=None,
        ep_ranks: Sequence[int] = (),
        etp_group=None,
        etp_size: int = 1,
    ):
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.pp_group = pp_group
        self.pp_ranks = tuple(pp_ranks)
        self.ep_group = ep_group
        self.ep_ranks = tuple(ep_ranks)
        self.etp_group = etp_group
        self.etp_size = etp_size

    @classmethod
    def of(cls, groups) -> CollectiveTransport:
        """Over the groups of a ``platform.ParallelGroups``."""
        return cls(
            groups.tp_group,
            len(groups.tp_ranks),
            groups.pp_group,
            groups.pp_ranks,
            groups.ep_group,
            groups.ep_ranks,
            groups.etp_group,
            len(groups.etp_ranks) or 1,
        )

    def all_gather_etp(self, shard: torch.Tensor) -> torch.Tensor:
        """A routed expert's shards over its expert tensor-parallel group: ``(etp_size, *shard.shape)``."""
        return _gather(shard, self.etp_group, self.etp_size)

    def broadcast_ep(self, flat: torch.Tensor, src_ep_rank: int) -> torch.Tensor:
        """Broadcast a flat buffer from expert-parallel rank ``src_ep_rank`` to the EP group (in place)."""
        if len(self.ep_ranks) <= 1:
            return flat
        torch.distributed.broadcast(flat, src=self.ep_ranks[src_ep_rank], group=self.ep_group)
        return flat

    def all_gather_tp(self, shard: torch.Tensor) -> torch.Tensor:
        """Every TP rank's shard of one parameter, stacked in TP-rank order: ``(tp_size, *shard.shape)``.

        Gathered into one buffer: the list form of ``all_gather`` gathers
        into a flat buffer of its own and copies it out into the per-rank
        tensors (NCCL's ``flatten_for_scatter_gather``; gloo stages through a
        buffer of its own either way), and for a row-split parameter (QKV,
        vocabulary) this buffer already is the full tensor, so the caller
        skips the reassembly copy.
        """
        return _gather(shard, self.tp_group, self.tp_size)

    def broadcast_pp(self, flat: torch.Tensor, src_stage: int) -> torch.Tensor:
        """Broadcast a flat buffer from pipeline stage ``src_stage`` to every stage (in place)."""
        if len(self.pp_ranks) == 1:
            return flat
        torch.distributed.broadcast(flat, src=self.pp_ranks[src_stage], group=self.pp_group)
        return flat


def _gather(shard: torch.Tensor, group, size: int) -> torch.Tensor:
    if size == 1:
        return shard.unsqueeze(0)
    shard = shard.contiguous()
    out = shard.new_empty((size * shard.shape[0], *shard.shape[1:]))
    _all_gather_single(out, shard, group=group)
    return out.view(size, *shard.shape)
