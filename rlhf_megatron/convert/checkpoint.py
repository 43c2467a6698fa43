"""HF ⇄ megatron-core model checkpoints: ``convert_hf_to_mcore`` (every rank reads only its
slices) and ``convert_mcore_to_hf`` (streamed one tensor at a time). The package docstring
(``convert/__init__.py``) describes both.

Boundaries: builds models through ``models/``; no Ray, vLLM or trainer.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import torch

from rlhf_megatron.convert.common import (
    DTYPES,
    ConversionError,
    hf_config,
    prepare_out,
    publish,
    write_hf_config,
)
from rlhf_megatron.convert.lora import find_adapter
from rlhf_megatron.models.hf_io import HFCheckpoint
from rlhf_megatron.models.mtp import saved_mtp
from rlhf_megatron.models.spec import (
    ExpertStacker,
    SpecError,
    expected_hf_shapes,
    hf_names,
    hf_source,
    is_expert_param,
    layer_offset,
    mcore_full_shape,
    mcore_param_names,
    mcore_to_hf,
    tp_shard_slices,
)
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = ["conversion_world_size", "convert_hf_to_mcore", "convert_mcore_to_hf"]


def _preflight_hf(
    hf_dir: Path, arch: ModelArch, tp: int, pp: int, vpp: int | None, ep: int = 1, etp: int | None = None
) -> None:
    """Every tensor the model needs is present with the right shape, and the layout fits."""
    from rlhf_megatron.models.loader import is_scalar_head_param

    source = hf_source(HFCheckpoint(hf_dir), arch)  # a family's alternative HF names count too
    expected = expected_hf_shapes(arch)
    layer_offset(arch.num_layers, 0, pp, 0 if vpp else None, vpp)  # raises if layers do not split evenly
    if arch.num_attention_heads % tp:
        raise ConversionError(
            f"num_attention_heads ({arch.num_attention_heads}) is not divisible by --tp {tp}"
        )
    if arch.moe is None and ep > 1:
        raise ConversionError(f"--ep {ep}: {arch.architecture} has no experts; use --ep 1")
    if arch.moe is not None and arch.moe.num_experts % ep:
        raise ConversionError(f"--ep {ep} does not divide the model's {arch.moe.num_experts} experts")
    for name in mcore_param_names(arch):
        size = (etp or tp) if is_expert_param(name, arch) else tp
        tp_shard_slices(name, arch, 0, size)  # raises if (expert) TP does not divide this parameter
        for hf_name in hf_names(name, arch):
            if hf_name not in source:
                if is_scalar_head_param(name, arch):
                    continue  # a critic/reward head absent from an LM checkpoint starts from its init
                raise ConversionError(
                    f"{hf_dir}: tensor {hf_name} (for megatron {name}) is missing from the checkpoint"
                )
            if source.shape(hf_name) != expected[hf_name]:
                raise ConversionError(
                    f"{source.where(hf_name)} has shape {list(source.shape(hf_name))}, but config.json implies "
                    f"{list(expected[hf_name])}"
                )


def _hf_to_mcore_rank(rank, world_size, hf_dir, tmp, arch_dict, tp, pp, vpp, dtype_flag, ep=1, etp=None):
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.checkpoint import save_model_checkpoint
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.platform import init_model_parallel

    arch = ModelArch.from_dict(arch_dict)
    init_model_parallel(tp, pp, vpp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    parallel = ParallelConfig(tp, pp, vpp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    chunks = build_gpt_model(arch, parallel, params_dtype=DTYPES[dtype_flag], init_weights=False)
    load_hf_weights(chunks, hf_dir, arch, progress=rank == 0)
    save_model_checkpoint(chunks, tmp, arch, parallel, hf_dir=hf_dir, source=str(Path(hf_dir).resolve()))


def _under_torchrun() -> bool:
    return torch.distributed.is_initialized() or "TORCHELASTIC_RUN_ID" in os.environ


def conversion_world_size(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """Ranks a conversion runs on: the dense grid (TP x DP) and the expert grid (ETP x EP x expert
    DP) must cover the same ranks per pipeline stage, so ``lcm(tp, etp x ep)`` of them per stage."""
    return math.lcm(tp, (etp or tp) * ep) * pp


def convert_hf_to_mcore(
    hf_dir: str | Path,
    out: str | Path,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    dtype: str = "fp32",
    head: str | None = None,
    force: bool = False,
    ep: int = 1,
    etp: int | None = None,
) -> Path:
    """HF safetensors -> megatron distributed checkpoint at layout TP×PP(×VPP)(×EP, ETP). Returns ``out``."""
    hf_dir, out = Path(hf_dir), Path(out)
    arch = ModelArch.from_hf_dir(hf_dir, head=head)
    _preflight_hf(hf_dir, arch, tp, pp, vpp, ep, etp)
    world = conversion_world_size(tp, pp, ep, etp)
    if _under_torchrun():
        # torchrun started world_size copies of this command: each rank converts its part.
        from rlhf_megatron.platform import init_distributed

        init_distributed()
        rank = torch.distributed.get_rank()
        if out.exists() and not force:  # on every rank: a rank-0-only error would leave the rest waiting
            raise ConversionError(f"{out} already exists; pass --force to replace it")
        tmp = out.parent / f".{out.name}.converting"
        if rank == 0:
            tmp = prepare_out(out, force)
        torch.distributed.barrier()
        _hf_to_mcore_rank(
            rank,
            torch.distributed.get_world_size(),
            str(hf_dir),
            str(tmp),
            arch.to_dict(),
            tp,
            pp,
            vpp,
            dtype,
            ep,
            etp,
        )
        if rank == 0:
            publish(tmp, out, force)
        torch.distributed.barrier()
        return out
    from rlhf_megatron.platform.multiproc import run_on_ranks

    tmp = prepare_out(out, force)
    try:
        run_on_ranks(
            _hf_to_mcore_rank,
            world,
            str(hf_dir),
            str(tmp),
            arch.to_dict(),
            tp,
            pp,
            vpp,
            dtype,
            ep,
            etp,
            timeout_s=7 * 24 * 3600.0,
        )
        publish(tmp, out, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _plan_export(specs, arch: ModelArch, saved_tp: int, dtype: torch.dtype):
    """HF ``(name, shape, dtype)`` in write order; checks names, shapes and completeness first.
    The order is what ``convert_mcore_to_hf`` produces: the checkpoint's tensors through an
    ``ExpertStacker`` (a stacked expert tensor comes when its last expert does)."""
    plan = []
    stacker = ExpertStacker(arch)
    for spec in specs:
        try:
            want = mcore_full_shape(spec.name, arch, saved_tp)
        except SpecError as e:
            raise ConversionError(f"checkpoint tensor {spec.key} (as {spec.name}): {e}") from None
        vocab = (
            spec.name.endswith(("embedding.word_embeddings.weight", "output_layer.weight"))
            and arch.head == "lm"
        )
        # The vocabulary rows are padded for the TP size the checkpoint was saved at.
        ok = (
            (spec.shape[1:] == want[1:] and spec.shape[0] >= arch.vocab_size) if vocab else spec.shape == want
        )
        if not ok:
            raise ConversionError(
                f"checkpoint tensor {spec.name} has shape {list(spec.shape)}, but the config "
                f"({arch.architecture}) implies {list(want)}; the checkpoint and config.json disagree"
            )
        for hf_row, t in mcore_to_hf(spec.name, torch.empty(spec.shape, device="meta"), arch):
            plan.extend((hf_name, tuple(w.shape), dtype) for hf_name, w in stacker.add(hf_row, t))
    expected = expected_hf_shapes(arch)
    missing = sorted(set(expected) - {n for n, _, _ in plan})
    if missing:
        raise ConversionError(
            f"the checkpoint lacks tensors for {len(missing)} HF tensor(s), e.g. {missing[:3]}; is it complete?"
        )
    return plan


def _resolve_model_checkpoint(ckpt: str | Path) -> Path:
    """``resolve_checkpoint_dir``, pointing a LoRA checkpoint (adapter, no ``model/``) to ``lora-to-*``."""
    from rlhf_megatron.models.checkpoint import CheckpointError, resolve_checkpoint_dir

    try:
        return resolve_checkpoint_dir(ckpt)
    except CheckpointError:
        adapter = find_adapter(Path(ckpt).expanduser())
        if adapter is None:
            raise
        raise ConversionError(
            f"{ckpt} is a LoRA checkpoint: {adapter} holds its adapter and there are no full model "
            f"weights (no model/); export it with `convert lora-to-hf --ckpt {ckpt} --out DIR` (base and "
            f"adapter merged) or `convert lora-to-peft --ckpt {ckpt} --out DIR` (the adapter alone)"
        ) from None


def _ensure_process_group() -> bool:
    """megatron's loader needs torch.distributed; a one-process gloo group will do. True if created here."""
    if torch.distributed.is_initialized():
        return False
    from rlhf_megatron.platform import init_distributed
    from rlhf_megatron.platform.multiproc import find_free_port

    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=find_free_port())
    return True


