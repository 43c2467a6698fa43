"""The resharding plan: which Megatron shards feed which rollout tensors. Pure and deterministic.

Built from parameter metadata only (the architecture, the training TP/PP/VPP
layout, the rollout TP size and the load format), so it is tested without
processes and is identical on every rank. Executing it (``execute.py``)
moves data; the plan never does.

For every Megatron parameter (global name) the plan records:

- the owner: pipeline rank and virtual chunk holding it, and its local name
  in that chunk;
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

Load formats:

- ``hf``: full tensors with HF names; vLLM's own loader slices them. Every
  TP-split parameter needs a gather. Vision-language models stream the vision
  tower and merger too (owned by pipeline stage 0), under the hub's names
  (``visual.*``, ``model.*``, ``lm_head.weight``), which vLLM maps itself.
- ``sharded``: tensors already cut for the receiving vLLM TP rank, with
  vLLM's fused names (``qkv_proj``, ``gate_up_proj``). When rollout TP ==
  training TP, the QKV, gate/up, output-projection and down-projection shards
  line up rank for rank, so they are converted locally with no communication.
  The vocabulary does not line up (Megatron pads to a multiple of
  ``128 × tp``, vLLM to 64), so embeddings are gathered; so is everything when
  the TP sizes differ. KV heads are replicated when rollout TP exceeds them,
  as vLLM does. Not available for vision-language models (refused when planned).

Buckets: parameters are packed in model order into buckets of at most
``bucket_bytes`` (a parameter larger than that gets a bucket of its own), so
peak extra memory during a sync is one bucket plus the largest tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_megatron.config.model_arch import ModelArch
from rlhf_megatron.models.spec import (
    mcore_full_shape,
    mcore_param_names,
    mcore_to_hf,
    param_owner,
    tp_partition_dim,
    tp_shard_slices,
)

LOAD_FORMATS = ("hf", "sharded")


@dataclass(frozen=True)
class TrainLayout:
    """The actor's Megatron layout."""

    tp_size: int = 1
    pp_size: int = 1
    vpp_size: int | None = None

    def __post_init__(self):
        if self.tp_size < 1 or self.pp_size < 1 or (self.vpp_size is not None and self.vpp_size < 1):
            raise ValueError(f"invalid training layout {self}")


@dataclass(frozen=True)
class Target:
    """One tensor the rollout engine receives."""

    name: str
    shape: tuple[int, ...]
    rollout_rank: int | None = None
    """For the sharded format: the vLLM TP rank this slice is for. None = the same full tensor for all."""


@dataclass(frozen=True)
class ParamTransfer:
    """How one Megatron parameter reaches the rollout engine."""

    name: str
    """Global Megatron name (``decoder.layers.7.mlp.linear_fc1.weight``)."""
    pp_rank: int
    vpp_rank: int | None
    local_name: str
    """The name inside the owning model chunk (layer numbers local to the chunk)."""
    tp_dim: int | None
    mode: str
    """``gather`` or ``local`` (see module docstring)."""
    full_shape: tuple[int, ...]
    source_shape: tuple[int, ...]
    """What the owning stage hands on: the full tensor, or for aligned ``local`` transfers its TP shard."""
    targets: tuple[Target, ...]

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
            "rollout_tp": self.rollout_tp,
            "params": len(transfers),
            "gathered": sum(t.mode == "gather" for t in transfers),
            "local": sum(t.mode == "local" for t in transfers),
            "buckets": len(self.buckets),
            "max_bucket_bytes": max((b.nbytes for b in self.buckets), default=0),
        }


def _owner(name: str, arch: ModelArch, layout: TrainLayout) -> tuple[int, int | None, str]:
    """(pp_rank, vpp_rank, local name) of the chunk holding ``name`` (a vision tower: stage 0)."""
    return param_owner(name, arch.num_layers, layout.pp_size, layout.vpp_size)


# -- vLLM's per-rank layout (sharded format) ------------------------------------------------------

_VLLM_FUSED = {"self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
               "self_attention.linear_qkv.bias": "self_attn.qkv_proj.bias",
               "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight"}  # fmt: skip
