"""Executing a sync plan: gather → convert → (broadcast) → hand to the rollout engine, bucket by bucket.

``WeightSyncer(plan, model_chunks, tp_rank, pp_rank, transport)`` is created
once per actor (the plan never changes) and ``iter_weights()`` is called
after every update. It is a generator: the rollout engine pulls one bucket at
a time, so at most one bucket of converted tensors (plus the shards of the
parameter being gathered) exists at once, whatever the model size.

Per bucket, every rank walks the same transfers in the same order (the plan
is identical everywhere), which is what keeps the collectives matched:

1. The owning pipeline stage reads its shard; ``gather`` transfers all-gather
   it inside that stage's TP group (a routed expert: its ETP group, on the EP
   rank that holds it) and reassemble it with the spec's layout rules
   (``gather_tp_shards``; a row-split parameter needs no reassembly, the
   gathered buffer is the full tensor); ``local`` transfers use the shard as is.
   Routed experts are then broadcast inside the expert-parallel group, one
   collective per (bucket, owning EP rank), so every rank of the stage has them.
2. The stage's Megatron tensors for the bucket are packed into one flat
   buffer and broadcast over the pipeline group: one collective per (bucket,
   owning stage), and every stage's engine gets every layer.
3. Every rank converts them to its targets: HF tensors (``hf``) or the slice
   for its own vLLM TP rank (``sharded``).

``stats`` records seconds per phase (gather, broadcast, convert) and the peak
number of bucket bytes held, for the benchmark.

``copy_sharded_weights`` is the receiving end of the ``sharded`` format: it copies
each tensor into the rollout model's parameter of that name, or into one expert's
row of a fused expert parameter (``name[e]``).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable, Iterator, Sequence

import torch

from rlhf_megatron.models.loader import loadable_tensors, unwrap_model
from rlhf_megatron.models.spec import gather_tp_shards, mcore_to_hf, tp_shard_slices
from rlhf_megatron.weights.plan import (
    VLLM_VOCAB_PADDING,
    ParamTransfer,
    SyncPlan,
    vllm_hf_tensors,
    vllm_kv_heads_per_rank,
    vllm_param_name,
)
from rlhf_megatron.weights.transport import Transport


class WeightSyncer:
    """Streams the actor's weights in the rollout engine's layout (see module docstring)."""

    def __init__(
        self,
        plan: SyncPlan,
        model_chunks: Sequence[torch.nn.Module],
        tp_rank: int,
        pp_rank: int,
        transport: Transport,
        rollout_rank: int | None = None,
        ep_rank: int = 0,
    ):
        self.plan = plan
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.ep_rank = ep_rank
        self.transport = transport
        # With vLLM's external launcher, rollout TP groups are consecutive global ranks.
        self.rollout_rank = rollout_rank
        # Parameters plus the buffers a checkpoint carries (DeepSeekMoE's score-correction bias).
        self.params = [dict(loadable_tensors(unwrap_model(c))) for c in model_chunks]
        self.dtype = next(iter(self.params[0].values())).dtype
        self.stats: dict[str, float] = {}

    @classmethod
    def of(cls, plan: SyncPlan, model_chunks: Sequence[torch.nn.Module], info, groups) -> WeightSyncer:
        """The syncer of the rank a ``platform.ParallelInfo`` describes, over its
        ``platform.ParallelGroups`` (``CollectiveTransport.of``)."""
        from rlhf_megatron.weights.transport import CollectiveTransport

        return cls(
            plan,
            model_chunks,
            info.tp_rank,
            info.pp_rank,
            CollectiveTransport.of(groups),
            rollout_rank=info.rank % plan.rollout_tp,
            ep_rank=info.ep_rank,
        )

    def _shard(self, t: ParamTransfer) -> torch.Tensor:
        chunk = self.params[t.vpp_rank or 0]
        if t.local_name not in chunk:
            raise KeyError(
                f"weight sync: pipeline rank {self.pp_rank} (expert-parallel rank {self.ep_rank}) should own "
                f"'{t.local_name}' ({t.name}) but its model chunk {t.vpp_rank or 0} has no such parameter; the "
                "plan and the model disagree on the layout (is TrainLayout's ep_size the model's?)"
            )
        return chunk[t.local_name].detach()

    # ------------------------------------------------------------------ conversion
    def _convert(
        self, t: ParamTransfer, tensor: torch.Tensor, is_full: bool
    ) -> list[tuple[str, torch.Tensor]]:
        arch = self.plan.arch
        if self.plan.load_format == "hf":
            return vllm_hf_tensors(t.name, tensor, arch)
        rank, tp = self.rollout_rank, self.plan.rollout_tp
        if t.ep_rank is not None:  # one expert's row of vLLM's fused parameter, for this vLLM rank
            target = next(x for x in t.targets if x.rollout_rank == rank)
            pieces = [_vllm_slice(n, x, arch, rank, tp) for n, x in vllm_hf_tensors(t.name, tensor, arch)]
            return [(target.stream_name, torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0])]
        if not is_full:  # aligned local shard: only QKV needs de-interleaving into [q_r; k_r; v_r]
            if "linear_qkv" in t.name:
                local_arch = dataclasses.replace(
                    arch,
                    num_attention_heads=arch.num_attention_heads // tp,
                    num_kv_heads=arch.num_kv_heads // tp,
                )
                hf = mcore_to_hf(t.name, tensor, local_arch)
                return [(vllm_param_name(t.name, hf[0][0]), torch.cat([x for _, x in hf], dim=0))]
            hf_name = mcore_to_hf(t.name, torch.empty(t.full_shape, device="meta"), arch)[0][0]
            return [(vllm_param_name(t.name, hf_name), tensor)]
        pieces = [(n, _vllm_slice(n, x, arch, rank, tp)) for n, x in mcore_to_hf(t.name, tensor, arch)]
        if len(pieces) > 1:
            return [(vllm_param_name(t.name, pieces[0][0]), torch.cat([x for _, x in pieces], dim=0))]
        return pieces

    # ------------------------------------------------------------------ the stream
    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs for this rank's rollout engine, one bucket at a time."""
        buckets = self.iter_buckets()
        while (bucket := next(buckets, None)) is not None:
            yield from bucket
            # Drop this bucket before the next is gathered (a ``for`` loop would still hold it).
            del bucket

    def iter_buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """This rank's (name, tensor) pairs of each bucket of the plan, in plan order (a cross-pool
        sender ships them bucket by bucket). ``stats`` is filled in once the last one is out."""
        stats = dict.fromkeys(("gather_s", "broadcast_s", "convert_s"), 0.0)
        stats["peak_bucket_bytes"] = 0
        for bucket in self.plan.buckets:
            by_stage: dict[int, list[ParamTransfer]] = {}
            for t in bucket.transfers:
                by_stage.setdefault(t.pp_rank, []).append(t)
            out: list[tuple[str, torch.Tensor]] = []
            for stage in sorted(by_stage):
                transfers = by_stage[stage]
                t0 = time.perf_counter()
                sources = None
                if stage == self.pp_rank:
                    sources = [self._source(t) for t in transfers]
                    sources = self._broadcast_experts(transfers, sources)
                t1 = time.perf_counter()
                sources = self._broadcast(transfers, sources, stage)
                t2 = time.perf_counter()
                for t, src in zip(transfers, sources):
                    out.extend(self._convert(t, src, t.is_full))
                # ``out`` keeps what is still needed (mostly views of these); holding the list
                # across the ``yield`` would pin this bucket while the next one is gathered.
                del sources, src
                stats["gather_s"] += t1 - t0
                stats["broadcast_s"] += t2 - t1
                stats["convert_s"] += time.perf_counter() - t2
            held = sum(x.numel() * x.element_size() for _, x in out)
            stats["peak_bucket_bytes"] = max(stats["peak_bucket_bytes"], held)
            yield out
            del out
        self.stats = stats

    def _source(self, t: ParamTransfer) -> torch.Tensor | None:
        """The owning stage's Megatron tensor for ``t``: gathered over TP (an expert: over ETP), or its
        own shard; None for an expert another EP rank holds (``_broadcast_experts`` fills it in)."""
        if t.ep_rank is not None and t.ep_rank != self.ep_rank:
            return None
        shard = self._shard(t)
        if t.mode != "gather":
            return shard
        gather = self.transport.all_gather_etp if t.ep_rank is not None else self.transport.all_gather_tp
        stacked = gather(shard)  # (tp or etp, *shard.shape)
        if _is_dim0_concat(t.name, self.plan.arch, stacked.shape[0]):
            return stacked.view(t.full_shape)  # already the full tensor: no reassembly copy
        return gather_tp_shards(t.name, list(stacked.unbind(0)), self.plan.arch)

    def _broadcast_experts(self, transfers, sources: list) -> list[torch.Tensor]:
        """Give every EP rank of this stage the bucket's experts: one broadcast per owning EP rank."""
        owners = sorted({t.ep_rank for t in transfers if t.ep_rank is not None})
        if not owners or self.plan.layout.ep_size == 1:
            return sources
        sources = list(sources)
        for owner in owners:
            idx = [i for i, t in enumerate(transfers) if t.ep_rank == owner]
            shapes = [torch.Size(transfers[i].full_shape) for i in idx]
            if owner == self.ep_rank:
                flat = torch.cat([sources[i].reshape(-1) for i in idx])
            else:
                flat = torch.empty(sum(s.numel() for s in shapes), dtype=self.dtype)
            flat = self.transport.broadcast_ep(flat, owner)
            offset = 0
            for i, shape in zip(idx, shapes):
                sources[i] = flat[offset : offset + shape.numel()].view(shape)
                offset += shape.numel()
        return sources

    def _broadcast(self, transfers, sources, stage: int) -> list[torch.Tensor]:
        """Ship one stage's Megatron tensors of a bucket to every pipeline stage in one collective."""
        if self.plan.layout.pp_size == 1:
            return sources
        shapes = [torch.Size(t.source_shape) for t in transfers]
        if sources is not None:
            for t, src in zip(transfers, sources):
                if src.shape != torch.Size(t.source_shape):
                    raise RuntimeError(
                        f"weight sync: {t.name} on pipeline stage {stage} has shape {list(src.shape)}, "
                        f"the plan expects {list(t.source_shape)}"
                    )
            # One dtype on every stage: a float32 buffer (the router's expert_bias) beside bf16
            # weights travels in the weights' dtype, as the receivers' empty buffer expects.
            flat = torch.cat([x.reshape(-1).to(self.dtype) for x in sources])
        else:
            flat = torch.empty(sum(s.numel() for s in shapes), dtype=self.dtype)
        flat = self.transport.broadcast_pp(flat, stage)
        out, offset = [], 0
        for shape in shapes:
            out.append(flat[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        return out


def _is_dim0_concat(name: str, arch, tp_size: int) -> bool:
    """Whether the full tensor is the TP shards concatenated along dim 0 in rank order.

    True for QKV, the vocabulary and other row-split parameters; False for
    ``linear_fc1`` (each shard is ``[gate_r; up_r]``) and column-split ones.
    """
    slices = tp_shard_slices(name, arch, 0, tp_size)
    return len(slices) == 1 and slices[0].dim == 0


def _vllm_slice(hf_name: str, full: torch.Tensor, arch, rank: int, tp: int) -> torch.Tensor:
    """vLLM TP rank ``rank``'s slice of one full HF tensor (before fusion)."""
    column = (
        "q_proj.weight",
        "q_proj.bias",
        "gate_proj.weight",
        "up_proj.weight",
        ".w1.weight",
        ".w3.weight",
    )
    if hf_name.endswith(column):
        return full.chunk(tp, dim=0)[rank]
    if hf_name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        per_rank = vllm_kv_heads_per_rank(arch, tp)
        replicas = max(1, tp // arch.num_kv_heads)
        head0 = (rank // replicas) * per_rank
        return full.narrow(0, head0 * arch.head_dim, per_rank * arch.head_dim)
    if hf_name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        return full.chunk(tp, dim=1)[rank]
    if hf_name.endswith(("embed_tokens.weight", "lm_head.weight")):
        padded = -(-full.shape[0] // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        rows = padded // tp
        out = full.new_zeros((rows, *full.shape[1:]))
        start = rank * rows
        take = max(0, min(full.shape[0] - start, rows))
        if take:
            out[:take] = full[start : start + take]
        return out
    return full


_INDEXED = re.compile(r"^(?P<name>.+)\[(?P<index>\d+)\]$")


@torch.no_grad()
def copy_sharded_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy a ``sharded``-format stream into ``model``'s parameters (vLLM's kernel layout, this rank's
    slice); ``name[e]`` fills row ``e`` of a fused expert parameter. Returns the parameter names
    touched. Raises ``KeyError``/``ValueError`` naming the tensor when a name or shape does not fit."""
    touched = set()
    for name, tensor in weights:
        m = _INDEXED.match(name)
        param_name = m.group("name") if m else name
        module_name, _, attr = param_name.rpartition(".")
        try:
            param = model.get_submodule(module_name).get_parameter(attr)
        except AttributeError as e:
            raise KeyError(
                f"weight sync: the rollout model has no parameter {param_name!r} (from {name!r})"
            ) from e
        dest = param.data[int(m.group("index"))] if m else param.data
        if dest.shape != tensor.shape:
            raise ValueError(
                f"weight sync: {name} has shape {list(tensor.shape)}, the rollout model's {param_name} "
                f"{'row' if m else 'parameter'} has {list(dest.shape)}"
            )
        dest.copy_(tensor)
        touched.add(param_name)
    return touched
