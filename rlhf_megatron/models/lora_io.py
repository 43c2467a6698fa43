"""PEFT adapter directories: what this project's LoRA adapters look like on disk.

``write_peft_adapter`` writes ``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT's
``save_pretrained`` does (so ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load it),
into a temporary directory renamed into place. ``read_peft_adapter`` reads one back, checking it
against the model (the layers and widths it adapts) and naming the file and tensor that do not
fit. ``merge_adapters`` folds adapters into HF weights (``W + scale * B A``) for a merged export.

Keys are PEFT's for a causal LM (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``);
``models.lora`` maps them onto megatron's fused linears.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from rlhf_megatron.config.schema_model import LORA_MODULES, LoraConfig
from rlhf_megatron.planning.lora_targets import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    KEY_PATTERN,
    hf_module_name,
    module_order,
    read_peft_adapter_config,
)
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_DIR",
    "ADAPTER_WEIGHTS",
    "merge_adapters",
    "read_peft_adapter",
    "write_peft_adapter",
]

ADAPTER_DIR = "adapter"
"""Where a LoRA role's checkpoint keeps its adapters (``<step>/actor/adapter``), in place of ``model``."""


def write_peft_adapter(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    lora: LoraConfig,
    base_path: str | None,
    num_layers: int | None = None,
) -> Path:
    """Write ``tensors`` (PEFT keys, ``models.lora.full_adapter_tensors``) as a PEFT adapter
    directory at ``out_dir``, atomically (a temporary sibling renamed over it). ``num_layers``:
    the model's, so layers past the last adapted one are listed as excluded too (PEFT would give
    them fresh adapters otherwise)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    modules = sorted({KEY_PATTERN.match(k).group(1) for k in tensors}, key=module_order)
    parts = sorted({m.rsplit(".", 1)[1] for m in modules}, key=LORA_MODULES.index)
    layers = sorted({int(KEY_PATTERN.match(k).group(2)) for k in tensors})
    # PEFT adapts every module whose name ends with a target; name the ones this adapter leaves out.
    present = set(modules)
    excluded = [
        hf_module_name(layer, part)
        for layer in range(num_layers or layers[-1] + 1)
        for part in parts
        if hf_module_name(layer, part) not in present
    ]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": parts,
        "exclude_modules": excluded or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"}
        )
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_peft_adapter(path: str | Path, arch: ModelArch) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """A PEFT adapter directory's settings (as a ``LoraConfig`` whose ``target_modules`` are the
    modules it holds) and its tensors under canonical PEFT keys, checked against ``arch``
    (``planning.lora_targets.read_peft_adapter_config`` checks the files without loading them)."""
    from safetensors.torch import load_file

    lora, keys = read_peft_adapter_config(path, arch)
    weights = load_file(str(Path(lora.adapter_path) / ADAPTER_WEIGHTS))
    return lora, {keys[key]: value.float() for key, value in weights.items()}


def merge_adapters(
    weights: Iterable[tuple[str, torch.Tensor]], tensors: dict[str, torch.Tensor], scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, weight) pairs with ``scale * B @ A`` added to each adapted projection's weight
    (computed in fp32, returned in the weight's dtype); other tensors pass through."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = KEY_PATTERN.match(key)
        factors.setdefault(f"{m.group(1)}.weight", {})[m.group(4)] = value
    for name, weight in weights:
        ab = factors.get(name)
        if ab is not None:
            delta = (ab["B"].float() @ ab["A"].float()) * scale
            weight = (weight.float() + delta.to(weight.device)).to(weight.dtype)
        yield name, weight
