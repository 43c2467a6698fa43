"""Architecture numbers of a role's model, and parameter counts derived from them.

Role: gives validation and the memory planner the few numbers they need (layers, heads,
widths, vocabulary, position limit) without a model hub or transformers: from the
``model_arch`` section when a preset carries one, else from ``<model.path>/config.json``
read as plain JSON. ``count_parameters`` computes a Llama/Qwen2-style decoder's size from
them; a test holds it to published totals within 0.5%.

Boundaries: pure functions over the config and JSON files; no torch, no transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config.schema import ModelArchConfig

__all__ = [
    "ParamCount",
    "arch_for_role",
    "arch_from_hf_config",
    "count_parameters",
    "head_dim",
    "kv_heads",
    "read_hf_config",
]

# HF model types whose Q/K/V projections carry a bias although config.json does not say so.
_QKV_BIAS_MODEL_TYPES = {"qwen2", "qwen2_moe"}


def read_hf_config(model_path: str | None) -> dict[str, Any] | None:
    """``<model_path>/config.json`` as a dict, or None when there is no such local file."""
    if not model_path:
        return None
    path = Path(model_path).expanduser() / "config.json"
    if not path.is_file():
        return None
    with open(path) as fh:
        return json.load(fh)


def arch_from_hf_config(hf: dict[str, Any]) -> ModelArchConfig:
    """Map an HF ``config.json`` (Llama, Qwen2, Mistral naming) to ``ModelArchConfig``."""
    # Multimodal and some newer configs nest the language model's numbers.
    hf = hf.get("text_config", hf)
    heads = hf["num_attention_heads"]
    return ModelArchConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", False)) or hf.get("model_type") in _QKV_BIAS_MODEL_TYPES,
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        max_position_embeddings=hf["max_position_embeddings"],
        head_dim=hf.get("head_dim"),
    )


def _as_arch(node: Any) -> ModelArchConfig:
    if isinstance(node, ModelArchConfig):
        return node
    return ModelArchConfig(**OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]


def arch_for_role(cfg: DictConfig, role: str) -> tuple[ModelArchConfig | None, str]:
    """Architecture of ``role`` (actor, ref, critic or reward_model) and where it came from.

    ``model_arch`` describes ``actor_rollout_ref.model``, so it serves the actor, the
    reference and a critic that starts from the same path. A critic on another path, and
    the reward model, use their own ``config.json``. Returns ``(None, reason)`` when unknown.
    """
    actor_path = cfg.actor_rollout_ref.model.path
    path = {
        "actor": actor_path,
        "ref": actor_path,
        "critic": cfg.critic.model.path,
        "reward_model": cfg.reward_model.model.path,
    }[role]
    if cfg.model_arch is not None and path == actor_path:
        return _as_arch(cfg.model_arch), "model_arch"
    hf = read_hf_config(path)
    if hf is not None:
        return arch_from_hf_config(hf), f"{path}/config.json"
    return None, f"no model_arch section and no config.json under {path}"


def head_dim(arch: ModelArchConfig) -> int:
    return arch.head_dim or arch.hidden_size // arch.num_attention_heads


def kv_heads(arch: ModelArchConfig) -> int:
    return arch.num_key_value_heads or arch.num_attention_heads


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a decoder, split where pipeline stages and TP split them."""

    embedding: int
    """Input embedding (vocab x hidden); lives on the first pipeline stage."""
    per_layer: int
    """One transformer layer: attention, SwiGLU MLP, two RMSNorms."""
    num_layers: int
    """Layers in the model."""
    final_norm: int
    """Final RMSNorm; last stage."""
    output: int
    """LM head (0 when tied to the embedding) or value head; last stage."""

    @property
    def total(self) -> int:
        return self.embedding + self.per_layer * self.num_layers + self.final_norm + self.output


def count_parameters(arch: ModelArchConfig, value_head: bool = False) -> ParamCount:
    """Parameters of a Llama/Qwen2-style decoder (RMSNorm, RoPE, GQA, SwiGLU, no biases except
    optional Q/K/V biases). ``value_head`` replaces the LM head by a hidden -> 1 projection,
    as the critic does."""
    h, d = arch.hidden_size, head_dim(arch)
    q_width, kv_width = arch.num_attention_heads * d, kv_heads(arch) * d
    attention = h * q_width + 2 * h * kv_width + q_width * h
    if arch.qkv_bias:
        attention += q_width + 2 * kv_width
    mlp = 3 * h * arch.ffn_hidden_size  # gate, up, down
    norms = 2 * h
    embedding = arch.vocab_size * h
    if value_head:
        output = h
    else:
        output = 0 if arch.tie_word_embeddings else arch.vocab_size * h
    return ParamCount(
        embedding=embedding,
        per_layer=attention + mlp + norms,
        num_layers=arch.num_layers,
        final_norm=h,
        output=output,
    )
