"""Which projections a LoRA configuration adapts, and whether an adapter file fits the model.

Role: ``resolve_targets`` turns ``target_modules`` / ``exclude_modules`` and the architecture into
the adapted projections (global layer -> megatron linear -> HF parts); ``read_peft_adapter_config``
reads a PEFT adapter directory's settings and checks its tensors' names and shapes against the
architecture from the safetensors header. Validation and the memory planner use them before any
process starts; ``models.lora`` (the adapter modules) and ``models.lora_io`` (the tensors) build
on them.

Boundaries: config and architecture only: no torch, no model.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from rlhf_megatron.config.schema_model import LORA_MODULES, LoraConfig
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "COLUMN",
    "FUSED",
    "KEY_PATTERN",
    "MLP_PARTS",
    "LoraTargetError",
    "hf_module_name",
    "module_order",
    "read_peft_adapter_config",
    "resolve_targets",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PATTERN = re.compile(
    r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.default)?\.weight$"
)
"""A PEFT key of a decoder layer's projection: (module, layer, part, factor)."""

FUSED: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
"""Megatron linear (under a decoder layer) -> the HF projections it fuses, in its row order."""
COLUMN = ("self_attention.linear_qkv", "mlp.linear_fc1")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
_HF_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


class LoraTargetError(ValueError):
    """``target_modules`` / ``exclude_modules`` / an adapter file that does not fit the model."""


def hf_module_name(layer: int, part: str) -> str:
    """The HF (and PEFT, and vLLM) name of decoder layer ``layer``'s projection ``part``."""
    return f"model.layers.{layer}.{_HF_BLOCK.get(part, 'mlp')}.{part}"


def _matches(spec: tuple[str, ...] | str, full: str) -> bool:
    if isinstance(spec, str):
        return spec != "all-linear" and re.fullmatch(spec, full) is not None
    return any(full == name or full.endswith("." + name) for name in spec)


def resolve_targets(
    arch: ModelArch, lora: LoraConfig, key: str = "actor_rollout_ref.model"
) -> dict[int, dict[str, tuple[str, ...]]]:
    """The adapted projections: global layer -> megatron linear -> its HF parts that get adapters.

    Raises ``LoraTargetError`` naming ``key``'s entry for a module this model does not have, an
    expert projection of a mixture-of-experts layer, or a selection that leaves nothing."""
    if arch.vision is not None:
        raise LoraTargetError(
            f"{key}.lora_rank={lora.rank}: LoRA on vision-language models ({arch.architecture}) is not "
            "supported yet; train it in full (lora_rank=0)"
        )
    targets = lora.target_modules
    every = targets == "all-linear"
    if isinstance(targets, tuple):
        unknown = [t for t in targets if t.split(".")[-1] not in LORA_MODULES]
        if unknown:
            raise LoraTargetError(
                f"{key}.target_modules names {unknown}, which {arch.architecture} does not have as a "
                f"linear layer LoRA can adapt; use all-linear or names from {list(LORA_MODULES)}"
            )
    out: dict[int, dict[str, tuple[str, ...]]] = {}
    experts_asked: list[str] = []
    for layer in range(arch.num_layers):
        sparse = arch.is_moe_layer(layer)
        for linear, parts in FUSED.items():
            chosen = []
            for part in parts:
                full = hf_module_name(layer, part)
                if not (every or _matches(targets, full)) or _matches(lora.exclude_modules, full):
                    continue
                if sparse and part in MLP_PARTS:
                    if not every:
                        experts_asked.append(full)
                    continue
                chosen.append(part)
            if chosen:
                out.setdefault(layer, {})[linear] = tuple(chosen)
    if experts_asked:
        raise LoraTargetError(
            f"{key}.target_modules selects {experts_asked[0]} (and {len(experts_asked) - 1} more), the "
            "experts of a mixture-of-experts layer; LoRA on experts is not supported. Target the "
            "attention (q_proj, k_proj, v_proj, o_proj), or all-linear (attention and dense MLP layers)"
        )
    if not out:
        raise LoraTargetError(
            f"{key}.target_modules={_show(targets)} with exclude_modules={_show(lora.exclude_modules)} selects "
            f"no linear layer of {arch.architecture}; its adaptable modules are {list(LORA_MODULES)}"
        )
    return out


def _show(spec) -> str:
    return repr(spec) if isinstance(spec, str) else str(list(spec))


def module_order(name: str) -> tuple[int, int]:
    layer, part = re.match(r"model\.layers\.(\d+)\..*\.(\w+)$", name).groups()
    return int(layer), LORA_MODULES.index(part)


def read_peft_adapter_config(path: str | Path, arch: ModelArch) -> tuple[LoraConfig, dict[str, str]]:
    """A PEFT adapter directory's settings (as a ``LoraConfig`` whose ``target_modules`` are the
    modules it holds) and each tensor's canonical PEFT key by its key in the file, checked against
    ``arch`` from the safetensors header (names and shapes; no tensor is loaded)."""
    from safetensors import safe_open

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
    keys: dict[str, str] = {}
    modules: list[str] = []
    with safe_open(str(weights_file), framework="numpy") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    for key, shape in shapes.items():
        m = KEY_PATTERN.match(key)
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
        _check_shape(weights_file, key, shape, arch, part, factor, rank)
        keys[key] = f"base_model.model.{module}.lora_{factor}.weight"
        modules.append(module)
    lora = LoraConfig(
        rank=rank,
        alpha=float(alpha),
        target_modules=tuple(sorted(set(modules), key=module_order)),
        adapter_path=str(root),
    )
    return lora, keys


def _check_shape(
    file: Path, key: str, shape: tuple[int, ...], arch: ModelArch, part: str, factor: str, rank: int
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
    if tuple(shape) != want:
        raise LoraTargetError(
            f"{file}: {key} has shape {list(shape)}, but {arch.architecture} (hidden {arch.hidden_size}, "
            f"ffn {arch.ffn_hidden_size}) with r={rank} needs {list(want)}: the adapter's base model does "
            "not match this model"
        )
