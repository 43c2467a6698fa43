"""Filling in the values a validated config implies, so workers read one spelling of each.

Role: runs after ``planning.validate_config`` inside ``planning.load_config`` and rewrites, in place:

* per-GPU micro-batch sizes from verl's global ones (global // DP of the role that runs them);
* ``sequence_parallel`` off where TP is 1 (Megatron needs TP > 1 for it; verl does the same);
* verl's ``model.enable_gradient_checkpointing`` as full, uniform recomputation of every
  layer, when ``megatron.recompute_granularity`` is not set;
* full recomputation's unset method/layers as uniform/1 (Megatron's usual choice);
* verl's ``rollout.load_format`` spellings (dummy_megatron, ...) as ``hf``;
* ``actor.router_replay.mode=auto`` (``router_replay=true``) as R3 where vLLM reports its
  routing (a vLLM rollout off CPU), else R2;
* ``model.shared_prompt_packing=null`` (actor/reference and critic) as on with
  ``trainer.device=cpu``, else off.

The resolved config that is printed and saved therefore shows what will actually run.

Boundaries: assumes the config is valid; no checks here.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.choices import VERL_LOAD_FORMATS
from rlhf_megatron.config import roles
from rlhf_megatron.config.roles import (
    MICRO_BATCH_SPECS,
    ROLE_SECTIONS,
    data_parallel_size,
    per_gpu_micro_batch,
)

__all__ = ["normalize_config"]


def _fill_micro_batches(cfg: DictConfig, world: int) -> None:
    for spec in MICRO_BATCH_SPECS:
        dp = data_parallel_size(cfg, spec.role, world)
        if dp is None:
            continue
        per_gpu, problem = per_gpu_micro_batch(cfg, spec, dp)
        if per_gpu is not None and problem is None:
            OmegaConf.update(cfg, spec.per_gpu_key, per_gpu)


def _fill_parallel_layout(cfg: DictConfig) -> None:
    checkpointing = {
        "actor_rollout_ref.actor": cfg.actor_rollout_ref.model.enable_gradient_checkpointing,
        "critic": cfg.critic.model.enable_gradient_checkpointing,
    }
    for section in ROLE_SECTIONS.values():
        m = OmegaConf.select(cfg, f"{section}.megatron")
        if m.tensor_model_parallel_size == 1:
            m.sequence_parallel = False
        if checkpointing.get(section) and m.recompute_granularity is None:
            m.recompute_granularity = "full"
        if m.recompute_granularity == "full":
            m.recompute_method = m.recompute_method or "uniform"
            m.recompute_num_layers = m.recompute_num_layers or 1


def normalize_config(cfg: DictConfig, world_size: int | None = None) -> DictConfig:
    """Rewrite ``cfg`` in place as described in the module docstring; returns it."""
    world = roles.world_size(cfg, world_size)
    _fill_micro_batches(cfg, world)
    _fill_parallel_layout(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.load_format in VERL_LOAD_FORMATS:
        rollout.load_format = "hf"
    corr = cfg.algorithm.rollout_correction
    if isinstance(corr.rollout_is_threshold, int) and not isinstance(corr.rollout_is_threshold, bool):
        corr.rollout_is_threshold = float(corr.rollout_is_threshold)  # a number is a cap; "lo_hi" stays text
    replay = cfg.actor_rollout_ref.actor.router_replay
    if replay.mode == "auto":
        replay.mode = "R3" if rollout.name == "vllm" and cfg.trainer.device != "cpu" else "R2"
    for model in (cfg.actor_rollout_ref.model, cfg.critic.model):
        if model.shared_prompt_packing is None:
            model.shared_prompt_packing = cfg.trainer.device == "cpu"
    return cfg
