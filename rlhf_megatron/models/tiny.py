"""Tiny random Hugging Face checkpoints for tests, benchmarks and the CPU quickstart.

No model hub is reachable from the project's machines, so every model starts
here: a transformers config with random weights (seeded), saved with
safetensors next to the in-process tokenizer from ``rlhf_megatron.data``.
head_dim defaults to 64 because vLLM's CPU attention rejects 16. Keep
``hidden_size == num_heads * head_dim`` for Qwen2: vLLM's Qwen2 ignores
``head_dim`` and derives it from the hidden size.

``make_tiny_moe_model`` writes a tiny mixture-of-experts Qwen3-MoE, Qwen2-MoE
(shared expert, q/k/v biases), Mixtral, DeepSeek-V3 (multi-latent attention with YaRN,
group-limited sigmoid routing) or GLM-4.5 with the same tokenizer.

``make_tiny_qwen2_5_vl`` writes a tiny Qwen2.5-VL (or Qwen2-VL, Qwen3-VL, Qwen3-VL-MoE) with the
tiny VL processor (``data.tokenizer.build_tiny_vl_processor``), so
``AutoProcessor.from_pretrained`` and vLLM load the directory as they would a
released checkpoint.
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


def _text_config_kwargs(
    tokenizer, num_layers, hidden_size, num_heads, num_kv_heads, head_dim, max_position_embeddings, tie
) -> dict:
    """The transformers config fields every tiny text model shares (sizes, the tokenizer's ids)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
    )


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
    eos_logit: float = 0.0,
):
    """A random ``arch`` model (float32, seeded) and the tiny tokenizer, in memory: ``(model, tokenizer)``.

    ``eos_logit`` > 0 makes the model end its answers: the end-of-sequence token's logit sits about
    that far above the others' at every position (with the tiny tokenizer's ~110 tokens, 5 ends
    about half of the answers at each token), so
    a test whose config allows long responses does not pay for random text up to the limit. Every
    token's embedding then shares one large component (dimension 0), which the final norm keeps and
    only the EOS row of the output layer reads."""
    import transformers

    from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

    if arch not in ARCH_CONFIGS:
        raise ValueError(f"tiny model: arch {arch!r} is not one of {sorted(ARCH_CONFIGS)}")
    tokenizer = build_tiny_tokenizer(extra_words)
    cls_name, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, cls_name)(
        intermediate_size=ffn_hidden_size,
        **_text_config_kwargs(
            tokenizer,
            num_layers,
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings,
            tie_word_embeddings,
        ),
        **extra,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Small random init keeps the untrained model's logits well-conditioned.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
        if eos_logit:
            _favour_eos(model, tokenizer.eos_token_id, eos_logit)
    return model, tokenizer


def _favour_eos(model, eos_id: int, logit: float) -> None:
    """See ``build_tiny_hf_model(eos_logit=...)``. The shared component (10, against a few tenths
    from each random dimension) dominates the final RMS norm; the EOS row's weight on it is set
    from the normed value measured on a random batch, so its logit lands ``logit`` above the rest."""
    if model.config.tie_word_embeddings:
        raise ValueError("tiny model: eos_logit needs untied embeddings (tie_word_embeddings=False)")
    model.get_input_embeddings().weight[:, 0] = 10.0
    head = model.get_output_embeddings().weight
    head[:, 0] = 0.0
    probe = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    normed = model(probe, output_hidden_states=True).hidden_states[-1][..., 0]
    head[eos_id, 0] = logit / float(normed.mean())


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
    eos_logit: float = 0.0,
) -> Path:
    """Write a random ``arch`` model plus the tiny tokenizer to ``out_dir``; return the path.
    ``eos_logit``: see ``build_tiny_hf_model``."""
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
        eos_logit=eos_logit,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(out_dir)
    return out_dir


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe")

