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

__all__ = ["ParamCount", "arch_for_role", "count_parameters", "count_vision_parameters", "read_hf_config"]

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
    """Patch embedding (no bias), ``depth`` blocks (norms, fused QKV and output projection with
    biases, SwiGLU or fc1/fc2 MLP with biases) and the merger (norm, two biased linears), as HF
    stores them (the MLP unpadded)."""
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
    merger = norm + (merged * merged + merged) + (merged * out + out)
    return h * vision.patch_dim + vision.depth * block + merger


def count_parameters(arch: ModelArch) -> ParamCount:
    """Parameters of ``arch`` (RMSNorm, RoPE, GQA, SwiGLU; Q/K/V biases and q/k norms where the
    family has them; routers, routed and shared experts of sparse layers; the vision tower of a
    vision-language model). A value or reward head is a hidden -> 1 projection (plus its bias)."""
    h, d = arch.hidden_size, arch.head_dim
    q_width, kv_width = arch.num_attention_heads * d, arch.num_kv_heads * d
    attention = h * q_width + 2 * h * kv_width + q_width * h
    if arch.qkv_bias:
        attention += q_width + 2 * kv_width
    if arch.qk_norm:
        attention += 2 * d
    norms = 2 * h
    layers, experts, active = [], [], []
    for i in range(arch.num_layers):
        if not arch.is_moe_layer(i):
            layers.append(attention + norms + 3 * h * arch.ffn_hidden_size)  # gate, up, down
            experts.append(0)
            active.append(0)
            continue
        moe = arch.moe
        shared = 0
        if moe.shared_expert_ffn_hidden_size:  # SwiGLU plus its [1, hidden] sigmoid gate
            shared = 3 * h * moe.shared_expert_ffn_hidden_size + h
        layers.append(attention + norms + moe.num_experts * h + shared)  # router [E, hidden]
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
