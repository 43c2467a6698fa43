"""Tiny random HF checkpoints (no hub) and HF reference outputs for the models tests.

Sizes keep multi-process tests fast on 2 cores while staying valid for vLLM's
CPU attention (head_dim >= 32). Weights are re-drawn with a larger spread
than HF's init (and norms away from 1), so a transposed or swapped tensor
changes the logits visibly.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300  # pads to 384 at TP=1 and 512 at TP=2: exercises padding and resharding

_BASE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=16384,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES = {
    # Llama 3.1-style RoPE scaling (factor 8, low 1, high 4, original 8192).
    "llama": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen2": dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}
    ),
    # head_dim 64 != hidden / heads = 32, as in real Qwen3 configs.
    "qwen3": dict(head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mistral": dict(
        head_dim=32, sliding_window=5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    ),
}


def hf_config(family: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    return cls(**{**_BASE, **FAMILIES[family], **overrides})


def make_hf_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    config = hf_config(family, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model


def save_hf_model(model, out: Path, max_shard_size: str | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return out


def padded_batch(batch: int = 4, seq: int = 12, seed: int = 1):
    """Left-padded token batch like RL prompts: ``input_ids``, ``attention_mask`` (1 = token), ``position_ids``."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    lengths = torch.tensor([seq, seq - 3, seq - 5, 2][:batch] + [seq] * max(0, batch - 4))
    mask = (torch.arange(seq)[None] >= (seq - lengths)[:, None]).long()
    input_ids = input_ids.masked_fill(mask == 0, 0)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, mask, position_ids


@torch.no_grad()
def hf_logits(model, input_ids, mask, position_ids) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits.float()


def save_tokenizer(out: Path) -> Path:
    """A word-level tokenizer over the tiny vocabulary ("t3 t17 ..."), built in-process."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )
    fast.save_pretrained(out)
    return out
