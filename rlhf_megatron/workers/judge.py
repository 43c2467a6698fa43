"""The LLM judge's vLLM engine (``reward.judge``), in the driver or on a Ray pool of its own.

Both placements run the rollout's `VLLMEngine` (same CPU set-up: in-process engine core, a KV
cache sized from ``max_num_seqs``, unique /dev/shm names) and generate with
``generate_token_ids``: every verdict of a call is added to the engine at once and the engine is
stepped, so a deadline (``timeout_s``) is checked between steps and the verdicts still running
then are aborted and come back as None. The engine is never left busy by a timeout, so a retry
(``rewards/judge.generate_with_retries``) reuses it at once.

- `LocalJudgeClient` (``placement=colocated``): the engine lives in the driver process. The
  driver holds no model of its own and waits while rewards are computed, so the judge costs no
  extra process, no Ray actor and no transfer; on GPU it takes ``gpu_memory_utilization`` of
  the driver's first GPU beside the training ranks (a small judge; a large one belongs on a pool).
  A Ray actor on the training pool's bundles was the alternative: it would share the bundles'
  GPU fractions with the actor (another colocated role to account for) for the same memory.
- `PoolJudgeClient` (``placement=pool``): a `WorkerGroup` of `JudgeWorker` on a `ResourcePool`
  of ``tensor_parallel_size`` processes (one GPU each on GPU; vLLM's TP ranks over the group's
  process group, as the rollout pool's are), started with the run and shut down at its end
  (``shutdown`` stops the engine; the group's actors are then killed and the placement group
  removed). A generation whose reply misses ``timeout_s`` plus a margin means a hung process:
  the group is stopped and the error raised (a dead judge cannot score later steps either).

Boundaries: engines and processes only; prompts, parsing, retries and metrics are
``rewards/judge.py``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rlhf_megatron.config.schema_reward import JudgeConfig
from rlhf_megatron.rewards.judge import deadline_stop
from rlhf_megatron.scheduling.dispatch import Dispatch, dispatch
from rlhf_megatron.workers.base import Worker

logger = logging.getLogger(__name__)

__all__ = ["JudgeWorker", "LocalJudgeClient", "PoolJudgeClient", "build_judge_client"]

REPLY_MARGIN_S = 120.0
"""How long past ``timeout_s`` the driver waits for a pool's reply before calling the judge hung
(the deadline is checked between engine steps; one step, or a slow start, may run past it)."""


def build_judge_engine(config: JudgeConfig, tensor_parallel_size: int = 1):
    """A `VLLMEngine` serving the judge model (imports vLLM)."""
    from rlhf_megatron.config.schema_roles import RolloutConfig
    from rlhf_megatron.rollout.vllm_engine import VLLMEngine

    if not config.model_path:
        raise ValueError("reward.judge.model_path is required when reward.judge.enable=true")
    rollout = RolloutConfig(
        dtype=config.dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        tensor_model_parallel_size=tensor_parallel_size,
        max_num_seqs=config.max_num_seqs,
        # vLLM wants a step's token budget to hold a whole prompt and one token per sequence.
        max_num_batched_tokens=max(config.max_model_len, config.max_num_seqs),
        enable_sleep_mode=False,
        engine_kwargs=dict(config.engine_kwargs),
    )
    return VLLMEngine(
        os.path.expanduser(config.model_path),
        rollout,
        max_model_len=config.max_model_len,
        seed=config.seed,
        tensor_parallel_size=tensor_parallel_size,
    )


def generate_verdicts(
    engine, config: JudgeConfig, prompts: list[list[int]], timeout_s: float
) -> list[list[int] | None]:
    """One batched generation on ``engine``; None for the verdicts ``timeout_s`` cut short."""
    from rlhf_megatron.rollout.base import RolloutSampling

    sampling = RolloutSampling(
        temperature=config.temperature,
        do_sample=config.temperature > 0,
        response_length=config.max_new_tokens,
        seed=config.seed,
    )
    results = engine.generate_token_ids(prompts, sampling, stop=deadline_stop(timeout_s))
    return [tokens if finished else None for tokens, finished in results]


class LocalJudgeClient:
    """The judge's engine in this process (``placement=colocated``)."""

    def __init__(self, config: JudgeConfig):
        self.config = config
        self.model_path = str(config.model_path)
        self.engine = None

    def start(self) -> None:
        if self.engine is None:
            self.engine = build_judge_engine(self.config)

    def generate(self, prompts: list[list[int]], timeout_s: float) -> list[list[int] | None]:
        self.start()
        return generate_verdicts(self.engine, self.config, prompts, timeout_s)

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()


class JudgeWorker(Worker):
    """One process of the judge's pool: a TP rank of its vLLM engine."""

    def __init__(
        self, role: str, rank: int, world_size: int, config: JudgeConfig, env: dict[str, str] | None = None
    ):
        super().__init__(role, rank, world_size, env)
        self.config = config
        self.engine = None

    def init_model(self) -> None:
        from rlhf_megatron.platform import setup_platform

        setup_platform()
        self.engine = build_judge_engine(self.config, self.world_size)

    @dispatch(Dispatch.RANK0)
    def generate(self, prompts: list[list[int]], timeout_s: float) -> list[list[int] | None]:
        """Every TP rank runs the same generation (the engine's rank 0 decides when to stop)."""
        return generate_verdicts(self.engine, self.config, prompts, timeout_s)

    def shutdown(self) -> None:
        import torch

        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class PoolJudgeClient:
    """The judge on a Ray resource pool of its own (``placement=pool``); needs a running Ray."""

    def __init__(self, config: JudgeConfig, use_gpu: bool = False):
        self.config = config
        self.model_path = str(config.model_path)
        self.use_gpu = use_gpu
        self.pool: Any = None
        self.group: Any = None

    def start(self) -> None:
        from rlhf_megatron.scheduling import ResourcePool, WorkerGroup

        if self.group is not None:
            return
        self.pool = ResourcePool("judge_pool", [self.config.tensor_parallel_size], use_gpu=self.use_gpu)
        self.pool.create()
        try:
            self.group = WorkerGroup(
                "judge",
                self.pool,
                JudgeWorker,
                {"config": self.config},
            )
            self.group.call_within(3600.0).init_model()
        except BaseException:
            self.close()
            raise

    def generate(self, prompts: list[list[int]], timeout_s: float) -> list[list[int] | None]:
        self.start()
        # The engine's deadline travels with the call; the group's is the hang guard past it.
        return self.group.call_within(timeout_s + REPLY_MARGIN_S).generate(prompts, timeout_s)

    def close(self) -> None:
        group, self.group = self.group, None
        try:
            if group is not None:
                group.shutdown()
        except Exception as err:  # a failed run reports its own error; teardown must not mask it
            logger.warning("shutting down the LLM judge: %s", err)
        finally:
            if self.pool is not None:
                self.pool.remove()
                self.pool = None


def build_judge_client(config: JudgeConfig, use_gpu: bool = False) -> LocalJudgeClient | PoolJudgeClient:
    """The client for ``reward.judge.placement`` (not started: ``start()`` builds the engine)."""
    if config.placement == "pool":
        return PoolJudgeClient(config, use_gpu=use_gpu)
    return LocalJudgeClient(config)
