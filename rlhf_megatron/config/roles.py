"""Which model roles a config runs, and the sizes that follow from the cluster shape.

Role: shared vocabulary of ``validate.py``, ``normalize.py``, ``planner.py`` and the trainer:
the config section of each role, which roles a run builds (``RolePlan``, decided once from
the estimator registry), the world size (and the rollout pool's, when disaggregated), each
role's data-parallel size, and the micro-batch key pairs (verl's global ``*micro_batch_size``
and ``*micro_batch_size_per_gpu``) with the rule that turns one into the other.

Every function here reads a resolved config either as the ``DictConfig`` the loader returns or
as the typed ``RunConfig`` (``OmegaConf.to_object``) that validation reads: both are read by
attribute.

Boundaries: reads a resolved config; never changes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Any

from omegaconf import DictConfig

__all__ = [
    "ACTOR_TRAIN_MICRO",
    "CRITIC_TRAIN_MICRO",
    "MICRO_BATCH_SPECS",
    "ROLE_SECTIONS",
    "MicroBatchSpec",
    "RolePlan",
    "active_roles",
    "at",
    "estimator_needs_critic",
    "data_parallel_size",
    "megatron_section",
    "model_parallel_size",
    "per_gpu_micro_batch",
    "role_plan",
    "rollout_gpus_per_node",
    "rollout_world_size",
    "world_size",
]

# Role -> config section holding its ``megatron`` layout.
ROLE_SECTIONS: dict[str, str] = {
    "actor": "actor_rollout_ref.actor",
    "ref": "actor_rollout_ref.ref",
    "critic": "critic",
    "reward_model": "reward_model",
}


def at(cfg: Any, key: str) -> Any:
    """The value under dotted ``key`` of a DictConfig or of the typed ``RunConfig``."""
    return reduce(getattr, key.split("."), cfg)


@dataclass(frozen=True)
class RolePlan:
    """Which models a run builds besides the actor: decided once, by ``role_plan``, and passed
    to validation, the planner, the worker set-up and the trainer so they always agree."""

    critic: bool
    """A value model: the advantage estimator consumes values (of the built-ins, gae)."""
    ref: bool
    """A frozen reference policy: a KL term in the loss or in the reward needs its log-probs."""
    reward_model: bool
    """A model-based reward (``reward_model.enable``)."""

    @property
    def roles(self) -> list[str]:
        """The model roles, in the order they are described."""
        flags = {"ref": self.ref, "critic": self.critic, "reward_model": self.reward_model}
        return ["actor", *(role for role, on in flags.items() if on)]


def estimator_needs_critic(name: str) -> bool:
    """Whether the registered advantage estimator ``name`` consumes critic values.

    Asks the algorithms registry (a user-registered estimator that takes ``values`` gets a
    critic too); falls back to the built-in answer (gae) when the registry cannot be
    imported or does not know the name (validation reports unknown names).
    """
    try:
        from rlhf_megatron.algorithms import estimator_needs_critic as needs_critic

        return needs_critic(name)
    except (ImportError, KeyError, ValueError):
        return name == "gae"


def role_plan(cfg: DictConfig | Any) -> RolePlan:
    """The ``RolePlan`` of a resolved config."""
    return RolePlan(
        critic=estimator_needs_critic(cfg.algorithm.adv_estimator),
        ref=bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward),
        reward_model=bool(cfg.reward_model.enable),
    )


def active_roles(cfg: DictConfig | Any) -> list[str]:
    """Roles this run builds, in the order they are described."""
    return role_plan(cfg).roles


def world_size(cfg: DictConfig | Any, override: int | None = None) -> int:
    """The trainer's processes: ``override`` if given, else trainer.nnodes x n_gpus_per_node.
    Every model role runs on all of them, and so does the rollout unless
    ``actor_rollout_ref.hybrid_engine`` is false (then see ``rollout_world_size``)."""
    if override is not None:
        return override
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def rollout_world_size(cfg: DictConfig | Any, override: int | None = None) -> int:
    """Processes that run the rollout engines: the rollout's own pool when
    ``actor_rollout_ref.hybrid_engine`` is false (rollout.nnodes x rollout.n_gpus_per_node),
    else the trainer's world (``world_size``; ``override`` replaces only that one)."""
    if _colocated(cfg):
        return world_size(cfg, override)
    rollout = cfg.actor_rollout_ref.rollout
    return rollout.nnodes * rollout.n_gpus_per_node


