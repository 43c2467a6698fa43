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
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from rlhf_megatron.config.model_arch import ModelArch
from rlhf_megatron.config.schema_model import LORA_MODULES, LoraConfig
from rlhf_megatron.models.lora import LoraTargetError, hf_module_name

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
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.default)?\.weight$"
)


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
    modules = sorted({_KEY.match(k).group(1) for k in tensors}, key=_module_order)
    parts = sorted({m.rsplit(".", 1)[1] for m in modules}, key=LORA_MODULES.index)
    layers = sorted({int(_KEY.match(k).group(2)) for k in tensors})
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


def _module_order(name: str) -> tuple[int, int]:
    layer, part = re.match(r"model\.layers\.(\d+)\..*\.(\w+)$", name).groups()
    return int(layer), LORA_MODULES.index(part)


def read_peft_adapter(path: str | Path, arch: ModelArch) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """A PEFT adapter directory's settings (as a ``LoraConfig`` whose ``target_modules`` are the
    modules it holds) and its tensors under canonical PEFT keys, checked against ``arch``."""
    from safetensors.torch import load_file

    root = Path(os.path.expanduser(str(path)))
    config_file, weights_file = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(
                f"LoRA adapter {root}: {f.name} is missing; expected a PEFT adapter directory "
                f"({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}, as PEFT's save_pretrained writes it)"
            )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise LoraTargetError(f"{config_file}: not valid JSON ({e})") from e
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise LoraTargetError(
            f"{config_file}: peft_type={config.get('peft_type')!r} is not a plain LoRA adapter"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not alpha:
        raise LoraTargetError(f"{config_file}: r={rank!r} and lora_alpha={alpha!r} must be set (r >= 1)")
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_rslora"):
        raise LoraTargetError(
            f"{config_file}: rank_pattern / alpha_pattern / use_rslora are not supported (one rank and "
            "alpha for every module)"
        )
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    for key, value in load_file(str(weights_file)).items():
        m = _KEY.match(key)
        if m is None:
            raise LoraTargetError(
                f"{weights_file}: tensor {key} is not a LoRA factor of a decoder layer's projection "
                f"({list(LORA_MODULES)}); embedding, LM-head or vision-tower adapters are not supported"
            )
        module, layer, part, factor = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        if part not in LORA_MODULES or layer >= arch.num_layers:
            raise LoraTargetError(
                f"{weights_file}: {key} adapts {module}, which {arch.architecture} "
                f"({arch.num_layers} layers) does not have: was the adapter trained on another base model?"
            )
        _check_shape(weights_file, key, value, arch, part, factor, rank)
        tensors[f"base_model.model.{module}.lora_{factor}.weight"] = value.float()
        modules.append(module)
    lora = LoraConfig(
        rank=rank,
        alpha=float(alpha),
        target_modules=tuple(sorted(set(modules), key=_module_order)),
        adapter_path=str(root),
    )
    return lora, tensors


def _check_shape(
    file: Path, key: str, value: torch.Tensor, arch: ModelArch, part: str, factor: str, rank: int
):
    d = arch.head_dim
    widths = {  # (in, out) of each projection
        "q_proj": (arch.hidden_size, arch.num_attention_heads * d),
        "k_proj": (arch.hidden_size, arch.num_kv_heads * d),
        "v_proj": (arch.hidden_size, arch.num_kv_heads * d),
        "o_proj": (arch.num_attention_heads * d, arch.hidden_size),
        "gate_proj": (arch.hidden_size, arch.ffn_hidden_size),
        "up_proj": (arch.hidden_size, arch.ffn_hidden_size),
        "down_proj": (arch.ffn_hidden_size, arch.hidden_size),
    }
    fan_in, fan_out = widths[part]
    want = (rank, fan_in) if factor == "A" else (fan_out, rank)
    if tuple(value.shape) != want:
        raise LoraTargetError(
            f"{file}: {key} has shape {list(value.shape)}, but {arch.architecture} (hidden {arch.hidden_size}, "
            f"ffn {arch.ffn_hidden_size}) with r={rank} needs {list(want)}: the adapter's base model does "
            "not match this model"
        )


def merge_adapters(
    weights: Iterable[tuple[str, torch.Tensor]], tensors: dict[str, torch.Tensor], scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, weight) pairs with ``scale * B @ A`` added to each adapted projection's weight
    (computed in fp32, returned in the weight's dtype); other tensors pass through."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        factors.setdefault(f"{m.group(1)}.weight", {})[m.group(4)] = value
    for name, weight in weights:
        ab = factors.get(name)
        if ab is not None:
            delta = (ab["B"].float() @ ab["A"].float()) * scale
            weight = (weight.float() + delta.to(weight.device)).to(weight.dtype)
        yield name, weight
