"""The teachers of on-policy distillation on a Ray resource pool of their own (``enable_resource_pool``).

``TeacherWorker`` is one process of the teacher pool (``nnodes x n_gpus_per_node`` processes,
CPU processes in CPU mode), placed as the rollout's own pool is (``workers/rollout.py``): every
``inference.tensor_model_parallel_size`` consecutive ranks form one vLLM engine per teacher (one
replica), over the pool's own process group. It knows no Megatron and holds no policy: it scores
the student's sampled rows (``rollout.teacher.TeacherScorer``) and its engines' weights never
change, so nothing is synced to it. Colocated teachers live in the actor's processes instead
(``ActorRolloutRefWorker.compute_teacher_log_probs``); both answer the same call.
"""

from __future__ import annotations

import torch

from rlhf_megatron.config.context import RunContext
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.rollout.teacher import TeacherScorer
from rlhf_megatron.scheduling.dispatch import Dispatch, dispatch
from rlhf_megatron.workers.base import Worker

__all__ = ["TeacherWorker"]


class TeacherWorker(Worker):
    """One process of the teacher pool: ``init_model``, ``compute_teacher_log_probs``."""

    def __init__(
        self,
        role: str,
        rank: int,
        world_size: int,
        context: RunContext,
        context_len: int,
        env: dict[str, str] | None = None,
    ):
        """``context_len``: prompt + response length (``data.max_prompt_length + max_response_length``)."""
        super().__init__(role, rank, world_size, env)
        self.context, self.context_len = context, context_len
        teachers = context.distillation.teachers()
        self.tp = next(iter(teachers.values())).inference.tensor_model_parallel_size or 1
        if world_size % self.tp:
            raise ValueError(
                f"distillation: inference.tensor_model_parallel_size={self.tp} does not divide the teacher "
                f"pool's {world_size} processes (nnodes x n_gpus_per_node)"
            )
        self.scorer: TeacherScorer | None = None

    def init_model(self) -> None:
        from rlhf_megatron.platform import setup_platform

        setup_platform()
        self.scorer = TeacherScorer(
            self.context.distillation,
            tensor_parallel_size=self.tp,
            context_len=self.context_len,
            key_column=self.context.reward_fn_key,
            seed=self.context.seeds.rollout_engine(self.rank // self.tp),
        )

    def dispatch_info(self, layout: str = "rollout") -> tuple[int, int, bool]:
        """Every layout is the engines': replica ``rank // tp`` of ``world // tp``; its TP rank 0 answers."""
        return self.rank // self.tp, self.world_size // self.tp, self.rank % self.tp == 0

    @dispatch(Dispatch.DP_COMPUTE, layout="rollout")
    def compute_teacher_log_probs(self, batch: Batch) -> Batch:
        """As ``ActorRolloutRefWorker.compute_teacher_log_probs``: the teacher columns of ``batch``."""
        return self.scorer.score(batch)

    def shutdown(self) -> None:
        if self.scorer is not None:
            self.scorer.shutdown()
            self.scorer = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
