"""Rewards: rule-based scorers by data source, EasyR1's math/r1v scores, custom reward functions,
and the reward manager.

No Megatron, Ray or vLLM imports (see docs/concepts/architecture.md). The scorers and `registry`
import no torch so that scoring worker processes (`pool`) start quickly; the torch-based manager
names (`RewardManager`, `RewardFn`, `RewardResult`) are therefore loaded on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlhf_megatron.rewards.registry import (
    CustomRewardFn,
    NamedScoreFn,
    default_compute_score,
    known_data_sources,
    load_custom_reward_fn,
    register_scorer,
    resolve_compute_score,
    scorer_names,
)

_LAZY = {"RewardFn", "RewardFunctionError", "RewardManager", "RewardResult"}

__all__ = [
    "CustomRewardFn",
    "NamedScoreFn",
    "RewardFn",
    "RewardFunctionError",
    "RewardManager",
    "RewardResult",
    "default_compute_score",
    "known_data_sources",
    "load_custom_reward_fn",
    "register_scorer",
    "resolve_compute_score",
    "scorer_names",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("rlhf_megatron.rewards.manager"), name)
    raise AttributeError(f"module 'rlhf_megatron.rewards' has no attribute {name!r}")
