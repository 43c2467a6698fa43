"""The Ray-hosted roles: hybrid actor+rollout+ref, critic, reward model.

All Megatron roles share ``role.MegatronRoleWorker`` (parallel set-up, batched
forward, checkpoints) and ``megatron_engine.MegatronEngine`` (model, optimizer,
micro-batch loop); a role adds only its loss functions.
"""

from rlhf_megatron.workers.actor import ActorRolloutRefWorker
from rlhf_megatron.workers.base import Worker
from rlhf_megatron.workers.critic import CriticWorker, RewardModelWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker", "Worker"]
