"""Tiny random Hugging Face checkpoints for tests, benchmarks and the CPU quickstart.

No model hub is reachable from the project's machines, so every model starts
here: a transformers config with random weights (seeded), saved with
safetensors next to the in-process tokenizer from ``rlhf_megatron.data``.
head_dim defaults to 64 because vLLM's CPU attention rejects 16. Keep
``hidden_size == num_heads * head_dim`` for Qwen2: vLLM's Qwen2 ignores
``head_dim`` and derives it from the hidden size.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
}


def build_tiny_hf_model(
    arch: str = "llama",
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    ffn_hidden_size: int = 256,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 256,
    seed: int = 0,
    extra_words: tuple[str, ...] = (),
):
    """A random ``arch`` model (float32, seeded) and the tiny tokenizer, in memory: ``(model, tokenizer)``."""
    import transformers

    from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

    if arch not in ARCH_CONFIGS:
        raise ValueError(f"tiny model: arch {arch!r} is not one of {sorted(ARCH_CONFIGS)}")
    tokenizer = build_tiny_tokenizer(extra_words)
    cls_name, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, cls_name)(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=ffn_hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
        **extra,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Small random init keeps the untrained model's logits well-conditioned.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
    return model, tokenizer


def make_tiny_hf_model(
    out_dir: str | Path,
    arch: str = "llama",
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    ffn_hidden_size: int = 256,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 256,
    seed: int = 0,
    max_shard_size: str | None = None,
    extra_words: tuple[str, ...] = (),
) -> Path:
    """Write a random ``arch`` model plus the tiny tokenizer to ``out_dir``; return the path."""
    model, tokenizer = build_tiny_hf_model(
        arch=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=ffn_hidden_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        extra_words=extra_words,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(out_dir)
    return out_dir
