"""LoRA's terms of the memory plan (``actor_rollout_ref.model.lora_rank > 0``).

Role: the arithmetic ``planner.py`` needs for a LoRA run, from the adapted projections that
``config.lora_targets.resolve_targets`` selects and the architecture's widths:

* Adapter parameters on one rank: an adapted HF projection of widths (in, out) holds A [r, in]
  and B [out, r]. Column-parallel projections (q/k/v_proj, gate/up_proj) keep A whole and split
  B over TP; row-parallel ones (o_proj, down_proj) split A and keep B whole. A pipeline rank
  holds its own layers' adapters. They are fp32 whatever the model's dtype, so they need no
  fp32 master copy: 4 B weight + 4 B main grad + 8 B Adam m and v per adapter parameter.
* Activations an update keeps per token and layer: the adapter casts its input to fp32 before
  ``x A^T`` (a copy of the linear's input that autograd keeps for A's gradient, unless the model
  is fp32 already) and keeps the rank-``r`` product ``x A^T`` for B's gradient.

Boundaries: arithmetic only (``resolve_targets`` is imported when a run has adapters, so plans
without LoRA never import torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config.errors import ConfigError
from rlhf_megatron.config.schema_model import LoraConfig
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = ["COLUMN_PARTS", "AdapterPlan", "adapter_plan", "lora_config", "part_widths"]

COLUMN_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""HF projections megatron runs column-parallel (input whole, output split over TP)."""
FP32_BYTES = 4
ADAM_BYTES = 8  # fp32 m and v; an fp32 parameter is its own master copy
KEY = "actor_rollout_ref.model"


def part_widths(arch: ModelArch, part: str) -> tuple[int, int]:
    """(in, out) features of HF projection ``part`` of a decoder layer (dense MLP widths: the
    experts of a sparse layer never get adapters)."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
    }[part]


@dataclass(frozen=True)
class AdapterPlan:
    """The actor's adapters: which projections of which layers, and their sizes."""

    lora: LoraConfig
    arch: ModelArch
    targets: dict[int, dict[str, tuple[str, ...]]]
    """Global layer -> megatron linear -> adapted HF parts (``config.lora_targets.resolve_targets``)."""

    def _parts(self, layers: list[int] | range) -> list[str]:
        return [part for layer in layers for parts in self.targets.get(layer, {}).values() for part in parts]

    def params(self, layers: list[int] | range | None = None, tp: int = 1) -> int:
        """Adapter parameters one TP rank holds for ``layers`` (every layer when None)."""
        r = self.lora.rank
        total = 0
        for part in self._parts(range(self.arch.num_layers) if layers is None else layers):
            i, o = part_widths(self.arch, part)
            total += r * i + o * r // tp if part in COLUMN_PARTS else r * i // tp + o * r
        return total

    @property
    def total(self) -> int:
        """Adapter parameters of the whole model."""
        return self.params()

    def activation_bytes(self, tp: int, sequence_parallel: bool, params_dtype: str) -> float:
        """Bytes an update keeps per (context-parallel local) token and layer for the adapters,
        averaged over the layers: each adapted linear's fp32 input copy (/ TP where the input is
        split: a row-parallel linear's features, a column-parallel one's sequence under SP) and
        its ``x A^T`` of ``r`` per adapted part (fp32)."""
        sp = sequence_parallel and tp > 1
        total = 0.0
        for linears in self.targets.values():
            for parts in linears.values():
                i, _ = part_widths(self.arch, parts[0])  # the fused parts share their input
                column = parts[0] in COLUMN_PARTS
                split = (tp if sp else 1) if column else tp
                copy = 0.0 if params_dtype == "float32" else i / split
                total += FP32_BYTES * (copy + len(parts) * self.lora.rank)
        return total / self.arch.num_layers

    def training_state(self, tp: int, layers: list[int], dp: int, distributed: bool) -> dict[str, float]:
        """Bytes of the adapters' weights, fp32 main grads and Adam state on one rank holding
        ``layers`` (Adam's shard over DP with the distributed optimizer, else whole), and the
        optimizer state with the other ``use_distributed_optimizer`` setting."""
        n = self.params(layers, tp)
        sharded, whole = n / dp * ADAM_BYTES, n * ADAM_BYTES
        return {
            "params": n,
            "weights": n * FP32_BYTES,
            "grads": n * FP32_BYTES,
            "optimizer": sharded if distributed else whole,
            "optimizer_other": whole if distributed else sharded,
        }


def lora_config(cfg: DictConfig | Any) -> LoraConfig | None:
    """The actor's LoRA section of a loaded config, or None for full fine-tuning."""
    if not OmegaConf.select(cfg, f"{KEY}.lora_rank", default=0):
        return None
    model = cfg.actor_rollout_ref.model
    return (OmegaConf.to_object(model) if OmegaConf.is_config(model) else model).lora


def adapter_plan(cfg: DictConfig | Any, arch: ModelArch) -> AdapterPlan | None:
    """The actor's adapters, or None without LoRA. Raises ``ConfigError`` naming the
    ``target_modules`` entry that does not fit ``arch``."""
    lora = lora_config(cfg)
    if lora is None:
        return None
    from rlhf_megatron.planning.lora_targets import LoraTargetError, resolve_targets

    try:
        targets = resolve_targets(arch, lora, KEY)
    except LoraTargetError as exc:
        raise ConfigError(f"cannot plan memory: {exc}") from exc
    return AdapterPlan(lora=lora, arch=arch, targets=targets)
