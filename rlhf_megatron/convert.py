"""``convert``: Hugging Face ⇄ megatron-core checkpoints (``tools/convert_ckpt.py``, ``rlhf-megatron convert``).

Subcommands:

- ``hf-to-mcore --hf DIR --out DIR --tp N --pp N [--vpp N] [--ep N [--etp N]]``:
  build the model at that layout on ``lcm(tp, etp × ep) × pp`` gloo ranks (spawned
  here, or the current ranks when started under torchrun), let each rank read only
  its slices of the HF safetensors (a mixture-of-experts rank: only its experts),
  and save megatron's distributed checkpoint plus our metadata
  (``models/checkpoint.py`` describes the layout). Loadable at any layout, EP
  included.
- ``mcore-to-hf --ckpt DIR --out DIR``: stream a model checkpoint (converted,
  or a trainer's ``<ckpt>/model``) to HF safetensors one tensor at a time, in
  one process, with megatron's loader reading one tensor per call. Memory is
  bounded by the largest tensor, whatever the model size.
- ``lora-to-peft --ckpt DIR --out DIR [--base HF_DIR]``: a LoRA training
  checkpoint's adapter (``<step>/actor/adapter``; ``--ckpt`` may name it, the
  actor or the step) as a PEFT adapter directory (``PeftModel.from_pretrained``,
  vLLM's ``LoRARequest``), checked against the base model's ``config.json``.
- ``lora-to-hf --ckpt DIR --out DIR [--base HF_DIR]``: the base model with the
  adapter merged in (``W + alpha/r * B A``), streamed tensor by tensor from the
  base's safetensors like ``mcore-to-hf``, with its config and tokenizer.
  The base is ``--base`` or the adapter's ``base_model_name_or_path``.

All validate everything they can before writing, write into a temporary
directory next to ``--out`` and rename it at the end (an interrupted run leaves
no partial output), and refuse to replace ``--out`` without ``--force``.
A full fine-tuning checkpoint given to ``lora-to-*``, or a LoRA one given to
``mcore-to-hf``, is refused with the subcommand to use instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from rlhf_megatron.config.model_arch import ModelArch, UnsupportedModelError
from rlhf_megatron.models.hf_io import HFCheckpoint, HFCheckpointError
from rlhf_megatron.models.spec import (
    SpecError,
    StageError,
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

__all__ = ["ConversionError", "convert_hf_to_mcore", "convert_mcore_to_hf", "main"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_FLAGS = {v: k for k, v in _DTYPES.items()}


class ConversionError(ValueError):
    """The conversion cannot proceed; the message says what to change."""


# -- output directory handling -------------------------------------------------


def _prepare_out(out: Path, force: bool) -> Path:
    """Fail early on an existing ``out``; return a fresh temporary directory beside it."""
    if out.exists() and not force:
        raise ConversionError(f"{out} already exists; pass --force to replace it")
    tmp = out.parent / f".{out.name}.converting"
    if tmp.exists():  # left by an interrupted run (the name is ours)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished ``tmp`` to ``out`` with renames, so ``out`` is never half-written."""
    if out.exists():
        if not force:
            raise ConversionError(f"{out} appeared during the conversion; pass --force to replace it")
        old = out.parent / f".{out.name}.replaced"
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


