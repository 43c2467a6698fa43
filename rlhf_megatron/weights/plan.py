"""The resharding plan: which Megatron shards feed which rollout tensors. Pure and deterministic.

Built from parameter metadata only (the architecture, the training TP/PP/VPP
(/EP/ETP) layout, the rollout TP size and the load format), so it is tested
without processes and is identical on every rank. Executing it (``execute.py``)
moves data; the plan never does.

For every Megatron parameter (global name) the plan records:

- the owner: pipeline rank and virtual chunk holding it, for a routed expert
  also the expert-parallel rank, and its local name in that chunk (local layer
  and, for experts, local expert numbers);
- how its TP shards combine: ``gather`` (all-gather within the owner stage's
  TP group, then reassemble with the spec's layout rules) or ``local`` (each
  rank converts its own shard; only when the rollout layout lines up with the
  training one, see below);
- its targets: the tensors the rollout engine receives, each with a name,
  shape and, for the ``sharded`` format, the rollout TP rank it is cut for;
- a broadcast across pipeline stages from the owner of that Megatron tensor
  (full, or the aligned shard), after which every rank converts it for its
  own rollout rank (the rollout engine on every rank holds all layers, and
  ranks of one pipeline group can sit in different rollout TP ranks).

Mixture-of-experts models: a routed expert is gathered over its expert
tensor-parallel group (ETP) on the owning EP rank, broadcast inside the
expert-parallel group (every rank's vLLM holds every expert: vLLM's own expert
parallelism is off), then across pipeline stages like everything else. Each
expert's gate/up and down are separate transfers, so they are bucketed one by
one: a layer whose experts exceed a bucket spans several buckets.

Load formats:

- ``hf``: full tensors with HF names; vLLM's own loader slices them. Every
  TP-split parameter needs a gather. Vision-language models stream the vision
  tower and merger too (owned by pipeline stage 0), under the hub's names
  (``visual.*``, ``model.*``, ``lm_head.weight``), which vLLM maps itself.
  Routed experts go one by one under Qwen3-MoE's per-expert names
  (``…experts.E.gate_proj.weight``, ``up_proj``, ``down_proj``), also for
  Qwen3-VL-MoE, whose checkpoint stacks a layer's experts into one tensor per
  projection: vLLM's fused-MoE loader takes both, but the stack only whole (all
  the layer's experts in one tensor), so the sync sends them per expert
  (``vllm_hf_tensors``) and buckets them like any other family's.
- ``sharded``: tensors already cut for the receiving vLLM TP rank, with
  vLLM's fused names (``qkv_proj``, ``gate_up_proj``). When rollout TP ==
  training TP, the QKV, gate/up, output-projection and down-projection shards
  line up rank for rank, so they are converted locally with no communication.
  The vocabulary does not line up (Megatron pads to a multiple of
  ``128 × tp``, vLLM to 64), so embeddings are gathered; so is everything when
  the TP sizes differ. KV heads are replicated when rollout TP exceeds them,
  as vLLM does. Not available for vision-language models or multi-latent attention (DeepSeek-V3:
  vLLM fuses its down-projections and absorbs kv_b_proj after loading); both are refused when planned.
  Routed experts go into vLLM's fused per-layer parameters, one expert row at a
  time: ``…experts.routed_experts.w13_weight[e]`` is expert ``e``'s
  ``[gate_r; up_r]`` (``[2F/tp, H]`` of the ``[E, 2F/tp, H]`` parameter) and
  ``…w2_weight[e]`` its down projection ``[H, F/tp]``, so the consumer copies into
  ``param[e]`` (``execute.copy_sharded_weights``). With vLLM's expert parallelism on,
  a rank would instead hold ``E / (tp x dp)`` whole experts (no F split) and receive
  only those rows.

Buckets: parameters are packed in model order into buckets of at most
``bucket_bytes`` (a parameter larger than that gets a bucket of its own), so
peak extra memory during a sync is one bucket plus the largest tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlhf_megatron.models.spec import (
    expert_owner,
    is_expert_param,
    mcore_full_shape,
    mcore_param_names,
    mcore_to_hf,
    param_owner,
    split_stacked_row,
    tp_partition_dim,
    tp_shard_slices,
)
from rlhf_megatron.planning.model_arch import ModelArch

if TYPE_CHECKING:
    import torch

LOAD_FORMATS = ("hf", "sharded")


@dataclass(frozen=True)
class TrainLayout:
    """The actor's Megatron layout."""

    tp_size: int = 1
    pp_size: int = 1
    vpp_size: int | None = None
    ep_size: int = 1
    """Expert-parallel size (mixture-of-experts models)."""
    etp_size: int | None = None
    """Expert tensor-parallel size; None means ``tp_size``."""

    def __post_init__(self):
        if self.etp_size is None:
            object.__setattr__(self, "etp_size", self.tp_size)
        sizes = (self.tp_size, self.pp_size, self.ep_size, self.etp_size)
        if min(sizes) < 1 or (self.vpp_size is not None and self.vpp_size < 1):
            raise ValueError(f"invalid training layout {self}")

    @classmethod
    def of(cls, info) -> TrainLayout:
        """The layout of a ``platform.ParallelInfo``."""
        return cls(info.tp_size, info.pp_size, info.vpp_size, info.ep_size, info.etp_size)


