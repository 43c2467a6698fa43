"""Build megatron-core ``GPTModel`` chunks from a ``ModelArch``.

``build_gpt_model(arch, parallel)`` returns this rank's model chunks: one per
virtual pipeline stage (a single chunk without VPP). Every chunk of a text
model is a megatron-core ``GPTModel`` (``gpt.GPTModelWithPositions``: its RoPE follows
``position_ids``, as HF's and vLLM's do); a vision-language model's chunk is
a ``VisionLanguageModel`` around such a ``GPTModel`` (M-RoPE), holding the
vision tower on the first chunk of the first stage. A mixture-of-experts model's
``GPTModel`` has megatron MoE layers (router, experts split over expert
parallelism, see ``moe.py``) where its HF config has sparse layers. Either way megatron's DDP,
optimizers, schedules and distributed checkpointing apply unchanged. Layer
implementations are chosen here (and, for the tower, in ``vision.py``):
transformer-engine modules on GPU, megatron's local (pure PyTorch) modules on CPU, whose
norms ``norms.py`` makes sequence-parallel.

The caller sets up parallelism first (``platform.init_model_parallel``) and
passes the same sizes in ``ParallelConfig``; the builder checks they agree, so
a model is never silently built for another layout. Weights are random (or
left uninitialised with ``init_weights=False``); ``loader.load_hf_weights``
fills them from an HF checkpoint.
"""

from __future__ import annotations

import copy
import functools
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention

from rlhf_megatron.models.attention import LatentDotProductAttention, LatentSDPAttention, SDPAttention
from rlhf_megatron.models.causal_rows import CAUSAL_ROWS_ATTR
from rlhf_megatron.models.gpt import GPTModelWithPositions, interleave_mrope
from rlhf_megatron.models.heads import attach_scalar_head
from rlhf_megatron.models.latent_tp import sum_rotary_key_gradients
from rlhf_megatron.models.moe import (
    enable_moe_without_te,
    fix_expert_bias_padding_mask,
    moe_block_spec,
    moe_config_kwargs,
)
from rlhf_megatron.models.norms import swap_module, with_sequence_parallel_norms
from rlhf_megatron.models.parallel_config import ParallelConfig
from rlhf_megatron.models.vision import VisionTransformer, vision_transformer_config
from rlhf_megatron.models.vision_language import VisionLanguageModel
from rlhf_megatron.models.vision_language import freeze_vision_tower as freeze_vision
from rlhf_megatron.planning.model_arch import ModelArch
from rlhf_megatron.platform import is_cuda

__all__ = [
    "CAUSAL_ROWS_FROM",
    "ParallelConfig",
    "build_gpt_model",
    "build_transformer_config",
    "mark_tensor_parallel_weights",
    "use_transformer_engine",
]


CAUSAL_ROWS_FROM = 8192
"""Micro-batch size (tokens: rows x columns) from which sdpa attention on CUDA takes contiguous rows
without a mask (``models.causal_rows``; measured on an H200)."""


def use_transformer_engine() -> bool:
    """Transformer-engine layers on GPU where it is installed (the GPU image has it); megatron's
    local layers on CPU, and on a GPU without transformer-engine (then attention is megatron's
    unfused local one, which keeps the softmax of every layer for backward: see the planner)."""
    return is_cuda() and transformer_engine_installed()


