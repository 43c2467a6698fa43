"""Per-rank bodies of the weight-sync tests (spawned by run_on_ranks)."""

from __future__ import annotations

import os

import torch


def capture_vllm_loaded_weights():
    """Record every vLLM linear/embedding weight as vLLM's own loader left it, before CPU repacking.

    vLLM on CPU repacks linear weights after loading (the parameters become
    empty), and a mixture-of-experts layer's fused ``w13_weight``/``w2_weight``
    into its grouped-GEMM layout, so the per-rank tensors its loader produced
    are only visible at that moment. Returns a dict filled in as layers are
    processed: id(module) -> {param name: tensor}.
    """
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    captured: dict[int, dict[str, torch.Tensor]] = {}
    original = utils.dispatch_cpu_unquantized_gemm
    original_moe = UnquantizedFusedMoEMethod.process_weights_after_loading

    def spy(layer, remove_weight):
        captured[id(layer)] = {n: p.detach().clone() for n, p in layer.named_parameters(recurse=False)}
        return original(layer, remove_weight)

    def moe_spy(self, layer):
        captured[id(layer)] = {n: p.detach().clone() for n, p in layer.named_parameters(recurse=False)}
        return original_moe(self, layer)

    utils.dispatch_cpu_unquantized_gemm = spy
    UnquantizedFusedMoEMethod.process_weights_after_loading = moe_spy
    return captured


def name_captured(engine, captured) -> dict[str, torch.Tensor]:
    names = engine.llm.apply_model(lambda m: {id(mod): name for name, mod in m.named_modules()})[0]
    out = {}
    for key, params in captured.items():
        for pname, t in params.items():
            out[f"{names[key]}.{pname}"] = t
    return out