def convert_mcore_to_hf(
    ckpt: str | Path,
    out: str | Path,
    hf_config_dir: str | Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    force: bool = False,
    verify: bool = True,
    progress: bool = True,
) -> Path:
    """megatron model checkpoint (any layout) -> HF safetensors + config + tokenizer. Returns ``out``."""
    from rlhf_megatron.models.checkpoint import (
        checkpoint_tensor_specs,
        copy_hf_side_files,
        iter_checkpoint_tensors,
        read_checkpoint_metadata,
        verify_checkpoint_files,
    )
    from rlhf_megatron.models.hf_io import SafetensorsShardWriter

    ckpt_dir = _resolve_model_checkpoint(ckpt)
    meta = read_checkpoint_metadata(ckpt_dir)
    if verify:
        verify_checkpoint_files(ckpt_dir, meta)
    arch = meta.arch
    side_dir = Path(hf_config_dir) if hf_config_dir is not None else ckpt_dir
    if hf_config_dir is not None:
        other = ModelArch.from_hf_dir(side_dir, head=arch.head)
        if other != arch:
            diff = {k: (v, getattr(other, k)) for k, v in arch.to_dict().items() if getattr(other, k) != v}
            raise ConversionError(
                f"{side_dir / 'config.json'} describes another model than {ckpt_dir}: {diff}"
            )
    out_dtype = DTYPES[dtype] if dtype else getattr(torch, meta.dtype)
    out = Path(out)
    specs = checkpoint_tensor_specs(ckpt_dir)
    plan = _plan_export(specs, arch, meta.tensor_model_parallel_size, out_dtype)
    mtp = saved_mtp(ckpt_dir)  # untrained next-token-prediction layers: written back as stored
    mtp_names = mtp.names() if mtp is not None else []
    plan += [(n, mtp.shape(n), mtp.dtype(n)) for n in mtp_names]
    tmp = prepare_out(out, force)
    created_pg = _ensure_process_group()
    try:
        writer = SafetensorsShardWriter(tmp, plan, max_shard_bytes)
        from tqdm import tqdm

        with tqdm(total=len(specs), desc="mcore-to-hf", unit="tensor", disable=not progress) as bar:
            stacker = ExpertStacker(arch)  # a layer's stacked experts are written once all have come
            for spec, full in iter_checkpoint_tensors(ckpt_dir, specs):
                for hf_row, t in mcore_to_hf(spec.name, full, arch):
                    for hf_name, whole in stacker.add(hf_row, t):
                        writer.write(hf_name, whole.to(out_dtype))
                bar.update()
        for name in mtp_names:
            writer.write(name, mtp.read(name))
        writer.close()
        copy_hf_side_files(side_dir, tmp)
        write_hf_config(tmp, hf_config(arch, side_dir / "config.json", out_dtype), arch)
        publish(tmp, out, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if created_pg:
            torch.distributed.destroy_process_group()
    return out