@dataclass(frozen=True)
class Target:
    """One tensor the rollout engine receives."""

    name: str
    shape: tuple[int, ...]
    rollout_rank: int | None = None
    """For the sharded format: the vLLM TP rank this slice is for. None = the same full tensor for all."""
    index: int | None = None
    """For the sharded format: the row (expert) of vLLM's fused expert parameter ``name`` this fills."""

    @property
    def stream_name(self) -> str:
        """The name the stream carries: ``name``, or ``name[index]`` for one expert's row."""
        return self.name if self.index is None else f"{self.name}[{self.index}]"


@dataclass(frozen=True)
class ParamTransfer:
    """How one Megatron parameter reaches the rollout engine."""

    name: str
    """Global Megatron name (``decoder.layers.7.mlp.linear_fc1.weight``)."""
    pp_rank: int
    vpp_rank: int | None
    local_name: str
    """The name inside the owning model chunk (layer and expert numbers local to the chunk / EP rank)."""
    tp_dim: int | None
    mode: str
    """``gather`` (over TP, for an expert over ETP) or ``local`` (see module docstring)."""
    full_shape: tuple[int, ...]
    source_shape: tuple[int, ...]
    """What the owning stage hands on: the full tensor, or for aligned ``local`` transfers its TP shard."""
    targets: tuple[Target, ...]
    ep_rank: int | None = None
    """For a routed expert: the expert-parallel rank holding it (it is broadcast over the EP group)."""

    @property
    def is_full(self) -> bool:
        return self.source_shape == self.full_shape

    def nbytes(self, dtype_bytes: int) -> int:
        n = 1
        for d in self.full_shape:
            n *= d
        return n * dtype_bytes


@dataclass(frozen=True)
class Bucket:
    transfers: tuple[ParamTransfer, ...]
    nbytes: int


@dataclass(frozen=True)
class SyncPlan:
    arch: ModelArch
    layout: TrainLayout
    rollout_tp: int
    load_format: str
    bucket_bytes: int
    buckets: tuple[Bucket, ...] = field(repr=False)

    @property
    def transfers(self) -> list[ParamTransfer]:
        return [t for b in self.buckets for t in b.transfers]

    def summary(self) -> dict:
        """Counts for logs and the benchmark."""
        transfers = self.transfers
        return {
            "load_format": self.load_format,
            "train_tp": self.layout.tp_size,
            "train_pp": self.layout.pp_size,
            "train_vpp": self.layout.vpp_size,
            "train_ep": self.layout.ep_size,
            "train_etp": self.layout.etp_size,
            "rollout_tp": self.rollout_tp,
            "experts": sum(t.ep_rank is not None for t in transfers),
            "params": len(transfers),
            "gathered": sum(t.mode == "gather" for t in transfers),
            "local": sum(t.mode == "local" for t in transfers),
            "buckets": len(self.buckets),
            "max_bucket_bytes": max((b.nbytes for b in self.buckets), default=0),
        }


