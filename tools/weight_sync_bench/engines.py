"""One benchmark rank's pieces: its Megatron actor loaded from a checkpoint with an in-process vLLM
engine beside it (``build_actor_and_engine``), and the weight syncer between them
(``make_syncer``).

Boundaries: building; what a sync costs is measured by ``measuring.py``.
"""

from __future__ import annotations

import time


def build_actor_and_engine(
    hf_dir: str, tp: int, dtype: str, load_format: str, max_model_len: int = 64, ep: int = 1
):
    """This rank's Megatron actor (TP ``tp``, EP ``ep``, PP = 1) loaded from ``hf_dir``, and a vLLM
    engine at TP = the world size (every rank holds every expert: vLLM's own expert parallelism is off)."""
    import torch

    from rlhf_megatron.config.schema import RolloutConfig
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import ParallelGroups, init_model_parallel
    from rlhf_megatron.rollout.vllm_engine import VLLMEngine

    info = init_model_parallel(tp, 1, seed=0, expert_model_parallel_size=ep)
    arch = ModelArch.from_hf_dir(hf_dir)
    chunks = build_gpt_model(
        arch,
        ParallelConfig(tp, 1, expert_model_parallel_size=ep),
        params_dtype=getattr(torch, dtype),
        init_weights=False,
    )
    load_hf_weights(chunks, hf_dir, arch)
    engine = VLLMEngine(
        hf_dir,
        RolloutConfig(dtype=dtype, max_num_seqs=1, load_format=load_format),
        max_model_len=max_model_len,
        tensor_parallel_size=torch.distributed.get_world_size(),
    )
    return arch, chunks, info, ParallelGroups.current(), engine


def make_syncer(arch, chunks, info, groups, rollout_tp: int, load_format: str, bucket_bytes: int):
    """This rank's syncer for ``load_format``, and the seconds ``build_sync_plan`` took."""
    from rlhf_megatron.weights import TrainLayout, WeightSyncer, build_sync_plan

    dtype_bytes = next(chunks[0].parameters()).element_size()
    t0 = time.perf_counter()
    plan = build_sync_plan(arch, TrainLayout.of(info), rollout_tp, load_format, bucket_bytes, dtype_bytes)
    plan_s = time.perf_counter() - t0
    return WeightSyncer.of(plan, chunks, info, groups), plan_s
