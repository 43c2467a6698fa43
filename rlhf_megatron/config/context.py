"""What a role's workers need from outside their own config section, and every seed of a run.

Role: the driver hands each role its own typed section (``actor_rollout_ref``, ``critic``,
``reward_model``) plus one ``RunContext``: the few run-level values a role cannot find in
its section. The ``Seeds`` of a run are derived here, in one place, from ``trainer.seed``.

Boundaries: plain dataclasses; no torch, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config.roles import RolePlan, role_plan
from rlhf_megatron.config.schema import RolloutCorrectionConfig
from rlhf_megatron.config.schema_distill import DistillationConfig

__all__ = ["RunContext", "Seeds"]


@dataclass(frozen=True)
class Seeds:
    """Every random stream of a run, derived from ``trainer.seed``.

    Streams are kept apart by large odd multipliers, so that, for example, the actor's and
    the critic's mini-batch orders never coincide, and every stream is a pure function of
    (``trainer.seed``, step): a resumed run draws exactly what an uninterrupted one would.
    """

    base: int
    """``trainer.seed``."""

    def model_parallel(self, megatron_seed: int) -> int:
        """Megatron's model-parallel RNG tracker (initialisation, dropout): ``<role>.megatron.seed``
        shifted by the run's seed."""
        return megatron_seed + self.base

    def rollout_engine(self, rollout_dp_rank: int) -> int:
        """A rollout engine's own RNG (used only when a call passes no seed): one per rollout
        data-parallel group, whose TP ranks must sample identically."""
        return self.base + rollout_dp_rank

    def generation(self, step: int) -> int:
        """The sampling seed of step ``step``'s rollout (0 = validation); prompt ``i`` of rollout
        group ``g`` samples with ``generation(step) + g * prompts_per_group + i``."""
        return self.base * 1_000_003 + step * 10_007

    def minibatch_shuffle(self, role: str, step: int, loader_seed: int | None = None) -> int:
        """Order of the PPO mini-batches of ``role`` (actor or critic) at ``step``;
        ``<role>.data_loader_seed`` replaces ``trainer.seed`` when set."""
        multiplier = {"actor": 1_000_003, "critic": 1_000_033}[role]
        return (self.base if loader_seed is None else loader_seed) * multiplier + step


@dataclass(frozen=True)
class RunContext:
    """The run-level values every role receives besides its own section."""

    seeds: Seeds
    """All seeds of the run."""
    nan_policy: str
    """``trainer.nan_policy``: stop or skip on non-finite gradients."""
    rollout_n: int
    """``actor_rollout_ref.rollout.n``: responses per prompt (mini-batch sizes count prompts)."""
    total_steps: int
    """Training steps of the run, which the LR schedules span."""
    plan: RolePlan = field(default_factory=lambda: RolePlan(critic=False, ref=True, reward_model=False))
    """Which roles the run builds (the actor builds its reference only when ``plan.ref``)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """``algorithm.rollout_correction``: in bypass mode the actor's loss computes the correction
    (``algorithms.bypass_correction``); otherwise the driver did, and the actor only reads
    ``rollout_is_weights`` from the batch."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """``distillation``: the teachers the actor's processes serve (when colocated) and the loss
    its update adds."""
    reward_fn_key: str = "data_source"
    """``data.reward_fn_key``: the column whose value picks a row's teacher (``teacher_models.*.key``)."""

    @classmethod
    def from_config(cls, cfg: DictConfig, total_steps: int) -> RunContext:
        """The context of a resolved run config whose schedules span ``total_steps``."""
        return cls(
            seeds=Seeds(cfg.trainer.seed),
            nan_policy=cfg.trainer.nan_policy,
            rollout_n=cfg.actor_rollout_ref.rollout.n,
            total_steps=total_steps,
            plan=role_plan(cfg),
            rollout_correction=OmegaConf.to_object(cfg.algorithm.rollout_correction),
            distillation=OmegaConf.to_object(cfg.distillation),
            reward_fn_key=cfg.data.reward_fn_key,
        )