# -- hf-to-mcore -----------------------------------------------------------------


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
    chunks = build_gpt_model(arch, parallel, params_dtype=_DTYPES[dtype_flag], init_weights=False)
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
            tmp = _prepare_out(out, force)
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
            _publish(tmp, out, force)
        torch.distributed.barrier()
        return out
    from rlhf_megatron.platform.multiproc import run_on_ranks

    tmp = _prepare_out(out, force)
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
        _publish(tmp, out, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- mcore-to-hf -----------------------------------------------------------------


def _plan_export(specs, arch: ModelArch, saved_tp: int, dtype: torch.dtype):
    """HF ``(name, shape, dtype)`` in write order; checks names, shapes and completeness first."""
    plan = []
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
        for hf_name, t in mcore_to_hf(spec.name, torch.empty(spec.shape, device="meta"), arch):
            plan.append((hf_name, tuple(t.shape), dtype))
    expected = expected_hf_shapes(arch)
    missing = sorted(set(expected) - {n for n, _, _ in plan})
    if missing:
        raise ConversionError(
            f"the checkpoint lacks tensors for {len(missing)} HF tensor(s), e.g. {missing[:3]}; is it complete?"
        )
    return plan


def _hf_config(arch: ModelArch, source_config: Path | None, dtype: torch.dtype) -> dict:
    if source_config is not None and source_config.is_file():
        config = json.loads(source_config.read_text())
    else:  # no config.json anywhere: rebuild one from the arch
        from transformers import AutoConfig

        config = AutoConfig.for_model(arch.model_type, **_arch_to_hf_fields(arch)).to_dict()
    config["architectures"] = [arch.architecture]
    dtype_name = str(dtype).removeprefix("torch.")
    config["dtype"] = dtype_name
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name
    if arch.head != "lm":
        config["num_labels"] = 1
        config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    return config


def _arch_to_hf_fields(arch: ModelArch) -> dict:
    """transformers config kwargs for ``arch`` (nested text/vision sections for vision-language models)."""
    if arch.vision is not None:
        return _vl_arch_to_hf_fields(arch)
    rope = {"rope_type": "default", "rope_theta": arch.rope_theta}
    if arch.rope_scaling is not None:
        s = arch.rope_scaling
        rope.update(rope_type=s.rope_type, factor=s.factor)
        if s.rope_type == "llama3":
            rope.update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
    return dict(
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        tie_word_embeddings=arch.tie_word_embeddings,
        rms_norm_eps=arch.norm_eps,
        max_position_embeddings=arch.max_position_embeddings,
        rope_parameters=rope,
        sliding_window=arch.sliding_window,
        initializer_range=arch.initializer_range,
        **_moe_arch_to_hf_fields(arch),
    )


def _moe_arch_to_hf_fields(arch: ModelArch) -> dict:
    """The experts' config keys in each family's spelling (none for dense models)."""
    moe = arch.moe
    if moe is None:
        return {}
    common = dict(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coef)
    if arch.model_type == "mixtral":  # experts are intermediate_size wide; always renormalised
        return dict(num_local_experts=moe.num_experts, **common)
    out = dict(
        num_experts=moe.num_experts,
        moe_intermediate_size=moe.ffn_hidden_size,
        norm_topk_prob=moe.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(arch.num_layers) if not arch.is_moe_layer(i)],
        **common,
    )
    if arch.model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size, qkv_bias=arch.qkv_bias)
    return out


def _vl_arch_to_hf_fields(arch: ModelArch) -> dict:
    v = arch.vision
    text = dict(
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_kv_heads,
        vocab_size=arch.vocab_size,
        rms_norm_eps=arch.norm_eps,
        max_position_embeddings=arch.max_position_embeddings,
        initializer_range=arch.initializer_range,
        tie_word_embeddings=arch.tie_word_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": arch.rope_theta,
            "mrope_section": list(arch.mrope_section),
        },
    )
    vision = dict(
        depth=v.depth,
        num_heads=v.num_heads,
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        spatial_merge_size=v.spatial_merge_size,
        in_channels=v.in_channels,
        rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta},
    )
    if arch.model_type == "qwen2_5_vl":
        vision.update(
            hidden_size=v.hidden_size,
            intermediate_size=v.intermediate_size,
            out_hidden_size=v.out_hidden_size,
            window_size=v.window_size,
            fullatt_block_indexes=list(v.fullatt_block_indexes),
        )
    else:
        vision.update(
            embed_dim=v.hidden_size,
            mlp_ratio=v.intermediate_size // v.hidden_size,
            hidden_size=v.out_hidden_size,
        )
    tokens = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return dict(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=arch.tie_word_embeddings,
        **{t: getattr(arch, t) for t in tokens},
    )


