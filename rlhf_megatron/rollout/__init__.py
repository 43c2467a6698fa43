"""Rollout engines: vLLM colocated with the actor, and a transformers fallback.

``build_rollout_engine(name, ...)`` picks one by ``actor_rollout_ref.rollout.name``.
"""

from __future__ import annotations

from typing import Any

from rlhf_megatron.choices import RolloutName
from rlhf_megatron.config.schema import RolloutConfig
from rlhf_megatron.rollout.base import UNFINISHED_KEY, RolloutEngine, RolloutSampling, assemble_rollout

ROLLOUT_NAMES = RolloutName.values()  # actor_rollout_ref.rollout.name

__all__ = [
    "ROLLOUT_NAMES",
    "UNFINISHED_KEY",
    "RolloutEngine",
    "RolloutSampling",
    "assemble_rollout",
    "build_rollout_engine",
]


def build_rollout_engine(name: str, model_path: str, rollout: RolloutConfig, **kwargs: Any) -> RolloutEngine:
    """``vllm`` or ``hf``; keyword arguments go to the engine's constructor."""
    if name == "vllm":
        from rlhf_megatron.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, rollout, **kwargs)
    if name == "hf":
        from rlhf_megatron.rollout.hf_engine import HFEngine

        return HFEngine(model_path, rollout, **kwargs)
    raise ValueError(f"actor_rollout_ref.rollout.name={name!r} is not one of {ROLLOUT_NAMES}")
