"""Which config keys take ``auto`` (``parallelism: auto``), and which the search fills in.

Role: the loader takes the ``auto`` values out before it builds the typed config (the schema's
fields are ints and bools) and ``planning.auto_layout`` searches the keys listed here. Key
arithmetic only: the search, its memory plan and its cost model are in ``planning/``.

Boundaries: config only.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config import roles as roles_mod
from rlhf_megatron.config.roles import MICRO_BATCH_SPECS, ROLE_SECTIONS

__all__ = [
    "AUTO",
    "FOLLOWERS",
    "LAYOUT_KEYS",
    "MEGATRON_LAYOUT",
    "MICRO_KEYS",
    "OPTIMIZER_KEYS",
    "ROLLOUT_TP",
    "follower_keys",
    "searchable_keys",
    "take_auto",
]

AUTO = "auto"
MEGATRON_LAYOUT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)
ROLLOUT_TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"
LAYOUT_KEYS = (
    *(f"{ROLE_SECTIONS[r]}.megatron.{k}" for r in ("actor", "ref", "critic") for k in MEGATRON_LAYOUT),
    ROLLOUT_TP,
)
"""Parallel sizes that accept ``auto``."""
OPTIMIZER_KEYS = tuple(f"{ROLE_SECTIONS[r]}.megatron.use_distributed_optimizer" for r in ("actor", "critic"))
"""Whether a trained role shards its optimizer state over data parallelism (ZeRO-1): it saves
memory, and over gloo costs twice the plain all-reduce (a reduce-scatter and an all-gather) plus
two synchronisations per optimizer step."""
MICRO_KEYS = tuple(spec.per_gpu_key for spec in MICRO_BATCH_SPECS)
"""Per-GPU micro-batches that accept ``auto``."""


def take_auto(values: dict[str, Any]) -> tuple[set[str], list[str]]:
    """Remove the ``auto`` values of searchable keys from the loader's flat ``values``; returns
    them, and one message per other key set to ``auto`` (which does not take it)."""
    taken, errors = set(), []
    for key, value in list(values.items()):
        if value != AUTO:
            continue
        if key in LAYOUT_KEYS or key in MICRO_KEYS or key in OPTIMIZER_KEYS:
            taken.add(key)
            del values[key]
        elif key.endswith(("_parallel_size", "micro_batch_size")):
            errors.append(
                f"{key}=auto: only these keys take auto: {', '.join(LAYOUT_KEYS + OPTIMIZER_KEYS + MICRO_KEYS)} "
                "(or the top-level parallelism=auto)"
            )
    return taken, errors


def searchable_keys(cfg: DictConfig, explicit_auto: set[str], set_keys: set[str]) -> list[str]:
    """The keys to search: those set to ``auto``, and with ``parallelism: auto`` every layout key
    of the actor and the rollout and every active role's per-GPU micro-batch that no layer set
    (ref and critic layouts follow the actor's unless set; a micro-batch given as a global size
    or a token budget is left alone). A micro-batch set to ``auto`` for a role the run does not
    have (an overlay's critic under GRPO) is not searched: it keeps the schema's default."""
    roles = set(roles_mod.active_roles(cfg))
    keys = set(explicit_auto) - {s.per_gpu_key for s in MICRO_BATCH_SPECS if s.role not in roles}
    keys -= {k for k in OPTIMIZER_KEYS if k.split(".")[-3] not in roles}
    if cfg.parallelism == AUTO:
        actor = ROLE_SECTIONS["actor"]
        keys |= {f"{actor}.megatron.{k}" for k in MEGATRON_LAYOUT} | {ROLLOUT_TP}
        keys |= {k for k in OPTIMIZER_KEYS if k.split(".")[-3] in roles}
        for spec in MICRO_BATCH_SPECS:
            if spec.role not in roles or OmegaConf.select(cfg, spec.dynamic_key, default=False):
                continue
            if spec.role == "reward_model":  # the reward model's micro-batch has no cost term here
                continue
            keys.add(spec.per_gpu_key)
        keys -= {k for k in keys if k in set_keys or _global_key(k) in set_keys}
    return sorted(keys)


FOLLOWERS = ("ref", "critic")
"""Roles whose layout keys interpolate the actor's (``schema_model.follow_actor_megatron``). The
loader resolves interpolations before the search, so the search writes the actor's values into
theirs itself."""


def follower_keys(keys: list[str], set_keys: set[str]) -> dict[str, list[str]]:
    """Searched actor layout key -> the ref's and critic's same key where no layer set it and it
    is not searched on its own: they take the actor's value, as they would without auto."""
    actor = f"{ROLE_SECTIONS['actor']}.megatron."
    out = {}
    for key in keys:
        if key.startswith(actor) and key[len(actor) :] in MEGATRON_LAYOUT:
            name = key[len(actor) :]
            out[key] = [
                f"{ROLE_SECTIONS[r]}.megatron.{name}"
                for r in FOLLOWERS
                if f"{ROLE_SECTIONS[r]}.megatron.{name}" not in set_keys
                and f"{ROLE_SECTIONS[r]}.megatron.{name}" not in keys
            ]
    return out


def _global_key(per_gpu_key: str) -> str | None:
    return next((s.global_key for s in MICRO_BATCH_SPECS if s.per_gpu_key == per_gpu_key), None)
