"""Per-rank bodies of the weight-sync tests (spawned by run_on_ranks)."""

from __future__ import annotations

import os

import torch


def capture_vllm_loaded_weights():
    """Record every vLLM linear/embedding weight as vLLM's own loader left it, before CPU repacking.

    vLLM on CPU repacks linear weights after loading (the parameters become
    empty), so the per-rank tensors its loader produced are only visible at
    that moment. Returns a dict filled in as layers are processed: id(module)
    -> {param name: tensor}.
    """
    from vllm.model_executor.layers import utils

    captured: dict[int, dict[str, torch.Tensor]] = {}
    original = utils.dispatch_cpu_unquantized_gemm

    def spy(layer, remove_weight):
        captured[id(layer)] = {n: p.detach().clone() for n, p in layer.named_parameters(recurse=False)}
        return original(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = spy
    return captured


def name_captured(engine, captured) -> dict[str, torch.Tensor]:
    names = engine.llm.apply_model(lambda m: {id(mod): name for name, mod in m.named_modules()})[0]
    out = {}
    for key, params in captured.items():
        for pname, t in params.items():
            out[f"{names[key]}.{pname}"] = t
    return out


def build_actor(hf_dir, tp, pp):
    from rlhf_megatron.config.model_arch import ModelArch
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.platform import ParallelGroups, init_model_parallel

    info = init_model_parallel(tp, pp, seed=0)
    arch = ModelArch.from_hf_dir(hf_dir)
    chunks = build_gpt_model(arch, ParallelConfig(tp, pp), init_weights=False)
    load_hf_weights(chunks, hf_dir, arch)
    return arch, chunks, info, ParallelGroups.current()


def make_syncer(arch, chunks, info, groups, rollout_tp, load_format, bucket_bytes=1 << 16):
    from rlhf_megatron.weights import CollectiveTransport, TrainLayout, WeightSyncer, build_sync_plan

    plan = build_sync_plan(
        arch, TrainLayout(info.tp_size, info.pp_size, info.vpp_size), rollout_tp, load_format, bucket_bytes, 4
    )
    transport = CollectiveTransport(groups.tp_group, info.tp_size, groups.pp_group, groups.pp_ranks)
    return WeightSyncer(
        plan, chunks, info.tp_rank, info.pp_rank, transport, rollout_rank=info.rank % rollout_tp
    )


def conformance(rank, world_size, hf_dir, tp, pp, rollout_tp, with_vllm):
    """hf-format tensors vs the checkpoint; sharded-format tensors vs what vLLM's loader made on this rank."""
    from safetensors.torch import load_file

    arch, chunks, info, groups = build_actor(hf_dir, tp, pp)
    reference = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            reference.update(load_file(os.path.join(hf_dir, f)))
    hf_syncer = make_syncer(arch, chunks, info, groups, rollout_tp, "hf")
    hf_tensors = {n: t.clone() for n, t in hf_syncer.iter_weights()}
    hf_mismatch = sorted(
        n for n in set(hf_tensors) | set(reference)
        if n not in hf_tensors or n not in reference or not torch.equal(hf_tensors[n], reference[n])
    )  # fmt: skip
    sharded = {
        n: t.clone() for n, t in make_syncer(arch, chunks, info, groups, rollout_tp, "sharded").iter_weights()
    }
    result = {"hf_mismatch": hf_mismatch, "hf_count": len(hf_tensors), "sharded_count": len(sharded),
              "peak_bucket_bytes": hf_syncer.stats["peak_bucket_bytes"]}  # fmt: skip
    if not with_vllm:
        return result
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from rlhf_megatron.config.schema import RolloutConfig
    from rlhf_megatron.rollout.vllm_engine import VLLMEngine

    captured = capture_vllm_loaded_weights()
    engine = VLLMEngine(
        hf_dir,
        RolloutConfig(dtype="float32", max_num_seqs=4),
        max_model_len=64,
        tensor_parallel_size=rollout_tp,
    )
    from_checkpoint = name_captured(engine, captured)
    unlinked = list(engine.unlinked_shm)
    shm_left = [n for n in unlinked if os.path.exists(f"/dev/shm/{n}")]
    # vLLM loader's per-rank tensors vs ours, for every tensor vLLM kept.
    if arch.tie_word_embeddings and "lm_head.weight" in from_checkpoint:
        # vLLM ties lm_head to embed_tokens: the embedding we send is what it uses.
        sharded.setdefault("lm_head.weight", sharded.get("model.embed_tokens.weight"))
    sharded_mismatch = sorted(
        (n, tuple(t.shape), tuple(sharded[n].shape) if n in sharded else None,
         float((sharded[n] - t).abs().max()) if n in sharded and sharded[n].shape == t.shape else None)
        for n, t in from_checkpoint.items()
        if n not in sharded or sharded[n].shape != t.shape or not torch.equal(sharded[n], t)
    )  # fmt: skip
    # Refit through the hf format: vLLM's loader must produce exactly the same per-rank tensors again.
    captured.clear()
    engine.update_weights(hf_syncer.iter_weights())
    refit = name_captured(engine, captured)
    if arch.tie_word_embeddings and "lm_head.weight" not in refit:
        # A tied lm_head shares the embedding's parameter; nothing is loaded into it directly.
        refit["lm_head.weight"] = refit.get("model.embed_tokens.weight")
    refit_mismatch = sorted(
        n for n, t in from_checkpoint.items() if not torch.equal(refit.get(n, t * 0 + 1), t)
    )
    engine.shutdown()
    result.update(
        vllm_tensors=len(from_checkpoint),
        sharded_mismatch=sharded_mismatch,
        refit_mismatch=refit_mismatch,
        shm_unlinked=unlinked,
        shm_left=shm_left,
    )
    return result


def vl_conformance(rank, world_size, hf_dir, tp, pp, rollout_tp):
    """A vision-language actor's hf stream into vLLM: every per-rank tensor vLLM's own loader makes
    from our stream (vision tower, merger, language model) equals what it made from the checkpoint."""
    arch, chunks, info, groups = build_actor(hf_dir, tp, pp)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from rlhf_megatron.config.schema import RolloutConfig
    from rlhf_megatron.rollout.vllm_engine import VLLMEngine

    captured = capture_vllm_loaded_weights()
    engine = VLLMEngine(
        hf_dir,
        RolloutConfig(dtype="float32", max_num_seqs=4, limit_images=1),
        max_model_len=128,
        tensor_parallel_size=rollout_tp,
    )

    def snapshot() -> dict[str, torch.Tensor]:
        # Linear weights as the loader left them (before CPU repacking), plus every other parameter.
        params = engine.llm.apply_model(
            lambda m: {n: p.detach().clone() for n, p in m.named_parameters() if p.numel() > 0}
        )[0]
        return {**params, **name_captured(engine, captured)}

    from_checkpoint = snapshot()
    captured.clear()
    engine.update_weights(make_syncer(arch, chunks, info, groups, rollout_tp, "hf").iter_weights())
    refit = snapshot()
    engine.shutdown()
    mismatch = sorted(n for n, t in from_checkpoint.items() if n not in refit or not torch.equal(refit[n], t))
    return {
        "tensors": len(from_checkpoint),
        "vision": sum("visual" in n for n in from_checkpoint),
        "mismatch": mismatch,
    }