@functools.cache
def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _check_parallel(arch: ModelArch, parallel: ParallelConfig, use_te: bool) -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "build_gpt_model: megatron's parallel state is not initialised; call "
            "rlhf_megatron.platform.init_model_parallel(tp, pp, vpp, cp, ep, etp) first"
        )
    current = ParallelConfig.current(parallel.sequence_parallel)
    if current != parallel:
        raise ValueError(
            f"build_gpt_model: asked for {parallel} but megatron's parallel state is {current}; "
            "pass the sizes given to init_model_parallel"
        )
    tp, pp, vpp = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_model_parallel_size,
    )
    for what, n in (
        ("num_attention_heads", arch.num_attention_heads),
        ("num_key_value_heads", arch.num_kv_heads),
        # MLA's down-projections are column-parallel in the local spec (gathered after).
        *(
            [
                ("q_lora_rank", arch.mla.q_lora_rank or 0),
                ("kv_lora_rank + qk_rope_head_dim", arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim),
            ]
            if arch.mla is not None and not use_te
            else []
        ),
    ):
        if n % tp:
            raise ValueError(f"{arch.architecture}: {what} ({n}) is not divisible by TP size {tp}")
    has_dense_mlp = arch.moe is None or len(arch.moe.moe_layers) < arch.num_layers
    if has_dense_mlp and arch.ffn_hidden_size % tp:
        raise ValueError(
            f"{arch.architecture}: intermediate_size ({arch.ffn_hidden_size}) is not divisible by TP {tp}"
        )
    _check_experts(arch, parallel)
    if arch.vision is not None and arch.vision.num_heads % tp:
        raise ValueError(
            f"{arch.architecture}: vision_config.num_heads ({arch.vision.num_heads}) is not divisible by TP {tp}"
        )
    if arch.vision is not None and parallel.context_parallel_size > 1:
        raise ValueError(
            f"{arch.architecture}: context parallelism is not supported for vision-language models "
            "(the image embeddings go in before the sequence is split); use context_parallel_size=1"
        )
    if vpp is not None and pp == 1:
        raise ValueError("virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1")
    if arch.num_layers % (pp * (vpp or 1)):
        raise ValueError(
            f"{arch.architecture}: {arch.num_layers} layers do not split evenly over PP={pp} x VPP={vpp or 1}"
        )
    if not use_te and parallel.context_parallel_size > 1:
        raise ValueError("context_parallel_size > 1 needs transformer-engine attention (GPU); use 1 on CPU")


def _check_experts(arch: ModelArch, parallel: ParallelConfig) -> None:
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    moe = arch.moe
    if moe is None:
        if ep > 1:
            raise ValueError(
                f"{arch.architecture} has no experts; expert_model_parallel_size={ep} needs a "
                "mixture-of-experts model (set it to 1)"
            )
        return
    for what, n, size, key in (
        ("num_experts", moe.num_experts, ep, "expert_model_parallel_size"),
        ("moe_intermediate_size", moe.ffn_hidden_size, etp, "expert_tensor_parallel_size"),
        (
            "shared_expert_intermediate_size",
            moe.shared_expert_ffn_hidden_size or 0,
            parallel.tensor_model_parallel_size,
            "tensor_model_parallel_size",
        ),
    ):
        if n % size:
            raise ValueError(f"{arch.architecture}: {what} ({n}) is not divisible by {key}={size}")


def build_transformer_config(
    arch: ModelArch,
    parallel: ParallelConfig,
    params_dtype: torch.dtype = torch.float32,
    init_weights: bool = True,
    use_te: bool | None = None,
    **overrides,
) -> TransformerConfig:
    """The megatron ``TransformerConfig`` for ``arch`` (``overrides`` win, e.g. recompute settings,
    or ``moe_aux_loss_coeff`` in place of the HF config's ``router_aux_loss_coef``)."""
    use_te = use_transformer_engine() if use_te is None else use_te
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        # RL fine-tuning of pretrained models: no dropout, as in the HF models.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not is_cuda(),
        perform_initialization=init_weights,
    )
    if arch.mrope_section is not None:
        kwargs["mrope_section"] = list(arch.mrope_section)
    kwargs.update(
        moe_config_kwargs(
            arch, parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size, use_te
        )
    )
    if arch.mla is not None:
        kwargs.update(_mla_config_kwargs(arch))
        kwargs.update(overrides)
        return MLATransformerConfig(**kwargs)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _mla_config_kwargs(arch: ModelArch) -> dict:
    """``MLATransformerConfig`` fields: the low-rank projections and MLA's own RoPE (plain, or YaRN
    with its attention scaling). The q/kv latent norms are megatron's ``qk_layernorm`` modules."""
    mla, scaling = arch.mla, arch.rope_scaling
    kwargs = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        kv_channels=mla.q_head_dim,
        qk_layernorm=True,
        rotary_base=arch.rope_theta,
        rope_type="rope",
        # MLATransformerConfig's default 40 would scale the softmax even without YaRN.
        rotary_scaling_factor=1.0,
        apply_rope_fusion=False,
    )
    if scaling is not None:  # ModelArch admits only yarn here
        kwargs.update(
            rope_type="yarn",
            rotary_scaling_factor=scaling.factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
            mscale=scaling.mscale,
            mscale_all_dim=scaling.mscale_all_dim,
        )
    return kwargs


def _layer_spec(arch: ModelArch, use_te: bool):
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.transformer.enums import AttnMaskType

        spec = get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=arch.qk_norm or arch.mla is not None, multi_latent_attention=arch.mla is not None
        )
        # Our masks combine causality with left padding (and a sliding window),
        # which TE's "causal" type would ignore: ask TE to apply the mask as given.
        spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
        return spec
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(
        qk_layernorm=arch.qk_norm or arch.mla is not None,
        normalization="RMSNorm",
        multi_latent_attention=arch.mla is not None,
    )