TINY_MLA = dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
"""The tiny DeepSeek-V3's multi-latent attention (TP 2 splits its latents and heads)."""
VLLM_CPU_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64)
"""What ``build_tiny_moe_model(mla=...)`` changes in ``TINY_MLA`` for a model vLLM runs on CPU: its
MLA backend (``cpu_mla.py``) takes only a latent of 512 plus a rotary key of 64 (DeepSeek-V3's)."""
TINY_YARN = dict(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def _deepseek_moe_config(
    family, common, num_experts, expert_ffn_hidden_size, ffn_hidden_size, mlp_only_layers, groups, mla
):
    """DeepSeek-V3 (MLA of ``TINY_MLA`` updated by ``mla``, with YaRN; ``groups`` = (n_group,
    topk_group)) or GLM-4.5 (q/k/v biases, q/k norms, half-rotary heads): sigmoid router with
    correction bias, one shared expert, the leading ``len(mlp_only_layers)`` layers dense. No
    next-token-prediction layers."""
    import transformers

    if tuple(mlp_only_layers) != tuple(range(len(mlp_only_layers))):
        raise ValueError(f"tiny {family}: only the leading layers can be dense, got {mlp_only_layers}")
    n_group, topk_group = groups
    moe = dict(
        n_routed_experts=num_experts,
        n_shared_experts=1,
        moe_intermediate_size=expert_ffn_hidden_size,
        intermediate_size=ffn_hidden_size,
        first_k_dense_replace=len(mlp_only_layers),
        norm_topk_prob=True,
        n_group=n_group,
        topk_group=topk_group,
        num_nextn_predict_layers=0,
    )
    common = {k: v for k, v in common.items() if k != "router_aux_loss_coef"}
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            routed_scaling_factor=1.0,
            **moe,
            **common,
        )
    common.pop("head_dim")
    common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: one key/value per head
    # The router fields DeepSeek-V3's and Kimi-K2's own config.json carry: transformers hard-codes
    # them, vLLM reads them (without ``topk_method`` it builds no correction bias).
    return transformers.DeepseekV3Config(
        **{**TINY_MLA, **(mla or {})},
        rope_scaling=dict(TINY_YARN),
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        **moe,
        **common,
    )