def rollout_gpus_per_node(cfg: DictConfig | Any) -> int:
    """GPUs per node of the processes that run the rollout engines (the trainer's nodes unless the
    rollout has its own pool): the widest a vLLM tensor-parallel group can be within a node."""
    if _colocated(cfg):
        return cfg.trainer.n_gpus_per_node
    return cfg.actor_rollout_ref.rollout.n_gpus_per_node


def _colocated(cfg: DictConfig | Any) -> bool:
    return getattr(cfg.actor_rollout_ref, "hybrid_engine", True)


def megatron_section(cfg: DictConfig | Any, role: str) -> Any:
    """``<role section>.megatron``: a DictConfig or a ``MegatronConfig``, as ``cfg`` is."""
    return at(cfg, f"{ROLE_SECTIONS[role]}.megatron")


def model_parallel_size(cfg: DictConfig | Any, role: str) -> int:
    """TP x PP x CP of a role: the GPUs holding one model replica."""
    m = megatron_section(cfg, role)
    return m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size


def data_parallel_size(cfg: DictConfig | Any, role: str, world: int) -> int | None:
    """world / (TP x PP x CP), or None when that does not divide (validation reports it)."""
    mp = model_parallel_size(cfg, role)
    if mp <= 0 or world % mp:
        return None
    return world // mp


@dataclass(frozen=True)
class MicroBatchSpec:
    """A verl micro-batch key pair and the role whose DP size relates them."""

    role: str
    global_key: str
    per_gpu_key: str
    dynamic_key: str


# The training micro-batches (forward + backward), one per trained role.
ACTOR_TRAIN_MICRO = MicroBatchSpec(
    "actor",
    "actor_rollout_ref.actor.ppo_micro_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_dynamic_bsz",
)
CRITIC_TRAIN_MICRO = MicroBatchSpec(
    "critic", "critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu", "critic.use_dynamic_bsz"
)

MICRO_BATCH_SPECS: tuple[MicroBatchSpec, ...] = (
    ACTOR_TRAIN_MICRO,
    # Old log-probs are recomputed by the actor's Megatron model, so the actor's DP applies.
    MicroBatchSpec(
        "actor",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    ),
    MicroBatchSpec(
        "ref",
        "actor_rollout_ref.ref.log_prob_micro_batch_size",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    ),
    CRITIC_TRAIN_MICRO,
    MicroBatchSpec(
        "critic",
        "critic.forward_micro_batch_size",
        "critic.forward_micro_batch_size_per_gpu",
        "critic.use_dynamic_bsz",
    ),
    MicroBatchSpec(
        "reward_model",
        "reward_model.micro_batch_size",
        "reward_model.micro_batch_size_per_gpu",
        "reward_model.use_dynamic_bsz",
    ),
)


def per_gpu_micro_batch(
    cfg: DictConfig | Any, spec: MicroBatchSpec, dp: int
) -> tuple[int | None, str | None]:
    """``(per_gpu_value, problem)`` for one key pair, as verl normalises it: the per-GPU key
    wins; a global value is divided by the DP size and must divide evenly. Both set is
    accepted when they agree (a saved resolved config has both)."""
    global_value = at(cfg, spec.global_key)
    per_gpu = at(cfg, spec.per_gpu_key)
    if global_value is None:
        return per_gpu, None
    if global_value % dp:
        return None, (
            f"{spec.global_key}={global_value} is not divisible by the {spec.role}'s data-parallel size {dp}; "
            f"set {spec.per_gpu_key} instead, or a multiple of {dp}"
        )
    derived = global_value // dp
    if per_gpu is not None and per_gpu != derived:
        return None, (
            f"{spec.global_key}={global_value} (= {derived} per GPU at DP={dp}) contradicts "
            f"{spec.per_gpu_key}={per_gpu}; set only one of them"
        )
    return derived, None