def _rope_kwargs(arch: ModelArch) -> dict:
    kwargs: dict = {
        "rotary_base": int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta
    }
    if arch.rotary_percent != 1.0:  # GLM-4.5: RoPE on the first part of each head
        kwargs["rotary_percent"] = arch.rotary_percent
    scaling = arch.rope_scaling
    if scaling is None or arch.mla is not None:  # MLA applies its own RoPE (the config's)
        return kwargs
    if scaling.rope_type == "llama3":
        # megatron fixes low/high frequency factors 1/4 and original context
        # 8192; ModelArch.from_hf_config rejected any other values.
        kwargs.update(rope_scaling=True, rope_scaling_factor=scaling.factor)
    else:  # linear: positions divided by the factor
        kwargs.update(seq_len_interpolation_factor=scaling.factor)
    return kwargs


def mark_tensor_parallel_weights(module: torch.nn.Module) -> None:
    """Give every tensor-parallel weight megatron's ``tensor_model_parallel`` / ``partition_dim``
    attributes. megatron sets them only while initialising (``perform_initialization``), so a
    model built with ``init_weights=False`` to be loaded from a checkpoint would lack them, and
    megatron would then take every TP shard for a copy of one weight: the gradient norm (and
    with it clipping) would count only TP rank 0's shards."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(m, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(m, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def build_gpt_model(
    arch: ModelArch,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    init_weights: bool = True,
    use_te: bool | None = None,
    head_seed: int = 0,
    freeze_vision_tower: bool = False,
    attention_backend: str = "local",
    causal_rows: int | str | None = "auto",
    fuse_swiglu: bool = False,
    **config_overrides,
) -> list[GPTModel | VisionLanguageModel]:
    """This rank's model chunks (one per virtual pipeline stage), built for ``arch.head``.

    ``init_weights=False`` skips megatron's random initialisation (parameters
    are allocated but left as is) for models whose weights are loaded next.
    ``head_seed`` seeds the critic/reward head (and a vision tower's replicated
    patch embedding) so it is identical on all ranks. ``freeze_vision_tower``:
    the vision tower's parameters get no gradients (see
    ``vision_language.freeze_vision_tower``). ``config_overrides`` go to
    ``TransformerConfig``, e.g. ``moe_aux_loss_coeff=0.01`` (instead of the HF config's
    ``router_aux_loss_coef``) or ``moe_enable_routing_replay=True``. ``attention_backend``: the
    local layers' core attention, megatron's unfused ``local`` one or ``sdpa`` (torch's fused
    ``scaled_dot_product_attention``, ``models.attention``) or ``auto`` (sdpa for local layers
    on CUDA, else local); transformer-engine layers bring their own.

    ``causal_rows``: sdpa attention takes contiguous rows without a mask (``models.causal_rows``:
    the causal kernel, 2.6x faster than the masked one at 2K tokens on an H200) in micro-batches
    of at least this many tokens (rows x columns; 0: all); None: never; ``auto``: from
    ``CAUSAL_ROWS_FROM`` tokens on CUDA, never on CPU (its host sync outweighs the gain in smaller
    micro-batches).
    ``fuse_swiglu``: SwiGLU through megatron's ``torch.compile``d kernel
    (``bias_activation_fusion``): on an H200 2 GiB less memory at the 1.24B model's 2K-token
    update, no faster (``tools/gpu/mfu.py``), so off unless asked for.
    """
    use_te = use_transformer_engine() if use_te is None else use_te
    if attention_backend == "auto":
        attention_backend = "sdpa" if is_cuda() and not use_te else "local"
    if use_te and attention_backend != "local":
        raise ValueError(
            f"megatron.attention_backend={attention_backend} replaces the local layers' attention, but this "
            "role is built with transformer-engine layers (megatron.transformer_impl=transformer_engine, or "
            "auto on a GPU with transformer-engine), which use TE's own attention; set the role's "
            "megatron.transformer_impl=local, or megatron.attention_backend=local"
        )
    if use_te and not transformer_engine_installed():
        raise ValueError(
            "megatron.transformer_impl=transformer_engine, but transformer_engine is not installed in this "
            "environment; install it (the GPU image has it) or set the role's megatron.transformer_impl=local"
        )
    _check_parallel(arch, parallel, use_te)
    if arch.mla is not None and use_te:
        raise ValueError(
            f"{arch.architecture}: multi-latent attention is built with megatron's local layers only (the "
            "HF⇄mcore spec follows the local spec's column-parallel down-projections); set the role's "
            "megatron.transformer_impl=local"
        )
    if causal_rows == "auto":
        causal_rows = CAUSAL_ROWS_FROM if is_cuda() else None
    if fuse_swiglu:
        config_overrides = {"bias_activation_fusion": True, **config_overrides}
    config = build_transformer_config(arch, parallel, params_dtype, init_weights, use_te, **config_overrides)
    spec = _layer_spec(arch, use_te)
    if arch.moe is not None and not use_te:
        enable_moe_without_te()
    if arch.moe is not None and arch.moe.expert_bias:
        fix_expert_bias_padding_mask()
    if arch.mla is not None and not use_te:
        _enable_mla_without_te()
    vpp = parallel.virtual_pipeline_model_parallel_size
    lm = arch.head == "lm"
    vl = arch.vision is not None
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        chunk_spec = spec
        if arch.moe is not None:  # this chunk's slice of the dense/sparse layer pattern
            chunk_spec = moe_block_spec(config, use_te, stage, pp_rank)
        if not use_te and parallel.sequence_parallel:
            chunk_spec = with_sequence_parallel_norms(chunk_spec, config, stage, pp_rank)
        if arch.mla is not None and not use_te:
            latent = LatentSDPAttention if attention_backend == "sdpa" else LatentDotProductAttention
            chunk_spec = swap_module(copy.deepcopy(chunk_spec), DotProductAttention, latent)
        elif attention_backend == "sdpa":
            chunk_spec = swap_module(copy.deepcopy(chunk_spec), DotProductAttention, SDPAttention)
        model = GPTModelWithPositions(
            config=config,
            transformer_layer_spec=chunk_spec,
            vocab_size=arch.padded_vocab_size(parallel.tensor_model_parallel_size),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=lm and arch.tie_word_embeddings,
            position_embedding_type="mrope" if vl else "rope",
            # A vision-language wrapper scatters the embeddings itself, after writing the images in.
            scatter_embedding_sequence_parallel=not vl,
            vp_stage=stage,
            **_rope_kwargs(arch),
        )
        if arch.mla is not None and not use_te:
            sum_rotary_key_gradients(model)
        if arch.mrope_interleaved:
            interleave_mrope(model)
        if attention_backend == "sdpa" and not vl and parallel.context_parallel_size == 1:
            setattr(model, CAUSAL_ROWS_ATTR, causal_rows)
        if post and not lm:
            attach_scalar_head(model, bias=arch.head_bias, seed=head_seed)
        if vl:
            # The tower lives with the embedding: first chunk of the first stage only.
            vision_config = vision_transformer_config(arch.vision, config)
            vision = VisionTransformer(arch.vision, vision_config, use_te, head_seed) if pre else None
            model = VisionLanguageModel(arch, model, vision)
            if freeze_vision_tower:
                freeze_vision(model)
        if not init_weights:
            mark_tensor_parallel_weights(model)
        if not use_te:
            _norms_to(model, params_dtype)
        if is_cuda():  # as Megatron-LM's get_model: modules megatron does not place (torch norms) too
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def _enable_mla_without_te() -> None:
    """Fix megatron-core 0.16's multi-latent attention where it assumes CUDA or transformer-engine
    (idempotent).

    1. It builds its (YaRN) rotary embedding without passing ``use_cpu_initialization``, so the
       tables go to ``torch.cuda.current_device()``: on CPU, build them on the CPU.
    2. Without transformer-engine its import of TE's layers can succeed with stand-ins that are not
       classes (``HAVE_TE`` True, ``TELinear`` a mock), and ``isinstance(linear_proj, TELinear)``
       raises: mark TE absent there.
    """
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False
    if is_cuda():
        return
    for name in ("RotaryEmbedding", "YarnRotaryEmbedding"):
        cls = getattr(mla, name)
        if not isinstance(cls, functools.partial):
            setattr(mla, name, functools.partial(cls, use_cpu_initialization=True))


def _norms_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Megatron's local layers build their norms as plain torch modules in the default dtype
    (fp32), where Megatron-LM's ``Float16Module`` would cast them to the model's dtype: cast
    them here, as transformer-engine builds its norms in ``params_dtype`` (a bf16 model with
    fp32 norm weights also misses torch's fused RMSNorm kernel)."""
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype)