def build_tiny_moe_model(
    family: str = "qwen3_moe",
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    num_experts: int = 4,
    top_k: int = 2,
    expert_ffn_hidden_size: int = 64,
    ffn_hidden_size: int = 256,
    shared_expert_ffn_hidden_size: int = 96,
    mlp_only_layers: tuple[int, ...] = (),
    norm_topk_prob: bool | None = None,
    router_aux_loss_coef: float = 0.01,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 256,
    seed: int = 0,
    groups: tuple[int, int] = (1, 1),
    mla: dict | None = None,
):
    """A random mixture-of-experts model (float32, seeded) and the tiny tokenizer: ``(model, tokenizer)``.

    ``family``: ``qwen3_moe`` (q/k norms; ``norm_topk_prob`` defaults to True, as Qwen3-30B-A3B
    ships), ``qwen2_moe`` (q/k/v biases and a gated shared expert of
    ``shared_expert_ffn_hidden_size``; ``norm_topk_prob`` defaults to False, as Qwen1.5-MoE ships) or
    ``mixtral`` (experts of ``expert_ffn_hidden_size``; always renormalises), ``deepseek_v3`` or
    ``glm4_moe`` (see ``_deepseek_moe_config``; ``groups``: DeepSeek's (n_group, topk_group);
    ``mla``: DeepSeek-V3's attention sizes over ``TINY_MLA``, e.g. ``VLLM_CPU_MLA`` for vLLM on CPU).
    ``mlp_only_layers`` keeps those layers dense (``ffn_hidden_size``; Qwen families, and the leading
    layers of DeepSeek/GLM). Router weights are drawn wider than the rest so the top-k choice is not
    decided by rounding; DeepSeek/GLM's score-correction bias is random too.
    """
    import transformers

    from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

    if family not in MOE_FAMILIES:
        raise ValueError(f"tiny MoE model: family {family!r} is not one of {MOE_FAMILIES}")
    if mlp_only_layers and family == "mixtral":
        raise ValueError("tiny MoE model: Mixtral has no dense layers (mlp_only_layers must be empty)")
    tokenizer = build_tiny_tokenizer()
    common = dict(
        _text_config_kwargs(
            tokenizer,
            num_layers,
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings,
            tie_word_embeddings,
        ),
        num_experts_per_tok=top_k,
        router_aux_loss_coef=router_aux_loss_coef,
    )
    if family in ("deepseek_v3", "glm4_moe"):
        if mla and family != "deepseek_v3":
            raise ValueError(f"tiny MoE model: mla={mla} is for deepseek_v3 only, not {family}")
        config = _deepseek_moe_config(
            family, common, num_experts, expert_ffn_hidden_size, ffn_hidden_size, mlp_only_layers, groups, mla
        )
    elif family == "mixtral":
        config = transformers.MixtralConfig(
            intermediate_size=expert_ffn_hidden_size, num_local_experts=num_experts, **common
        )
    else:
        qwen = dict(
            num_experts=num_experts,
            moe_intermediate_size=expert_ffn_hidden_size,
            intermediate_size=ffn_hidden_size,
            mlp_only_layers=list(mlp_only_layers),
            norm_topk_prob=(family == "qwen3_moe") if norm_topk_prob is None else norm_topk_prob,
        )
        if family == "qwen2_moe":
            config = transformers.Qwen2MoeConfig(
                shared_expert_intermediate_size=shared_expert_ffn_hidden_size, **qwen, **common
            )
        else:
            config = transformers.Qwen3MoeConfig(**qwen, **common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                std = 0.5 if name.endswith("gate.weight") and "shared" not in name else 0.05
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model, tokenizer


def make_tiny_moe_model(out_dir: str | Path, family: str = "qwen3_moe", **sizes) -> Path:
    """Write a random tiny mixture-of-experts model plus the tiny tokenizer to ``out_dir``.

    ``sizes`` are ``build_tiny_moe_model``'s (e.g. ``num_experts=8``, ``mlp_only_layers=(1,)``).
    The checkpoint keeps one tensor per expert, as the hub's do.
    """
    model, tokenizer = build_tiny_moe_model(family=family, **sizes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_vllm_ready_moe_model(out_dir: str | Path, family: str, **overrides) -> Path:
    """``make_tiny_moe_model`` of a GLM-4.5 or DeepSeek-V3 that vLLM runs on CPU and TP 2 splits:
    hidden 256 in 4 heads with 2 KV heads, layer 0 dense, top-k within the best of 2 groups, and
    for DeepSeek-V3 the MLA sizes vLLM's CPU backend takes (``VLLM_CPU_MLA``)."""
    sizes = dict(
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        mlp_only_layers=(0,),
        groups=(2, 1),
        mla=VLLM_CPU_MLA if family == "deepseek_v3" else None,
    )
    return make_tiny_moe_model(out_dir, family, **{**sizes, **overrides})


TINY_VL_FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe")


def build_tiny_qwen2_5_vl(
    family: str = "qwen2_5_vl",
    num_layers: int = 2,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    ffn_hidden_size: int = 512,
    mrope_section: tuple[int, int, int] = (8, 12, 12),
    vision_depth: int = 2,
    vision_hidden_size: int = 128,
    vision_heads: int = 4,
    vision_intermediate_size: int | None = None,
    window_size: int = 56,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    num_experts: int = 4,
    top_k: int = 2,
    expert_ffn_hidden_size: int = 64,
):
    """A random Qwen2.5-VL (``family="qwen2_vl"``: Qwen2-VL; ``"qwen3_vl"``: Qwen3-VL;
    ``"qwen3_vl_moe"``: Qwen3-VL-MoE) and the tiny VL processor: ``(model, processor)``.

    Qwen3-VL: 16-pixel patches, a 4 x 4 grid of learned positions, LayerNorm blocks with a
    tanh-GELU MLP, DeepStack after vision blocks 0 and ``vision_depth - 1`` (two levels, so the
    language model needs at least 2 layers on its first pipeline stage), Qwen3's q/k norms and
    interleaved M-RoPE, ``head_dim`` given apart from hidden / heads. Qwen3-VL-MoE: the same with
    every decoder layer sparse, ``num_experts`` experts of ``expert_ffn_hidden_size`` (64: not square
    against the hidden size, see ``ModelArch``), ``top_k`` per token, router weights drawn wider
    (N(0, 0.5)) so rounding never decides the top-k.

    Defaults: vision depth 2 (block 0 windowed over 2 x 2 merged tokens, block 1 full
    attention), width 128 in 4 heads of 32, MLP 252 (not a multiple of 8: megatron pads it;
    Qwen2-VL: 2 x width, its config takes an integer ``mlp_ratio``);
    a 256-wide language model of 4 heads of 64 with 2 KV heads, M-RoPE sections summing to
    head_dim / 2. Weights are drawn N(0, 0.05), norm weights around 1 (seeded).
    """
    import transformers

    from rlhf_megatron.data.tokenizer import build_tiny_vl_processor

    if family not in TINY_VL_FAMILIES:
        raise ValueError(f"tiny vision-language model: family {family!r} is not one of {TINY_VL_FAMILIES}")
    qwen3 = family in ("qwen3_vl", "qwen3_vl_moe")
    processor = build_tiny_vl_processor(family="qwen3_vl") if qwen3 else build_tiny_vl_processor()
    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in _VL_TOKENS.items()}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=ffn_hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": list(mrope_section),
        },
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    image = processor.image_processor
    vision = dict(
        depth=vision_depth,
        num_heads=vision_heads,
        patch_size=image.patch_size,
        temporal_patch_size=image.temporal_patch_size,
        spatial_merge_size=image.merge_size,
    )
    if qwen3:
        text["head_dim"] = hidden_size // num_heads
        # What Qwen's released configs say; vLLM reads it (transformers interleaves regardless).
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(
            hidden_size=vision_hidden_size,
            intermediate_size=vision_intermediate_size or 252,
            out_hidden_size=hidden_size,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, vision_depth - 1],
        )
        config_cls, model_cls = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
        if family == "qwen3_vl_moe":
            text.update(
                num_experts=num_experts,
                num_experts_per_tok=top_k,
                moe_intermediate_size=expert_ffn_hidden_size,
                norm_topk_prob=True,  # what transformers does anyway; vLLM reads the key
                router_aux_loss_coef=0.01,
            )
            config_cls = transformers.Qwen3VLMoeConfig
            model_cls = transformers.Qwen3VLMoeForConditionalGeneration
    elif family == "qwen2_5_vl":
        vision.update(
            hidden_size=vision_hidden_size,
            intermediate_size=vision_intermediate_size or 252,
            out_hidden_size=hidden_size,
            window_size=window_size,
            fullatt_block_indexes=[vision_depth - 1],
        )
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    else:
        # Qwen2-VL: width embed_dim, MLP embed_dim x mlp_ratio, output hidden_size.
        ratio, rest = divmod(vision_intermediate_size or 2 * vision_hidden_size, vision_hidden_size)
        if rest:
            raise ValueError(f"Qwen2-VL: vision_intermediate_size must be a multiple of {vision_hidden_size}")
        vision.update(embed_dim=vision_hidden_size, mlp_ratio=ratio, hidden_size=hidden_size)
        config_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    config = config_cls(
        text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings, **ids
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:  # Qwen3-VL's merger norms are "norm" too
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                std = 0.5 if name.endswith("mlp.gate.weight") else 0.05  # a router: see the docstring
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model, processor


_VL_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def make_tiny_qwen2_5_vl(out_dir: str | Path, family: str = "qwen2_5_vl", seed: int = 0, **sizes) -> Path:
    """Write a random tiny Qwen2.5-VL (or Qwen2-VL, Qwen3-VL, Qwen3-VL-MoE) plus its processor and
    tokenizer to ``out_dir``.

    ``sizes`` are ``build_tiny_qwen2_5_vl``'s (e.g. ``tie_word_embeddings=True``). Qwen3-VL-MoE's
    stacked experts are stored as the hub stores them, ``[E, hidden, 2 x width]`` and
    ``[E, width, hidden]``: transformers 5's ``save_pretrained`` writes them transposed, which
    transformers reads either way but vLLM (which always transposes) does not.
    """
    model, processor = build_tiny_qwen2_5_vl(family=family, seed=seed, **sizes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    if family == "qwen3_vl_moe":
        _stack_experts_as_the_hub(out_dir)
    return out_dir


def _stack_experts_as_the_hub(out_dir: Path) -> None:
    """Transpose the stacked expert tensors of ``save_pretrained``'s single file to the hub's layout."""
    from safetensors.torch import load_file, save_file

    path = out_dir / "model.safetensors"
    state = load_file(str(path))
    for name in state:
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            state[name] = state[name].transpose(1, 2).contiguous()
    save_file(state, str(path), metadata={"format": "pt"})
