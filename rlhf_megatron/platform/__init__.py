"""Device and backend selection, process groups, model parallelism and seeding.

This is the only layer (with ``models/``) that touches
``megatron.core.parallel_state``. Everything above it receives ranks and groups
explicitly (see ``ParallelInfo``).

- ``setup_platform()``: picks ``cuda`` + ``nccl`` when CUDA is present, else
  ``cpu`` + ``gloo`` and switches on the CPU compatibility layer
  (``cpu_compat``), which lets real megatron-core run on CPU.
- ``init_distributed()``: ``torch.distributed`` from env vars (torchrun/Ray set
  ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
- ``init_model_parallel()``: megatron's TP/PP/VPP/CP/DP groups, and the expert
  groups of mixture-of-experts models (EP, expert TP, expert DP), plus its RNG
  tracker, returning a ``ParallelInfo`` snapshot of this rank's coordinates.
- ``set_seed()``: python, numpy and torch seeding, deterministic algorithms (on CPU, or where
  ``RLHF_DETERMINISTIC=1``).
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from rlhf_megatron.platform.cpu_compat import cpu_compat_enabled, enable_cpu_compat

__all__ = [
    "ParallelGroups",
    "ParallelInfo",
    "cpu_compat_enabled",
    "destroy_distributed",
    "enable_cpu_compat",
    "get_backend",
    "get_device",
    "init_distributed",
    "init_model_parallel",
    "is_cuda",
    "quiet_cpu_fallback_warnings",
    "deterministic_default",
    "set_seed",
    "setup_platform",
]


def is_cuda() -> bool:
    """True when this process should use CUDA (and NCCL)."""
    return torch.cuda.is_available() and os.environ.get("RLHF_FORCE_CPU", "0") != "1"


def get_device() -> torch.device:
    """``cuda:<local rank>`` on GPU machines, ``cpu`` otherwise."""
    if is_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_backend() -> str:
    """``nccl`` on GPU machines, ``gloo`` otherwise."""
    return "nccl" if is_cuda() else "gloo"


def quiet_cpu_fallback_warnings() -> None:
    """Silence megatron's notices that it uses its torch kernels (expected without TE/apex)."""
    if is_cuda():
        return
    for message in (
        "Transformer Engine and Apex are not installed",
        "Apex is not installed",
        "When using async grad allreduce it is recommended",
    ):
        warnings.filterwarnings("ignore", message=message)


def setup_platform() -> torch.device:
    """Prepare this process for megatron-core. Call once, before building models.

    On GPU: binds the process to ``LOCAL_RANK``'s device. On CPU: enables the
    compatibility layer. Returns the device to use.
    """
    if is_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    else:
        quiet_cpu_fallback_warnings()
        enable_cpu_compat()
    return get_device()


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Initialise ``torch.distributed`` (NCCL on GPU, gloo on CPU). Idempotent.

    Arguments default to the ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
    environment variables that torchrun and our Ray worker groups set.
    """
    setup_platform()
    if torch.distributed.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    master_port = master_port or int(os.environ.get("MASTER_PORT", "29500"))
    if not 0 <= rank < world_size:
        raise ValueError(f"init_distributed: rank {rank} is outside world_size {world_size}")
    torch.distributed.init_process_group(
        backend=get_backend(),
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default process group, if any."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _MEGATRON_GROUPS.clear()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


_MEGATRON_GROUPS: list = []
"""The process groups the last ``init_model_parallel`` had megatron create. megatron-core's
``destroy_model_parallel`` only forgets its groups; each gloo group keeps a TCP loop and two run
loops alive, so a process that builds layout after layout (the tests do) would end up with
thousands of threads and a machine too loaded to run anything else."""


def _process_groups() -> list:
    """Every process group of this process but the default one (torch keeps no public list)."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d.GroupMember.WORLD
    return [group for group in distributed_c10d._world.pg_map if group is not world]


