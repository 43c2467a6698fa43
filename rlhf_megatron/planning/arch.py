"""Which architecture each role's model has, and parameter counts derived from it.

Role: gives validation, the memory planner and the trainer's MFU one ``ModelArch`` per
role without a model hub or transformers: from the ``model_arch`` section when a preset
carries one (HF ``config.json`` keys), else from ``<model.path>/config.json``.
``count_parameters`` computes the model's size from it, total and active (what one token
passes through: for a mixture-of-experts model its top-k experts, not all); a test holds
them to published figures.

Boundaries: pure functions over the config and JSON files; no torch, no transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.planning.model_arch import HeadKind, ModelArch, VisionArch

__all__ = [
    "ParamCount",
    "arch_for_role",
    "count_attention_parameters",
    "count_parameters",
    "count_vision_parameters",
    "kv_cache_values_per_token",
    "read_hf_config",
]

# Role -> the head its model carries.
_ROLE_HEADS: dict[str, HeadKind] = {"actor": "lm", "ref": "lm", "critic": "value", "reward_model": "reward"}


def read_hf_config(model_path: str | None) -> dict[str, Any] | None:
    """``<model_path>/config.json`` as a dict, or None when there is no such local file."""
    if not model_path:
        return None
    path = Path(model_path).expanduser() / "config.json"
    if not path.is_file():
        return None
    with open(path) as fh:
        return json.load(fh)


def arch_for_role(cfg: DictConfig | Any, role: str) -> tuple[ModelArch | None, str]:
    """Architecture of ``role`` (actor, ref, critic or reward_model) and where it came from.
    ``cfg``: the loaded DictConfig or the typed ``RunConfig``.

    ``model_arch`` describes ``actor_rollout_ref.model``, so it serves the actor, the
    reference and a critic that starts from the same path. A critic on another path, and
    the reward model, use their own ``config.json``. Returns ``(None, reason)`` when unknown.
    Raises ``model_arch.UnsupportedModelError`` when the description names a model this
    project cannot build.
    """
    actor_path = cfg.actor_rollout_ref.model.path
    path = {
        "actor": actor_path,
        "ref": actor_path,
        "critic": cfg.critic.model.path,
        "reward_model": cfg.reward_model.model.path,
    }[role]
    head = _ROLE_HEADS[role]
    if cfg.model_arch is not None and path == actor_path:
        described = cfg.model_arch
        hf = OmegaConf.to_container(described, resolve=True) if OmegaConf.is_config(described) else described
        return ModelArch.from_hf_config(hf, head=head, source="model_arch"), "model_arch"
    hf = read_hf_config(path)
    if hf is not None:
        source = f"{path}/config.json"
        return ModelArch.from_hf_config(hf, head=head, source=source), source
    return None, f"no model_arch section and no config.json under {path}"


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a decoder, split where pipeline stages, TP and EP split them."""

    embedding: int
    """Input embedding (vocab x hidden); lives on the first pipeline stage."""
    layers: tuple[int, ...]
    """Each transformer layer without its routed experts: attention, two RMSNorms, and the dense
    SwiGLU MLP, or a sparse layer's router and shared expert (TP splits these)."""
    final_norm: int
    """Final RMSNorm; last stage."""
    output: int
    """LM head (0 when tied to the embedding) or value head; last stage."""
    vision: int = 0
    """Vision tower and patch merger of a vision-language model; first stage, like the embedding."""
    experts: tuple[int, ...] = ()
    """Each layer's routed experts, all of them (0 for dense layers; EP x ETP splits these)."""
    active_experts: tuple[int, ...] = ()
    """Each layer's routed experts that one token passes through (its top-k)."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total(self) -> int:
        dense = self.vision + self.embedding + sum(self.layers) + self.final_norm + self.output
        return dense + sum(self.experts)

    @property
    def active(self) -> int:
        """Parameters one token passes through: everything but the experts it is not routed to
        (the published "activated parameters" of MoE models; equal to ``total`` for dense ones)."""
        return self.total - sum(self.experts) + sum(self.active_experts)


def count_vision_parameters(vision: VisionArch) -> int:
    """Patch embedding (Qwen3-VL's with a bias), Qwen3-VL's learned positions, ``depth`` blocks
    (norms, fused QKV and output projection with biases, SwiGLU or fc1/fc2 MLP with biases), the
    merger (norm, two biased linears) and Qwen3-VL's DeepStack mergers (their norm over the merged
    width), as HF stores them (the MLP unpadded)."""
    h, f, merged, out = (
        vision.hidden_size,
        vision.intermediate_size,
        vision.merged_hidden_size,
        vision.out_hidden_size,
    )
    norm = h * (2 if vision.norm == "layernorm" else 1)  # LayerNorm has a bias
    attention = (h * 3 * h + 3 * h) + (h * h + h)
    mlp_in = 2 * (h * f + f) if vision.mlp == "swiglu" else h * f + f
    block = 2 * norm + attention + mlp_in + f * h + h
    linears = (merged * merged + merged) + (merged * out + out)
    merger = norm + linears
    deepstack = len(vision.deepstack_visual_indexes) * (2 * merged + linears)  # LayerNorm over merged
    patch = h * vision.patch_dim + (h if vision.patch_bias else 0)
    positions = (vision.num_position_embeddings or 0) * h
    return patch + positions + vision.depth * block + merger + deepstack


def count_attention_parameters(arch: ModelArch) -> int:
    """One layer's attention, as HF stores it. Grouped-query attention: Q, K, V and output
    projections (Q/K/V biases, q/k norms where the family has them). Multi-latent attention
    (DeepSeek-V3, Kimi-K2): the query bottleneck (``q_a_proj``, its norm, ``q_b_proj``; or one
    ``q_proj``), the shared key/value latent with the rotary key (``kv_a_proj_with_mqa``, its norm,
    ``kv_b_proj`` to every head's key and value) and the output projection."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    mla = arch.mla
    if mla is not None:
        q_out = heads * mla.q_head_dim
        if mla.q_lora_rank is None:
            query = h * q_out
        else:
            query = h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * q_out
        latent = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
        key_value = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        return query + latent + key_value + heads * mla.v_head_dim * h
    d = arch.head_dim
    q_width, kv_width = heads * d, arch.num_kv_heads * d
    attention = h * q_width + 2 * h * kv_width + q_width * h
    if arch.qkv_bias:
        attention += q_width + 2 * kv_width
    if arch.qk_norm:
        attention += 2 * d
    return attention


def kv_cache_values_per_token(arch: ModelArch, tp: int = 1) -> int:
    """Values one token leaves in an inference engine's KV cache on one of ``tp`` ranks, over all
    layers. Grouped-query attention: a key and a value per KV head, the heads split over TP (and
    replicated when TP exceeds them). Multi-latent attention caches the compressed latent and the
    shared rotary key instead (``kv_lora_rank + qk_rope_head_dim`` per layer, 576 for DeepSeek-V3
    where its 128 heads would take 2 x 128 x 192), the same on every TP rank: vLLM's MLA backends
    keep the whole latent on each rank and expand it per head inside attention."""
    if arch.mla is not None:
        return arch.num_layers * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim)
    kv_heads = max(1, arch.num_kv_heads // tp)  # KV heads are replicated when TP exceeds them
    return arch.num_layers * 2 * kv_heads * arch.head_dim


def count_parameters(arch: ModelArch) -> ParamCount:
    """Parameters of ``arch`` (RMSNorm, RoPE, grouped-query or multi-latent attention, SwiGLU;
    routers, routed and shared experts of sparse layers, the leading dense layers among them;
    the vision tower of a vision-language model). A value or reward head is a hidden -> 1
    projection (plus its bias). Next-token-prediction layers (``arch.mtp_layers``) are not
    counted: the engine does not build them and the published totals leave them out."""
    h = arch.hidden_size
    attention = count_attention_parameters(arch)
    norms = 2 * h
    layers, experts, active = [], [], []
    for i in range(arch.num_layers):
        if not arch.is_moe_layer(i):
            layers.append(attention + norms + 3 * h * arch.ffn_hidden_size)  # gate, up, down
            experts.append(0)
            active.append(0)
            continue
        moe = arch.moe
        router = moe.num_experts * h + (moe.num_experts if moe.expert_bias else 0)  # [E, hidden] (+ bias)
        shared = 0
        if moe.shared_expert_ffn_hidden_size:  # SwiGLU, plus Qwen2-MoE's [1, hidden] sigmoid gate
            shared = 3 * h * moe.shared_expert_ffn_hidden_size + (h if moe.shared_expert_gate else 0)
        layers.append(attention + norms + router + shared)
        experts.append(moe.num_experts * 3 * h * moe.ffn_hidden_size)
        active.append(moe.top_k * 3 * h * moe.ffn_hidden_size)
    embedding = arch.vocab_size * h
    if arch.head != "lm":
        output = h + int(arch.head_bias)
    else:
        output = 0 if arch.tie_word_embeddings else arch.vocab_size * h
    return ParamCount(
        embedding=embedding,
        layers=tuple(layers),
        final_norm=h,
        output=output,
        vision=count_vision_parameters(arch.vision) if arch.vision is not None else 0,
        experts=tuple(experts),
        active_experts=tuple(active),
    )
