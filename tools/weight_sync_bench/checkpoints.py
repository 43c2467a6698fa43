"""Random Hugging Face checkpoints for the weight-sync benchmark (``tools/bench_weight_sync.py``)
and the sync-memory test (``tests/weights/test_sync_memory.py``, through that script): a Llama
(``write_random_checkpoint``) or a Qwen3-MoE (``write_random_moe_checkpoint``) of any size,
written one tensor at a time, shard by shard, so a 2 GB model needs about one shard of memory;
their sizes (``numel``, ``arch_params``, ``model_summary``) and the dense FFN width that matches
a MoE's parameter count (``dense_ffn_for_params``).

Boundaries: files and sizes; syncing them is ``engines.py``'s, measuring it ``measuring.py``'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

DTYPES = ("float32", "bfloat16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def write_random_checkpoint(
    out_dir: str | Path,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    dtype: str = "float32",
    seed: int = 0,
    shard_bytes: int = 2**30,
) -> Path:
    """A random Llama checkpoint (safetensors shards of ≤ ``shard_bytes``) plus the tiny tokenizer.

    Tensors are drawn one at a time and written shard by shard, so building a
    2 GB model needs about one shard of memory, not a transformers model in
    memory plus its state dict.
    """
    tokenizer = _tokenizer(vocab)
    sizes = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab)
    config = llama_config(**sizes, dtype=dtype, tokenizer=tokenizer)
    return _write_random_tensors(out_dir, config, tokenizer, dtype, seed, shard_bytes)


def write_random_moe_checkpoint(
    out_dir: str | Path,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    experts: int,
    top_k: int,
    expert_ffn: int,
    vocab: int,
    dtype: str = "float32",
    seed: int = 0,
    shard_bytes: int = 2**30,
) -> Path:
    """A random Qwen3-MoE checkpoint (every layer sparse, one tensor per expert as the hub's are),
    written like ``write_random_checkpoint``: one tensor at a time, shard by shard.

    ``models.tiny.make_tiny_moe_model`` builds the same family through a transformers model in
    memory; at ~500M parameters that costs several copies of the model, and its vocabulary is the
    tokenizer's, so the benchmark writes its own.
    """
    import transformers

    tokenizer = _tokenizer(vocab)
    config = transformers.Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        intermediate_size=expert_ffn * experts,
        moe_intermediate_size=expert_ffn,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        **_common_config(
            tokenizer, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab
        ),
        torch_dtype=dtype,
    )
    return _write_random_tensors(out_dir, config, tokenizer, dtype, seed, shard_bytes)


def llama_config(
    *, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, dtype: str, tokenizer=None
):
    """The transformers config of ``write_random_checkpoint``'s Llama (untied head, head_dim = hidden / heads)."""
    import transformers

    tokenizer = tokenizer or _tokenizer(vocab)
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        intermediate_size=ffn,
        **_common_config(
            tokenizer, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab
        ),
        torch_dtype=dtype,
    )


def _common_config(tokenizer, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int) -> dict:
    """The config keys the Llama and the Qwen3-MoE share: their sizes (head_dim = hidden / heads), an
    untied head, the tokenizer's special ids."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _tokenizer(vocab: int):
    """The tiny tokenizer, checking that ``vocab`` has room for its tokens."""
    from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    if vocab < len(tokenizer):
        raise ValueError(f"--vocab {vocab} is smaller than the tiny tokenizer's {len(tokenizer)} tokens")
    return tokenizer


def _write_random_tensors(
    out_dir: str | Path, config, tokenizer, dtype: str, seed: int, shard_bytes: int
) -> Path:
    """Save ``config``, ``tokenizer`` and N(0, 0.02) tensors (norms: 1) of every HF tensor ``config`` implies."""
    import torch
    from safetensors.torch import save_file

    from rlhf_megatron.models.spec import expected_hf_shapes
    from rlhf_megatron.planning.model_arch import ModelArch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    torch_dtype = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shapes = expected_hf_shapes(ModelArch.from_hf_config(config.to_dict()))
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize * numel(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = [
        "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        for i in range(len(shards))
    ]
    gen = torch.Generator().manual_seed(seed)
    for names, file in zip(shards, files):
        tensors = {}
        for name in names:
            t = torch.empty(shapes[name], dtype=torch.float32)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)  # small init keeps the logits well-conditioned
            tensors[name] = t.to(torch_dtype)
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(itemsize * numel(s) for s in shapes.values())},
            "weight_map": {n: f for names, f in zip(shards, files) for n in names},
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out_dir


def numel(shape: Iterable[int]) -> int:
    """Elements in a tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n


def arch_params(arch) -> int:
    """Parameters of ``arch``'s HF checkpoint (every tensor ``expected_hf_shapes`` lists)."""
    from rlhf_megatron.models.spec import expected_hf_shapes

    return sum(numel(s) for s in expected_hf_shapes(arch).values())


def dense_ffn_for_params(
    params: int, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int
) -> int:
    """The FFN width (a multiple of 16) that gives ``write_random_checkpoint``'s Llama of these sizes
    about ``params`` parameters: the MoE's experts and routers become one dense MLP per layer."""
    from rlhf_megatron.planning.model_arch import ModelArch

    sizes = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab, dtype="float32")
    base = arch_params(ModelArch.from_hf_config(llama_config(ffn=16, **sizes).to_dict()))
    per_unit = 3 * hidden * layers  # gate, up and down rows/columns per FFN unit, over all layers
    ffn = 16 + round((params - base) / per_unit / 16) * 16
    if ffn < 16:
        raise ValueError(
            f"no dense Llama of these sizes has as few as {params} parameters "
            "(attention and embeddings alone have more)"
        )
    return ffn


def model_summary(model_dir: Path, dtype: str, build_s: float) -> dict:
    """Sizes of the checkpoint in ``model_dir`` for the JSON (``bytes``: in ``dtype``)."""
    from rlhf_megatron.planning.model_arch import ModelArch

    arch = ModelArch.from_hf_dir(model_dir)
    params = arch_params(arch)
    out = {
        "architecture": arch.architecture,
        "params": params,
        "bytes": params * DTYPE_BYTES[dtype],
        "dtype": dtype,
        "layers": arch.num_layers,
        "hidden": arch.hidden_size,
        "heads": arch.num_attention_heads,
        "kv_heads": arch.num_kv_heads,
        "ffn": arch.ffn_hidden_size,
        "vocab": arch.vocab_size,
    }
    if arch.moe is not None:
        per_expert = 3 * arch.hidden_size * arch.moe.ffn_hidden_size
        expert_params = per_expert * arch.moe.num_experts * len(arch.moe.moe_layers)
        del out["ffn"]
        out.update(
            experts=arch.moe.num_experts,
            top_k=arch.moe.top_k,
            expert_ffn=arch.moe.ffn_hidden_size,
            expert_params=expert_params,
            active_params=params - expert_params + expert_params * arch.moe.top_k // arch.moe.num_experts,
        )
    out["build_s"] = round(build_s, 2)
    return out
