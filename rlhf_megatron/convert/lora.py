"""``convert lora-to-peft`` and ``convert lora-to-hf``: a LoRA training checkpoint's adapter out.

A LoRA run's checkpoint holds, for the actor, a PEFT adapter directory (``<step>/actor/adapter``,
``models.lora_io``) instead of model weights. ``lora-to-peft`` writes it out as a PEFT adapter
checked against its base model; ``lora-to-hf`` streams the base model's safetensors tensor by tensor
with the adapter merged in (``W + alpha/r * B A``), plus its config and tokenizer. The output
directory conventions (temporary directory, rename, ``--force``) are ``convert``'s.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_megatron.config.schema_model import LoraConfig
from rlhf_megatron.convert.common import (
    DTYPES,
    ConversionError,
    hf_config,
    prepare_out,
    publish,
    write_hf_config,
)
from rlhf_megatron.models.hf_io import HFCheckpoint
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = ["convert_lora_to_hf", "convert_lora_to_peft", "find_adapter"]


@dataclass(frozen=True)
class _LoraSource:
    """A LoRA checkpoint's adapter, read and checked against its base model."""

    adapter_dir: Path
    base_dir: Path
    arch: ModelArch
    lora: LoraConfig
    tensors: dict[str, torch.Tensor]  # canonical PEFT keys -> fp32 factors


def find_adapter(path: Path) -> Path | None:
    """The PEFT adapter directory of ``path``: itself, ``path/adapter`` (a trainer's
    ``<step>/actor``) or ``path/actor/adapter`` (a ``<step>`` directory); None if none of them."""
    from rlhf_megatron.models.lora_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    for candidate in (path, path / "adapter", path / "actor" / "adapter"):
        if (candidate / ADAPTER_CONFIG).is_file() or (candidate / ADAPTER_WEIGHTS).is_file():
            return candidate
    return None


def _no_adapter_error(path: Path) -> ConversionError:
    from rlhf_megatron.models.checkpoint import CKPT_METADATA_FILE
    from rlhf_megatron.models.lora_io import ADAPTER_CONFIG

    if not path.exists():
        return ConversionError(f"{path} does not exist")
    for candidate in (path, path / "model", path / "actor" / "model"):
        if (candidate / CKPT_METADATA_FILE).is_file():
            return ConversionError(
                f"{path} is a full fine-tuning checkpoint ({candidate} holds every weight, and there is no "
                f"LoRA adapter); export it with `convert mcore-to-hf --ckpt {candidate} --out DIR`"
            )
    return ConversionError(
        f"{path} holds no LoRA adapter: expected {ADAPTER_CONFIG} in it, in {path / 'adapter'} or in "
        f"{path / 'actor' / 'adapter'} (a LoRA training checkpoint keeps its adapter in <step>/actor/adapter)"
    )


def _adapter_base(adapter: Path) -> Path:
    """The base model the adapter's ``adapter_config.json`` names, which must be a local HF directory."""
    from rlhf_megatron.models.lora_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    config_file = adapter / ADAPTER_CONFIG
    if not config_file.is_file():
        raise ConversionError(
            f"LoRA adapter {adapter}: {ADAPTER_CONFIG} is missing (a PEFT adapter directory holds "
            f"{ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})"
        )
    try:
        recorded = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except json.JSONDecodeError as e:
        raise ConversionError(f"{config_file}: not valid JSON ({e})") from None
    if not recorded:
        raise ConversionError(
            f"{config_file} names no base model (base_model_name_or_path); pass --base HF_DIR"
        )
    base = Path(os.path.expanduser(recorded))
    if not (base / "config.json").is_file():
        raise ConversionError(
            f"the adapter's base model {recorded!r} (base_model_name_or_path in {config_file}) is not a local "
            "HF model directory with config.json; pass --base HF_DIR"
        )
    return base


def _read_lora_source(ckpt: str | Path, base: str | Path | None) -> _LoraSource:
    """Find the adapter under ``ckpt``, and read it against ``base`` (or the base it names)."""
    from rlhf_megatron.models.lora import LoraTargetError
    from rlhf_megatron.models.lora_io import read_peft_adapter

    path = Path(ckpt).expanduser()
    adapter = find_adapter(path)
    if adapter is None:
        raise _no_adapter_error(path)
    base_dir = Path(base).expanduser() if base is not None else _adapter_base(adapter)
    arch = ModelArch.from_hf_dir(base_dir)
    if arch.head != "lm" or arch.vision is not None:
        raise ConversionError(
            f"{base_dir / 'config.json'}: {arch.architecture} is not a text causal LM; LoRA export covers "
            "causal-LM actors (vision-language models and value/reward heads are not supported)"
        )
    try:
        lora, tensors = read_peft_adapter(adapter, arch)
    except LoraTargetError as e:
        raise ConversionError(f"{e} (base model: {base_dir})") from None
    return _LoraSource(adapter, base_dir, arch, lora, tensors)