def _owner(name: str, arch: ModelArch, layout: TrainLayout) -> tuple[int, int | None, int | None, str]:
    """(pp_rank, vpp_rank, ep_rank, local name) of the chunk holding ``name`` (a vision tower: stage 0;
    ep_rank None for everything but routed experts)."""
    pp_rank, vpp_rank, local = param_owner(name, arch.num_layers, layout.pp_size, layout.vpp_size)
    if arch.moe is None:
        return pp_rank, vpp_rank, None, local
    ep_rank, local = expert_owner(local, arch.moe.num_experts, layout.ep_size)
    return pp_rank, vpp_rank, ep_rank, local


# -- vLLM's per-rank layout (sharded format) ------------------------------------------------------

# Megatron parameter -> (its first HF tensor's leaf, vLLM's fused leaf in the same module). The
# module path comes from the HF name: Qwen2-MoE's ``mlp.shared_expert`` and DeepSeek-V3's /
# GLM-4.5's ``mlp.shared_experts`` both keep theirs in vLLM.
_VLLM_FUSED = {
    "self_attention.linear_qkv.weight": ("q_proj.weight", "qkv_proj.weight"),
    "self_attention.linear_qkv.bias": ("q_proj.bias", "qkv_proj.bias"),
    "mlp.linear_fc1.weight": ("gate_proj.weight", "gate_up_proj.weight"),
    "mlp.shared_experts.linear_fc1.weight": ("gate_proj.weight", "gate_up_proj.weight"),
}
# Megatron parameters whose TP shard equals vLLM's shard rank for rank when the TP sizes match.
_ALIGNED_SUFFIXES = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
    "shared_experts.linear_fc1.weight",
    "shared_experts.linear_fc2.weight",
)
VLLM_VOCAB_PADDING = 64
# vLLM 0.32's module holding a sparse layer's fused experts, under the family's MoE block
# (``mlp`` or ``block_sparse_moe``); its parameters are w13_weight [E, 2F/tp, H] and w2_weight [E, H, F/tp].
VLLM_EXPERTS = "experts.routed_experts"
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def vllm_kv_heads_per_rank(arch: ModelArch, rollout_tp: int) -> int:
    """vLLM keeps at least one KV head per rank, replicating heads when TP exceeds them."""
    return max(1, arch.num_kv_heads // rollout_tp)


def _vllm_shard_shape(hf_name: str, shape: tuple[int, ...], arch: ModelArch, tp: int) -> tuple[int, ...]:
    """Per-rank shape vLLM gives an HF tensor (before q/k/v and gate/up fusion)."""
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return (shape[0] // tp, *shape[1:])
    if hf_name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return (vllm_kv_heads_per_rank(arch, tp) * arch.head_dim, *shape[1:])
    if hf_name.endswith(("gate_proj.weight", "up_proj.weight", ".w1.weight", ".w3.weight")):
        return (shape[0] // tp, *shape[1:])
    if hf_name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        return (shape[0], shape[1] // tp)
    if hf_name.endswith(("embed_tokens.weight", "lm_head.weight")):
        padded = -(-shape[0] // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        return (padded // tp, *shape[1:])
    return shape  # norms: replicated


def vllm_param_name(mcore_name: str, hf_name: str) -> str:
    """vLLM's parameter name for a Megatron parameter (fused q/k/v, gate/up and experts).

    A routed expert maps to its layer's fused ``w13_weight`` (gate/up) or ``w2_weight`` (down);
    ``vllm_expert_index`` says which row.
    """
    m = _EXPERT_INDEX.search(hf_name)
    if m:  # model.layers.L.<block>.experts.E.<proj>.weight
        block = hf_name[: m.start()]
        return f"{block}.{VLLM_EXPERTS}.{'w13_weight' if 'linear_fc1' in mcore_name else 'w2_weight'}"
    for suffix, (hf_leaf, fused) in _VLLM_FUSED.items():
        if mcore_name.endswith(suffix):
            if not hf_name.endswith(hf_leaf):
                raise ValueError(
                    f"weight sync: {mcore_name} exports {hf_name}, expected a name ending in {hf_leaf}"
                )
            return hf_name.removesuffix(hf_leaf) + fused
    return hf_name


def vllm_hf_tensors(name: str, full: torch.Tensor, arch: ModelArch) -> list[tuple[str, torch.Tensor]]:
    """``mcore_to_hf`` as vLLM's loader takes it, one expert at a time.

    A routed expert that the checkpoint stores as row ``e`` of a stacked tensor (Qwen3-VL-MoE's
    ``…mlp.experts.gate_up_proj[e]``, ``[hidden, 2F]``; ``…down_proj[e]``, ``[F, hidden]``) goes
    under Qwen3-MoE's per-expert names, ``…mlp.experts.e.gate_proj.weight`` and ``up_proj.weight``
    (``[F, hidden]`` each) and ``down_proj.weight`` (``[hidden, F]``): vLLM's ``RoutedExperts``
    loader maps these onto expert ``e``'s rows, while a stacked tensor must carry every expert
    (its rows are taken as experts 0, 1, ...). Everything else passes through.
    """
    out = []
    for hf_name, t in mcore_to_hf(name, full, arch):
        stack, e = split_stacked_row(hf_name)
        if e is None:
            out.append((hf_name, t))
            continue
        experts, _, projection = stack.rpartition(".")  # …mlp.experts, gate_up_proj / down_proj
        weight = t.transpose(0, 1)  # back to megatron's [out, in]: the per-expert HF orientation
        if projection == "gate_up_proj":
            gate, up = weight.chunk(2, dim=0)
            out += [(f"{experts}.{e}.gate_proj.weight", gate), (f"{experts}.{e}.up_proj.weight", up)]
        elif projection == "down_proj":
            out.append((f"{experts}.{e}.down_proj.weight", weight))
        else:
            raise ValueError(f"weight sync: no per-expert names for the stacked tensor {stack}")
    return out


def vllm_expert_index(hf_name: str) -> int | None:
    """The expert of an HF expert tensor name (``….experts.5.gate_proj.weight`` -> 5), else None."""
    m = _EXPERT_INDEX.search(hf_name)
    return int(m.group(1)) if m else None


def _targets(name: str, arch: ModelArch, load_format: str, rollout_tp: int, tp: int) -> tuple[Target, ...]:
    import torch

    meta = torch.empty(mcore_full_shape(name, arch, tp), device="meta")
    hf = [(n, tuple(t.shape)) for n, t in vllm_hf_tensors(name, meta, arch)]
    if load_format == "hf":
        return tuple(Target(n, s) for n, s in hf)
    out = []
    expert = vllm_expert_index(hf[0][0]) if hf else None
    for rank in range(rollout_tp):
        shapes = [_vllm_shard_shape(n, s, arch, rollout_tp) for n, s in hf]
        if len(hf) > 1:  # fused: q/k/v or gate/up concatenated along dim 0
            fused = (sum(s[0] for s in shapes), *shapes[0][1:])
            out.append(Target(vllm_param_name(name, hf[0][0]), fused, rank, expert))
        elif expert is not None:
            out.append(Target(vllm_param_name(name, hf[0][0]), shapes[0], rank, expert))
        elif hf:
            out.append(Target(hf[0][0], shapes[0], rank))
    return tuple(out)


# -- the plan -------------------------------------------------------------------------------------


def _check_experts(arch: ModelArch, layout: TrainLayout, load_format: str, rollout_tp: int) -> None:
    moe = arch.moe
    if moe is None:
        if layout.ep_size > 1:
            raise ValueError(
                f"expert_model_parallel_size={layout.ep_size}: {arch.architecture} has no experts"
            )
        return
    if moe.num_experts % layout.ep_size:
        raise ValueError(
            f"expert_model_parallel_size={layout.ep_size} does not divide the {moe.num_experts} experts"
        )
    if load_format == "sharded" and moe.ffn_hidden_size % rollout_tp:
        raise ValueError(
            f"rollout tensor_model_parallel_size={rollout_tp} does not divide the experts' width "
            f"moe_intermediate_size={moe.ffn_hidden_size} (vLLM splits every expert over its TP ranks)"
        )


def build_sync_plan(
    arch: ModelArch,
    layout: TrainLayout,
    rollout_tp: int,
    load_format: str = "hf",
    bucket_bytes: int = 512 * 2**20,
    dtype_bytes: int = 2,
) -> SyncPlan:
    """The full plan for syncing an ``arch`` actor in ``layout`` into a rollout engine at ``rollout_tp``."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"actor_rollout_ref.rollout.load_format={load_format!r} is not one of {LOAD_FORMATS}"
        )
    if rollout_tp < 1:
        raise ValueError(f"rollout tensor_model_parallel_size={rollout_tp} must be >= 1")
    if bucket_bytes < 1:
        raise ValueError(f"update_weights_bucket_megabytes must be positive, got {bucket_bytes} bytes")
    if load_format == "sharded" and arch.vision is not None:
        raise ValueError(
            f"actor_rollout_ref.rollout.load_format=sharded is not supported for {arch.architecture} "
            "(vLLM's per-rank layout of the vision tower is not planned); use load_format=hf"
        )
    if load_format == "sharded" and arch.mla is not None:
        raise ValueError(
            f"actor_rollout_ref.rollout.load_format=sharded is not supported for {arch.architecture}: vLLM "
            "fuses multi-latent attention's q_a_proj and kv_a_proj_with_mqa and derives its absorbed "
            "kv_b_proj matrices after loading, which the sharded plan does not model; use load_format=hf"
        )
    if load_format == "sharded" and arch.num_attention_heads % rollout_tp:
        raise ValueError(
            f"rollout tensor_model_parallel_size={rollout_tp} does not divide the "
            f"{arch.num_attention_heads} attention heads"
        )
    _check_experts(arch, layout, load_format, rollout_tp)
    aligned_tp = load_format == "sharded" and rollout_tp == layout.tp_size
    transfers = []
    for name in mcore_param_names(arch):
        pp_rank, vpp_rank, ep_rank, local = _owner(name, arch, layout)
        tp_dim = tp_partition_dim(name, arch)
        targets = _targets(name, arch, load_format, rollout_tp, layout.tp_size)
        if not targets:
            continue  # not exported (tied LM head)
        # Experts are split over ETP and always arrive whole; the rest may line up with vLLM's TP.
        split = layout.etp_size if is_expert_param(name, arch) else layout.tp_size
        aligned = (
            aligned_tp
            and ep_rank is None
            and name.endswith(_ALIGNED_SUFFIXES)
            and (arch.num_kv_heads >= rollout_tp or "linear_qkv" not in name)
        )
        mode = "local" if tp_dim is None or split == 1 or aligned else "gather"
        full = tuple(mcore_full_shape(name, arch, layout.tp_size))
        source = full
        if mode == "local" and tp_dim is not None and split > 1:
            rows = sum(s.length for s in tp_shard_slices(name, arch, 0, split))
            source = (*full[:tp_dim], rows, *full[tp_dim + 1 :])
        transfers.append(
            ParamTransfer(name, pp_rank, vpp_rank, local, tp_dim, mode, full, source, targets, ep_rank)
        )
    buckets, current, size = [], [], 0
    for t in transfers:
        nbytes = t.nbytes(dtype_bytes)
        if current and size + nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(current), size))
            current, size = [], 0
        current.append(t)
        size += nbytes
    if current:
        buckets.append(Bucket(tuple(current), size))
    return SyncPlan(arch, layout, rollout_tp, load_format, bucket_bytes, tuple(buckets))