def build_actor(hf_dir, tp, pp, ep=1, etp=None):
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import ParallelGroups, init_model_parallel

    info = init_model_parallel(tp, pp, seed=0, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    arch = ModelArch.from_hf_dir(hf_dir)
    parallel = ParallelConfig(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    chunks = build_gpt_model(arch, parallel, init_weights=False)
    load_hf_weights(chunks, hf_dir, arch)
    return arch, chunks, info, ParallelGroups.current()


def make_syncer(arch, chunks, info, groups, rollout_tp, load_format, bucket_bytes=1 << 16):
    from rlhf_megatron.weights import TrainLayout, WeightSyncer, build_sync_plan

    plan = build_sync_plan(arch, TrainLayout.of(info), rollout_tp, load_format, bucket_bytes, 4)
    return WeightSyncer.of(plan, chunks, info, groups)


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
        n
        for n in set(hf_tensors) | set(reference)
        if n not in hf_tensors or n not in reference or not torch.equal(hf_tensors[n], reference[n])
    )
    sharded = {
        n: t.clone() for n, t in make_syncer(arch, chunks, info, groups, rollout_tp, "sharded").iter_weights()
    }
    result = {
        "hf_mismatch": hf_mismatch,
        "hf_count": len(hf_tensors),
        "sharded_count": len(sharded),
        "peak_bucket_bytes": hf_syncer.stats["peak_bucket_bytes"],
    }
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
    from vllm.distributed import parallel_state as vllm_state

    # vLLM-CPU's shm all-reduce needs its kernels' shm ops, which its AVX2 build lacks (it then
    # all-reduces over gloo and makes no segment of its own).
    communicator = vllm_state.get_tp_group().device_communicator
    shm_allreduce = type(getattr(communicator, "dist_module", None)).__name__ == "_CPUSHMDistributed"
    shm_left = [n for n in unlinked if os.path.exists(f"/dev/shm/{n}")]
    # vLLM loader's per-rank tensors vs ours, for every tensor vLLM kept.
    if arch.tie_word_embeddings and "lm_head.weight" in from_checkpoint:
        # vLLM ties lm_head to embed_tokens: the embedding we send is what it uses.
        sharded.setdefault("lm_head.weight", sharded.get("model.embed_tokens.weight"))
    sharded_mismatch = sorted(
        (
            n,
            tuple(t.shape),
            tuple(sharded[n].shape) if n in sharded else None,
            float((sharded[n] - t).abs().max()) if n in sharded and sharded[n].shape == t.shape else None,
        )
        for n, t in from_checkpoint.items()
        if n not in sharded or sharded[n].shape != t.shape or not torch.equal(sharded[n], t)
    )
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
    # Refit through the sharded format, in place (vLLM's loader bypassed): every packed layer
    # is repacked from exactly the tensors vLLM's loader made from the checkpoint.
    from rlhf_megatron.rollout.vllm_engine import refit_cpu_in_place

    captured.clear()
    stream = make_syncer(arch, chunks, info, groups, rollout_tp, "sharded").iter_weights()
    engine.llm.apply_model(lambda model: refit_cpu_in_place(model, stream))
    in_place = name_captured(engine, captured)
    in_place_mismatch = sorted(
        n for n, t in from_checkpoint.items() if n not in in_place or not torch.equal(in_place[n], t)
    )
    engine.shutdown()
    result.update(
        vllm_tensors=len(from_checkpoint),
        sharded_mismatch=sharded_mismatch,
        refit_mismatch=refit_mismatch,
        in_place_mismatch=in_place_mismatch,
        shm_unlinked=unlinked,
        shm_allreduce=shm_allreduce,
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


def _vllm_snapshot(engine, captured) -> dict[str, torch.Tensor]:
    """vLLM's parameters as its loader left them: linear weights captured before CPU repacking,
    every other parameter (embeddings, norms, the fused experts w13/w2) as it is."""
    params = engine.llm.apply_model(
        lambda m: {n: p.detach().clone() for n, p in m.named_parameters() if p.numel() > 0}
    )[0]
    return {**params, **name_captured(engine, captured)}


def _perturb(arch, chunks, info) -> None:
    """Move every Megatron weight by noise seeded by its global name: a replicated parameter moves
    alike on every rank holding it (TP shards of one parameter get the same draw, which is fine).
    DeepSeekMoE's score-correction bias (a buffer) moves by enough to change which experts some
    tokens pick, so a sync that left vLLM's bias stale would route them differently."""
    import zlib

    from rlhf_megatron.models.loader import loadable_tensors
    from rlhf_megatron.models.spec import local_to_global_expert, local_to_global_layer

    with torch.no_grad():
        for chunk in chunks:
            for local, p in loadable_tensors(chunk):
                name = local_to_global_layer(local, arch.num_layers, info.pp_rank, info.pp_size, None, None)
                name = local_to_global_expert(name, arch.moe.num_experts, info.ep_rank, info.ep_size)
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.add_((0.3 if name.endswith("expert_bias") else 0.02) * torch.randn(p.shape, generator=g))


def moe_conformance(rank, world_size, hf_dir, tp, pp, ep, rollout_tp, prompts, etp=None, sharded=True):
    """A mixture-of-experts actor at EP > 1 (expert TP ``etp``) against vLLM on this rank:

    - ``sharded`` format: every expert's ``w13_weight[e]`` / ``w2_weight[e]`` row (and every other
      tensor vLLM keeps) equals what vLLM's own loader made from the checkpoint on this rank;
    - ``hf`` refit: vLLM's loader, fed our stream (per-expert HF tensors it fuses itself), makes
      exactly the tensors it made from the checkpoint;
    - after perturbing the Megatron weights and syncing (``hf``, then ``sharded`` in place),
      vLLM's log-probs of its sampled tokens equal the Megatron model's.

    ``sharded=False`` checks the ``hf`` format only (multi-latent attention has no sharded plan).
    """
    arch, chunks, info, groups = build_actor(hf_dir, tp, pp, ep, etp)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from rlhf_megatron.config.schema import RolloutConfig
    from rlhf_megatron.models.forward import forward_logits_or_values, vocab_parallel_log_probs
    from rlhf_megatron.rollout import RolloutSampling
    from rlhf_megatron.rollout.vllm_engine import VLLMEngine

    captured = capture_vllm_loaded_weights()
    engine = VLLMEngine(
        hf_dir,
        RolloutConfig(dtype="float32", max_num_seqs=4),
        max_model_len=64,
        tensor_parallel_size=rollout_tp,
    )
    from_checkpoint = _vllm_snapshot(engine, captured)
    sharded_mismatch, rows = [], 0
    sharded_stream = (
        make_syncer(arch, chunks, info, groups, rollout_tp, "sharded").iter_weights() if sharded else ()
    )
    for name, t in sharded_stream:
        param, _, index = name.rstrip("]").partition("[")
        if param not in from_checkpoint:
            continue  # e.g. lm_head tied / not kept by vLLM
        ref = from_checkpoint[param][int(index)] if index else from_checkpoint[param]
        rows += bool(index)
        if ref.shape != t.shape or not torch.equal(ref, t):
            sharded_mismatch.append(name)
    captured.clear()
    engine.update_weights(make_syncer(arch, chunks, info, groups, rollout_tp, "hf").iter_weights())
    refit = _vllm_snapshot(engine, captured)
    refit_mismatch = sorted(
        n for n, t in from_checkpoint.items() if n not in refit or not torch.equal(refit[n], t)
    )

    from rlhf_megatron.data.batch import Batch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    batch = Batch.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        {"index": [f"p{i}" for i in range(len(prompts))], "raw_prompt_ids": prompts},
    )

    def logprob_err() -> tuple[float, int]:
        out = engine.generate_sequences(
            batch, RolloutSampling(n=2, temperature=1.0, response_length=8, seed=7)
        )
        logits = forward_logits_or_values(
            chunks, out["input_ids"], out["attention_mask"], out["position_ids"]
        )
        logp = vocab_parallel_log_probs(logits[:, width - 1 : -1], out["responses"], arch.vocab_size)
        err = ((logp - out["rollout_log_probs"]).abs() * out["response_mask"]).max().item()
        return err, int(out["response_mask"].sum())

    # Changed weights through vLLM's loader (the engine repacks the experts vLLM 0.32 on CPU
    # leaves unpacked after a reload), then changed again, in place (load_format=sharded).
    _perturb(arch, chunks, info)
    engine.update_weights(make_syncer(arch, chunks, info, groups, rollout_tp, "hf").iter_weights())
    hf_err, sampled = logprob_err()
    sharded_err = None
    if sharded:
        _perturb(arch, chunks, info)
        engine.load_format = "sharded"
        engine.update_weights(make_syncer(arch, chunks, info, groups, rollout_tp, "sharded").iter_weights())
        sharded_err, _ = logprob_err()
    engine.shutdown()  # last: it tears down the process groups the Megatron model uses
    return {
        "expert_rows": rows,
        "sharded_checked": len(from_checkpoint),
        "sharded_mismatch": sharded_mismatch,
        "refit_mismatch": refit_mismatch,
        "logprob_err": hf_err,
        "sharded_logprob_err": sharded_err,
        "sampled_tokens": sampled,
    }
