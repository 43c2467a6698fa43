"""The parts of a run, built once by ``trainer.run.run_training``: ``RunParts`` (what outlives a
restart: config, data, rewards, tokenizer, tracker, checkpoints) and ``RoleGroups`` (what each
try builds again: the worker groups).

Role: ``PPOTrainer`` and each in-job restart (``run._Attempt``) take these two objects instead of
a list of eighteen arguments threaded twice.

Boundaries: plain holders; nothing here builds or runs anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf_megatron.config.context import RunContext
from rlhf_megatron.config.schema import RunConfig

if TYPE_CHECKING:  # the driver names the worker classes, it does not import megatron or vLLM
    from rlhf_megatron.scheduling.worker_group import WorkerGroup
    from rlhf_megatron.trainer.checkpoint import CheckpointManager
    from rlhf_megatron.trainer.loggers import Tracker
    from rlhf_megatron.workers.actor import ActorRolloutRefWorker
    from rlhf_megatron.workers.critic import CriticWorker, RewardModelWorker
    from rlhf_megatron.workers.rollout import InterruptSignal, RolloutWorker
    from rlhf_megatron.workers.teacher import TeacherWorker

__all__ = ["RoleGroups", "RunParts"]


@dataclass(frozen=True)
class RunParts:
    """What a run keeps across in-job restarts."""

    run: RunConfig
    context: RunContext
    """The run-level values every role needs (seeds, the roles it builds, the schedule's length)."""
    reward_fn: Any
    """Scores training batches (``rewards.manager.RewardManager``, or the LLM judge's)."""
    val_reward_fn: Any
    train_loader: Any
    """The resumable training loader (its state is saved with each checkpoint)."""
    val_loader: Any
    tokenizer: Any
    tracker: Tracker
    checkpoints: CheckpointManager
    n_params: int
    """The actor's parameters per token (active ones, for MoE): the MFU's numerator."""


@dataclass(frozen=True)
class RoleGroups:
    """One try's worker groups: None for a role ``context.plan`` leaves out."""

    actor: WorkerGroup[ActorRolloutRefWorker]
    critic: WorkerGroup[CriticWorker] | None = None
    reward_model: WorkerGroup[RewardModelWorker] | None = None
    rollout: WorkerGroup[RolloutWorker] | None = None
    """The rollout pool's group when the rollout is disaggregated (None: the actor's processes
    generate)."""
    teacher: WorkerGroup[TeacherWorker] | None = None
    """The teacher pool's group (``distillation.*.enable_resource_pool``; None: the teachers, if
    any, live in the actor's processes)."""
    interrupts: InterruptSignal | None = None
    """The rollout pool's interrupt signal when ``trainer.partial_rollout`` is on."""
    restart_rollout: Callable[[], WorkerGroup[RolloutWorker]] | None = None
    """Builds the rollout pool's group again (its engines restart alone)."""
