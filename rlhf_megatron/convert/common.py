"""What both directions of the conversion share: the error, the dtypes, the output directory's
temporary-then-rename handling, and the HF ``config.json`` written beside exported weights.

Boundaries: no model is built here; ``checkpoint.py`` and ``lora.py`` use these.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from rlhf_megatron.planning.model_arch import ModelArch

__all__ = [
    "DTYPES",
    "DTYPE_FLAGS",
    "ConversionError",
    "hf_config",
    "prepare_out",
    "publish",
    "write_hf_config",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


DTYPE_FLAGS = {v: k for k, v in DTYPES.items()}


class ConversionError(ValueError):
    """The conversion cannot proceed; the message says what to change."""


def prepare_out(out: Path, force: bool) -> Path:
    """Fail early on an existing ``out``; return a fresh temporary directory beside it."""
    if out.exists() and not force:
        raise ConversionError(f"{out} already exists; pass --force to replace it")
    tmp = out.parent / f".{out.name}.converting"
    if tmp.exists():  # left by an interrupted run (the name is ours)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, out: Path, force: bool) -> None:
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


def hf_config(arch: ModelArch, source_config: Path | None, dtype: torch.dtype) -> dict:
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
            **({"mrope_interleaved": True} if arch.mrope_interleaved else {}),
        },
    )
    if arch.model_type in ("qwen3_vl", "qwen3_vl_moe"):
        text.update(head_dim=arch.head_dim, hidden_act="silu")
    if arch.model_type == "qwen3_vl_moe":  # norm_topk_prob: what transformers does, for vLLM
        text.update(_moe_arch_to_hf_fields(arch))
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
    elif arch.model_type in ("qwen3_vl", "qwen3_vl_moe"):
        vision.update(
            hidden_size=v.hidden_size,
            intermediate_size=v.intermediate_size,
            out_hidden_size=v.out_hidden_size,
            hidden_act="gelu_pytorch_tanh",
            num_position_embeddings=v.num_position_embeddings,
            deepstack_visual_indexes=list(v.deepstack_visual_indexes),
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


def write_hf_config(out_dir: Path, config: dict, arch: ModelArch) -> None:
    """``config.json``, and a ``generation_config.json`` derived from it if none was copied."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (out_dir / "generation_config.json").exists() and arch.head == "lm":
        from transformers import GenerationConfig, PretrainedConfig

        # A transformers-5 vision-language config nests the language model's token ids.
        text = config.get("text_config") or config
        text = {k: v for k, v in text.items() if k not in ("text_config", "vision_config")}
        GenerationConfig.from_model_config(PretrainedConfig(**text)).save_pretrained(out_dir)
