"""Helpers for the config tests: a small valid config built from overrides, HF config files."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_megatron.planning import load_config

# A 4-layer GQA model: 4 query heads, 2 KV heads.
TINY_ARCH = [
    "model_arch.model_type=llama",
    "model_arch.num_hidden_layers=4",
    "model_arch.hidden_size=256",
    "model_arch.num_attention_heads=4",
    "model_arch.num_key_value_heads=2",
    "model_arch.intermediate_size=512",
    "model_arch.vocab_size=384",
    "model_arch.max_position_embeddings=2048",
]
# Valid on 8 GPUs with the default layout (TP=PP=CP=1, so DP=8) and the default gae + critic.
VALID = [
    *TINY_ARCH,
    "trainer.n_gpus_per_node=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=4",
]

# The base model as a mixture of experts: 6 experts of width 98, 2 per token.
MOE_ARCH = [
    "model_arch.architectures=[Qwen3MoeForCausalLM]",
    "model_arch.model_type=qwen3_moe",
    "model_arch.moe_intermediate_size=98",
    "model_arch.num_experts=6",
    "model_arch.num_experts_per_tok=2",
]


def make_cfg(*overrides: str, validate: bool = False):
    """A resolved config from VALID plus ``overrides`` (validated only when asked)."""
    return load_config(None, [*VALID, *overrides], validate=validate)


def write_hf_config(directory: Path, **fields) -> Path:
    """An HF-style config.json (Qwen2.5-3B numbers unless overridden) in ``directory``."""
    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    }
    hf.update(fields)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    return directory