def _write_hf_config(out_dir: Path, config: dict, arch: ModelArch) -> None:
    """``config.json``, and a ``generation_config.json`` derived from it if none was copied."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (out_dir / "generation_config.json").exists() and arch.head == "lm":
        from transformers import GenerationConfig, PretrainedConfig

        # A transformers-5 vision-language config nests the language model's token ids.
        text = config.get("text_config") or config
        text = {k: v for k, v in text.items() if k not in ("text_config", "vision_config")}
        GenerationConfig.from_model_config(PretrainedConfig(**text)).save_pretrained(out_dir)


def _resolve_model_checkpoint(ckpt: str | Path) -> Path:
    """``resolve_checkpoint_dir``, pointing a LoRA checkpoint (adapter, no ``model/``) to ``lora-to-*``."""
    from rlhf_megatron.models.checkpoint import CheckpointError, resolve_checkpoint_dir

    try:
        return resolve_checkpoint_dir(ckpt)
    except CheckpointError:
        from rlhf_megatron.convert_lora import find_adapter

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
    out_dtype = _DTYPES[dtype] if dtype else getattr(torch, meta.dtype)
    out = Path(out)
    specs = checkpoint_tensor_specs(ckpt_dir)
    plan = _plan_export(specs, arch, meta.tensor_model_parallel_size, out_dtype)
    tmp = _prepare_out(out, force)
    created_pg = _ensure_process_group()
    try:
        writer = SafetensorsShardWriter(tmp, plan, max_shard_bytes)
        from tqdm import tqdm

        with tqdm(total=len(specs), desc="mcore-to-hf", unit="tensor", disable=not progress) as bar:
            for spec, full in iter_checkpoint_tensors(ckpt_dir, specs):
                for hf_name, t in mcore_to_hf(spec.name, full, arch):
                    writer.write(hf_name, t.to(out_dtype))
                bar.update()
        writer.close()
        copy_hf_side_files(side_dir, tmp)
        _write_hf_config(tmp, _hf_config(arch, side_dir / "config.json", out_dtype), arch)
        _publish(tmp, out, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if created_pg:
            torch.distributed.destroy_process_group()
    return out


# -- command line ------------------------------------------------------------------


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: use e.g. 500MB, 2GB or 123456 (bytes)")
    return int(float(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    h2m = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron distributed checkpoint")
    h2m.add_argument("--hf", required=True, type=Path, help="HF model directory (config.json + safetensors)")
    h2m.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    h2m.add_argument("--tp", type=int, default=1, help="tensor-parallel size to convert at")
    h2m.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to convert at")
    h2m.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    h2m.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    h2m.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    h2m.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="parameter dtype to store")
    h2m.add_argument(
        "--head",
        choices=["lm", "value", "reward"],
        default=None,
        help="model head (default: from config.json's architectures)",
    )
    h2m.add_argument("--force", action="store_true", help="replace --out if it exists")
    m2h = sub.add_parser("mcore-to-hf", help="megatron model checkpoint -> HF safetensors")
    m2h.add_argument(
        "--ckpt", required=True, type=Path, help="checkpoint dir, or a trainer checkpoint holding model/"
    )
    m2h.add_argument("--out", required=True, type=Path, help="HF directory to create")
    m2h.add_argument(
        "--hf-config",
        type=Path,
        default=None,
        help="take config.json/tokenizer from this HF dir instead of the checkpoint's copies",
    )
    m2h.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="output dtype (default: as saved)"
    )
    m2h.add_argument(
        "--max-shard-size", type=_parse_size, default=2 * 1024**3, help="e.g. 2GB (default), 500MB"
    )
    m2h.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")
    m2h.add_argument("--no-progress", action="store_true", help="no progress bar")
    m2h.add_argument("--force", action="store_true", help="replace --out if it exists")
    ckpt_help = "a LoRA checkpoint's adapter dir, its <step>/actor, or the <step> dir"
    base_help = "base HF model dir (default: the adapter's base_model_name_or_path)"
    l2p = sub.add_parser("lora-to-peft", help="LoRA checkpoint -> PEFT adapter directory")
    l2p.add_argument("--ckpt", required=True, type=Path, help=ckpt_help)
    l2p.add_argument("--out", required=True, type=Path, help="adapter directory to create")
    l2p.add_argument("--base", type=Path, default=None, help=base_help)
    l2p.add_argument("--force", action="store_true", help="replace --out if it exists")
    l2h = sub.add_parser("lora-to-hf", help="LoRA checkpoint + base -> merged HF safetensors")
    l2h.add_argument("--ckpt", required=True, type=Path, help=ckpt_help)
    l2h.add_argument("--out", required=True, type=Path, help="HF directory to create")
    l2h.add_argument("--base", type=Path, default=None, help=base_help)
    l2h.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="output dtype (default: as the base stores it)"
    )
    l2h.add_argument(
        "--max-shard-size", type=_parse_size, default=2 * 1024**3, help="e.g. 2GB (default), 500MB"
    )
    l2h.add_argument("--no-progress", action="store_true", help="no progress bar")
    l2h.add_argument("--force", action="store_true", help="replace --out if it exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``tools/convert_ckpt.py`` and ``rlhf-megatron convert``. Returns the exit status."""
    from rlhf_megatron.convert_lora import convert_lora_to_hf, convert_lora_to_peft
    from rlhf_megatron.models.checkpoint import CheckpointError
    from rlhf_megatron.models.lora import LoraTargetError
    from rlhf_megatron.platform.multiproc import RankFailedError

    args = build_parser().parse_args(argv)
    try:
        if args.command == "hf-to-mcore":
            out = convert_hf_to_mcore(
                args.hf,
                args.out,
                args.tp,
                args.pp,
                args.vpp,
                args.dtype,
                args.head,
                args.force,
                args.ep,
                args.etp,
            )
        elif args.command == "mcore-to-hf":
            out = convert_mcore_to_hf(
                args.ckpt,
                args.out,
                args.hf_config,
                args.dtype,
                args.max_shard_size,
                args.force,
                verify=not args.no_verify,
                progress=not args.no_progress,
            )
        elif args.command == "lora-to-peft":
            out = convert_lora_to_peft(args.ckpt, args.out, args.base, args.force)
        else:
            out = convert_lora_to_hf(
                args.ckpt,
                args.out,
                args.base,
                args.dtype,
                args.max_shard_size,
                args.force,
                progress=not args.no_progress,
            )
    except (
        ConversionError,
        CheckpointError,
        HFCheckpointError,
        LoraTargetError,
        SpecError,
        StageError,
        UnsupportedModelError,
        FileNotFoundError,
        RankFailedError,
    ) as e:
        print(f"convert {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(f"convert {args.command}: wrote {out}")
    return 0