# Megatron parameters whose TP shard equals vLLM's shard rank for rank when the TP sizes match.
_ALIGNED_SUFFIXES = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)
VLLM_VOCAB_PADDING = 64


def vllm_kv_heads_per_rank(arch: ModelArch, rollout_tp: int) -> int:
    """vLLM keeps at least one KV head per rank, replicating heads when TP exceeds them."""
    return max(1, arch.num_kv_heads // rollout_tp)


def _vllm_shard_shape(hf_name: str, shape: tuple[int, ...], arch: ModelArch, tp: int) -> tuple[int, ...]:
    """Per-rank shape vLLM gives an HF tensor (before q/k/v and gate/up fusion)."""
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return (shape[0] // tp, *shape[1:])
    if hf_name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return (vllm_kv_heads_per_rank(arch, tp) * arch.head_dim, *shape[1:])
    if hf_name.endswith(("gate_proj.weight", "up_proj.weight")):
        return (shape[0] // tp, *shape[1:])
    if hf_name.endswith(("o_proj.weight", "down_proj.weight")):
        return (shape[0], shape[1] // tp)
    if hf_name.endswith(("embed_tokens.weight", "lm_head.weight")):
        padded = -(-shape[0] // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        return (padded // tp, *shape[1:])
    return shape  # norms: replicated


def vllm_param_name(mcore_name: str, hf_name: str) -> str:
    """vLLM's parameter name for a Megatron parameter (fused q/k/v and gate/up)."""
    for suffix, fused in _VLLM_FUSED.items():
        if mcore_name.endswith(suffix):
            layer = mcore_name.split(".")[2]
            return f"model.layers.{layer}.{fused}"
    return hf_name


def _targets(name: str, arch: ModelArch, load_format: str, rollout_tp: int, tp: int) -> tuple[Target, ...]:
    import torch

    meta = torch.empty(mcore_full_shape(name, arch, tp), device="meta")
    hf = [(n, tuple(t.shape)) for n, t in mcore_to_hf(name, meta, arch)]
    if load_format == "hf":
        return tuple(Target(n, s) for n, s in hf)
    out = []
    for rank in range(rollout_tp):
        shapes = [_vllm_shard_shape(n, s, arch, rollout_tp) for n, s in hf]
        if len(hf) > 1:  # fused: q/k/v or gate/up concatenated along dim 0
            fused = (sum(s[0] for s in shapes), *shapes[0][1:])
            out.append(Target(vllm_param_name(name, hf[0][0]), fused, rank))
        elif hf:
            out.append(Target(hf[0][0], shapes[0], rank))
    return tuple(out)


# -- the plan -------------------------------------------------------------------------------------


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
    if load_format == "sharded" and arch.num_attention_heads % rollout_tp:
        raise ValueError(
            f"rollout tensor_model_parallel_size={rollout_tp} does not divide the "
            f"{arch.num_attention_heads} attention heads"
        )
    aligned_tp = load_format == "sharded" and rollout_tp == layout.tp_size
    transfers = []
    for name in mcore_param_names(arch):
        pp_rank, vpp_rank, local = _owner(name, arch, layout)
        tp_dim = tp_partition_dim(name, arch)
        targets = _targets(name, arch, load_format, rollout_tp, layout.tp_size)
        if not targets:
            continue  # not exported (tied LM head)
        aligned = (
            aligned_tp
            and name.endswith(_ALIGNED_SUFFIXES)
            and (arch.num_kv_heads >= rollout_tp or "linear_qkv" not in name)
        )
        mode = "local" if tp_dim is None or layout.tp_size == 1 or aligned else "gather"
        full = tuple(mcore_full_shape(name, arch, layout.tp_size))
        source = full
        if mode == "local" and tp_dim is not None and layout.tp_size > 1:
            rows = sum(s.length for s in tp_shard_slices(name, arch, 0, layout.tp_size))
            source = (*full[:tp_dim], rows, *full[tp_dim + 1 :])
        transfers.append(ParamTransfer(name, pp_rank, vpp_rank, local, tp_dim, mode, full, source, targets))
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