def _release_megatron_groups() -> None:
    for group in _MEGATRON_GROUPS:
        with contextlib.suppress(Exception):  # already gone with the default group
            torch.distributed.destroy_process_group(group)
    _MEGATRON_GROUPS.clear()


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's coordinates in the model-parallel grid (a snapshot, passed explicitly)."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    vpp_size: int | None
    ep_rank: int = 0
    """Expert-parallel rank: which ``num_experts / ep_size`` experts this rank holds."""
    ep_size: int = 1
    etp_rank: int = 0
    """Rank in the expert tensor-parallel group, which splits each expert's matrices."""
    etp_size: int = 1

    @property
    def is_output_rank(self) -> bool:
        """The rank whose outputs a driver collects: last PP stage, TP rank 0, CP rank 0."""
        return self.pp_rank == self.pp_size - 1 and self.tp_rank == 0 and self.cp_rank == 0

    @classmethod
    def current(cls) -> ParallelInfo:
        """Read the coordinates from megatron's initialised parallel state."""
        from megatron.core import parallel_state as ps

        return cls(
            rank=torch.distributed.get_rank(),
            world_size=torch.distributed.get_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            vpp_size=ps.get_virtual_pipeline_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
        )


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's megatron process groups, handed explicitly to code outside platform/ and models/."""

    tp_group: object
    pp_group: object
    dp_group: object
    pp_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline group, by stage."""
    tp_ranks: tuple[int, ...]
    """Global ranks of this rank's tensor-parallel group, by TP rank."""
    ep_group: object = None
    """The expert-parallel group: ranks that hold different experts of the same layers."""
    ep_ranks: tuple[int, ...] = ()
    """Global ranks of the expert-parallel group, by EP rank."""
    etp_group: object = None
    """The expert tensor-parallel group: ranks that hold slices of the same experts."""
    etp_ranks: tuple[int, ...] = ()

    @classmethod
    def current(cls) -> ParallelGroups:
        from megatron.core import parallel_state as ps

        pp_group = ps.get_pipeline_model_parallel_group()
        tp_group = ps.get_tensor_model_parallel_group()
        ep_group = ps.get_expert_model_parallel_group()
        etp_group = ps.get_expert_tensor_parallel_group()
        ranks = torch.distributed.get_process_group_ranks
        return cls(
            tp_group=tp_group,
            pp_group=pp_group,
            dp_group=ps.get_data_parallel_group(),
            pp_ranks=tuple(ranks(pp_group)),
            tp_ranks=tuple(ranks(tp_group)),
            ep_group=ep_group,
            ep_ranks=tuple(ranks(ep_group)),
            etp_group=etp_group,
            etp_ranks=tuple(ranks(etp_group)),
        )


def init_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    seed: int = 1234,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> ParallelInfo:
    """Create megatron's parallel groups and seed its RNG tracker.

    Requires ``init_distributed()`` first. Re-initialises when called again with
    different sizes (tests build several layouts in one process group).

    Mixture-of-experts models lay their experts out on a second grid over the same
    ranks: expert TP (``expert_tensor_parallel_size``, None = the TP size) x EP x expert
    DP x PP, so ``ETP x EP x PP`` must divide the world size; the pipeline groups are
    shared with the dense layers. Dense models ignore the expert groups.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = torch.distributed.get_world_size()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world % model_parallel:
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size "
            f"({tensor_model_parallel_size}) x pipeline_model_parallel_size ({pipeline_model_parallel_size}) "
            f"x context_parallel_size ({context_parallel_size}) = {model_parallel}; change the sizes so "
            "that their product divides the number of processes"
        )
    etp = expert_tensor_parallel_size or tensor_model_parallel_size
    expert_grid = etp * expert_model_parallel_size * pipeline_model_parallel_size
    if world % expert_grid:
        raise ValueError(
            f"world size {world} is not divisible by expert_tensor_parallel_size ({etp}) x "
            f"expert_model_parallel_size ({expert_model_parallel_size}) x pipeline_model_parallel_size "
            f"({pipeline_model_parallel_size}) = {expert_grid}; change the expert sizes so that their "
            "product divides the number of processes"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _release_megatron_groups()
    before = set(_process_groups())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=etp,
    )
    _MEGATRON_GROUPS.extend(group for group in _process_groups() if group not in before)
    set_seed(seed)
    # Seeds megatron's "model-parallel" RNG stream: different per TP rank, same per DP rank.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelInfo.current()


def set_seed(seed: int, deterministic: bool | None = None) -> None:
    """Seed python, numpy and torch. ``deterministic`` asks torch for deterministic kernels;
    None: as the environment's ``RLHF_DETERMINISTIC`` says (1 or 0), else on CPU only.

    On CPU this makes runs bit-identical. On GPU they cost time (on an H200, the 1.24B model's
    update at 2K tokens 1.10 s with them against 0.99 s without, its log-prob pass 0.43 against
    0.32 s: ``docs/gpu_h200_mfu_steps.json``) and still leave NCCL reductions, some atomics and
    vLLM's sampling kernels differing run to run, so they are off there unless asked for.
    """
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if is_cuda():
        torch.cuda.manual_seed_all(seed)
    if deterministic is None:
        deterministic = deterministic_default()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def deterministic_default() -> bool:
    """Whether ``set_seed`` asks for deterministic kernels when not told: ``RLHF_DETERMINISTIC``
    (1 or 0) where set, else on CPU only."""
    flag = os.environ.get("RLHF_DETERMINISTIC", "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(
            f"RLHF_DETERMINISTIC={flag!r}: set it to 1 (deterministic kernels) or 0, or unset it"
        )
    return flag == "1" if flag else not is_cuda()