def _refuse_overlap(out: Path, src: _LoraSource) -> None:
    """``--force`` must never replace the inputs the conversion reads."""
    target = out.resolve()
    for what, path in (("the adapter", src.adapter_dir), ("the base model", src.base_dir)):
        path = path.resolve()
        if target == path or target in path.parents:
            raise ConversionError(f"--out {out} would replace {what} ({path}); choose another directory")


def convert_lora_to_peft(
    ckpt: str | Path, out: str | Path, base: str | Path | None = None, force: bool = False
) -> Path:
    """A LoRA checkpoint's adapter -> a PEFT adapter directory whose ``base_model_name_or_path``
    is the (absolute) base model. Returns ``out``."""
    from rlhf_megatron.models.lora_io import write_peft_adapter

    out = Path(out)
    src = _read_lora_source(ckpt, base)
    _refuse_overlap(out, src)
    if out.exists() and not force:
        raise ConversionError(f"{out} already exists; pass --force to replace it")
    # write_peft_adapter writes a temporary sibling and renames it over ``out``.
    return write_peft_adapter(out, src.tensors, src.lora, str(src.base_dir.resolve()), src.arch.num_layers)


def _check_merge_targets(source: HFCheckpoint, src: _LoraSource) -> None:
    """Every adapted projection's weight is in the base's safetensors with shape [out(B), in(A)]."""
    for key, a in src.tensors.items():
        if ".lora_A." not in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        want = (src.tensors[key.replace(".lora_A.", ".lora_B.")].shape[0], a.shape[1])
        if name not in source:
            raise ConversionError(
                f"the adapter {src.adapter_dir} adapts {name}, which the base model's safetensors in "
                f"{src.base_dir} do not contain; is that the base model the adapter was trained on?"
            )
        if source.shape(name) != want:
            raise ConversionError(
                f"{source.where(name)} has shape {list(source.shape(name))}, but the adapter's factors "
                f"make {list(want)}; is that the base model the adapter was trained on?"
            )


def convert_lora_to_hf(
    ckpt: str | Path,
    out: str | Path,
    base: str | Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Base model + LoRA adapter -> merged HF safetensors + config + tokenizer. Returns ``out``.

    One base tensor in memory at a time (an adapted one also in fp32 while its delta is added).
    ``dtype``: of the floating-point tensors (default: each as the base stores it)."""
    from tqdm import tqdm

    from rlhf_megatron.models.checkpoint import copy_hf_side_files
    from rlhf_megatron.models.hf_io import SafetensorsShardWriter
    from rlhf_megatron.models.lora_io import merge_adapters

    out = Path(out)
    src = _read_lora_source(ckpt, base)
    _refuse_overlap(out, src)
    source = HFCheckpoint(src.base_dir)
    _check_merge_targets(source, src)
    # A bare-model checkpoint's names are also listed with "model." (HFCheckpoint): write those once.
    names = [n for n in source.names() if n.startswith("model.") or f"model.{n}" not in source]
    out_dtype = {
        n: DTYPES[dtype] if dtype and source.dtype(n).is_floating_point else source.dtype(n) for n in names
    }
    plan = [(n, source.shape(n), out_dtype[n]) for n in names]
    tmp = prepare_out(out, force)
    try:
        writer = SafetensorsShardWriter(tmp, plan, max_shard_bytes)

        def base_weights():
            for n in names:
                t = source.read(n)
                # In the wider of the two dtypes, so the merged weight is rounded once, on write.
                yield n, t.to(torch.promote_types(t.dtype, out_dtype[n])) if t.is_floating_point() else t

        merged = merge_adapters(base_weights(), src.tensors, src.lora.scale)
        for name, t in tqdm(merged, total=len(names), desc="lora-to-hf", unit="tensor", disable=not progress):
            writer.write(name, t)
        writer.close()
        copy_hf_side_files(src.base_dir, tmp)
        config = json.loads((src.base_dir / "config.json").read_text())
        if dtype:
            config = hf_config(src.arch, src.base_dir / "config.json", DTYPES[dtype])
        write_hf_config(tmp, config, src.arch)
        publish(tmp, out, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
