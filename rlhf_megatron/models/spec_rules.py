"""The HF⇄mcore rule tables: one ``ParamRule`` per megatron parameter of a family.

Data only; ``spec.py`` is the engine that interprets it. A family is a table of
rules (names, layouts, TP dims, shapes, when a parameter exists) plus the
alternative HF name prefixes its checkpoints may use; adding a family means
adding a table here. Tables are assembled per block, like megatron-core's
``ModuleSpec``: one small builder per module (``_embedding_rules``,
``_attention_rules``, ``_mlp_rules``, ``_expert_rules``, ``_output_rules``,
``_vision_block_rules``, ``_merger_rules``, ...), each rule spelled with keyword
arguments (``_copy`` for the common ``Layout.COPY`` case).

- Text decoders (Llama, Mistral, Qwen2, Qwen3) share ``decoder_rules()``: HF's
  Llama naming, switches on ``ModelArch`` for biases, q/k norms and heads.
- Mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE, Mixtral) are the same
  decoder whose sparse layers (``ModelArch.is_moe_layer``) carry a router and
  ``num_experts`` experts instead of the dense MLP (``_moe_layer_rules``), plus
  Qwen2-MoE's gated shared expert. Megatron's local spec keeps each expert as
  ``mlp.experts.local_experts.{expert}.linear_fc1/2`` (SequentialMLP), the
  transformer-engine spec as ``mlp.experts.linear_fc1.weight{expert}``
  (TEGroupedMLP); ``{expert}`` is the *global* expert index, ``pipeline_stages.py`` maps
  a rank's local experts onto it. Experts are split by expert tensor parallelism
  (``ParamRule.expert``), not by the attention's TP.
- DeepSeek-V3 and GLM-4.5 (``deepseek_moe_decoder_rules``): DeepSeekMoE sparse layers (router
  with its score-correction bias as megatron's ``router.expert_bias`` buffer, ungated
  ``shared_experts``) after the dense first layers; DeepSeek-V3's multi-latent attention
  (``_mla_attention_rules``; rotary rows reordered through ``ParamRule.row_order`` only for a
  checkpoint with ``rope_interleave`` false), GLM-4.5's
  usual attention with q/k/v biases and optional q/k norms.
- Qwen2-VL / Qwen2.5-VL (``vision_rules() + decoder_rules("language_model.")``)
  are the same decoder under the wrapper's ``language_model.`` prefix (HF names
  unchanged: the hub layout ``model.layers.*``), plus the vision tower under
  ``vision_model.`` (HF ``visual.*``): patch embedding, ``depth`` blocks
  (``{block}``, all on the first pipeline stage) and the patch merger. transformers-5 checkpoints written with
  other prefixes (``model.visual.``, ``model.language_model.``) are read through
  ``ArchSpec.hf_aliases``.
- Qwen3-VL and Qwen3-VL-MoE (``_qwen3_vl_spec``): Qwen3-VL's tower with DeepStack mergers over a
  Qwen3 or Qwen3-MoE decoder, HF names under ``model.visual.`` / ``model.language_model.``.
  Qwen3-VL-MoE's checkpoint stacks each sparse layer's experts into one ``experts.gate_up_proj``
  and one ``experts.down_proj`` (``MoENames.stacked``): megatron's per-expert ``linear_fc1`` /
  ``linear_fc2`` are rows of those (``ParamRule.stacked``).

Name templates: ``{layer}`` is a global language-model layer, ``{block}`` a
vision block, ``{expert}`` a global expert of a sparse layer.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass

from rlhf_megatron.planning.model_arch import ModelArch

__all__ = ["ArchSpec", "Layout", "MoENames", "ParamRule", "SPECS"]


class Layout(enum.Enum):
    """How the HF tensors of a rule become the megatron tensor."""

    COPY = "copy"
    """One HF tensor, same layout (zero-padded along ``tp_dim`` when ``ParamRule.hf_size`` is set)."""
    QKV = "qkv"
    """HF q, k, v (three tensors, or one fused ``[q; k; v]``) -> megatron's group-interleaved linear_qkv."""
    GATE_UP = "gate_up"
    """HF gate, up -> ``[gate; up]`` (TP shard: ``[gate_r; up_r]``), each half padded to megatron's rows."""


ShapeFn = Callable[[ModelArch, int], tuple[int, ...]]
QkvDims = tuple[int, int, int]
"""(key/value groups, query heads per group, head_dim) of a QKV rule."""


def _lm_qkv(a: ModelArch) -> QkvDims:
    return a.num_kv_heads, a.queries_per_group, a.head_dim


def _vision_qkv(a: ModelArch) -> QkvDims:
    # Multi-head attention: one group per head, one query per group.
    return a.vision.num_heads, 1, a.vision.head_dim


@dataclass(frozen=True)
class ParamRule:
    """One megatron parameter and the HF tensors it corresponds to."""

    mcore: tuple[str, ...]
    """Megatron name templates; the first is the local-spec name, a second one the
    transformer-engine/checkpoint name."""
    hf: tuple[str, ...]
    """HF name templates, in the order ``Layout`` expects (q, k, v / gate, up)."""
    layout: Layout
    tp_dim: int | None
    """Dim along which TP splits the parameter; None = replicated on every TP rank."""
    shape: ShapeFn
    """Full megatron shape for ``(arch, tp_size)`` (tp matters only for padded rows)."""
    when: Callable[[ModelArch], bool] = lambda arch: True
    """Whether the parameter exists for this arch (biases, q/k norms, which head, vision MLP kind)."""
    exported: bool = True
    """False for parameters that are read from HF but not written back (tied LM head)."""
    hf_size: Callable[[ModelArch], int] | None = None
    """HF size along ``tp_dim`` (of each half for GATE_UP) when megatron pads it: rows up to
    megatron's size are zero on import and trimmed on export (vocabulary, vision MLP)."""
    qkv: Callable[[ModelArch], QkvDims] = _lm_qkv
    """Head layout of a QKV rule."""
    on_layer: Callable[[ModelArch, int], bool] | None = None
    """For ``{layer}`` rules: whether a given layer has the parameter (dense MLP vs experts)."""
    expert: bool = False
    """A routed expert's weight: ``tp_dim`` splits it over the expert tensor-parallel group (ETP)."""
    row_order: Callable[[ModelArch], tuple[int, ...]] | None = None
    """For a ``Layout.COPY`` rule: megatron row ``j`` is HF row ``row_order(arch)[j]`` (dim 0),
    e.g. MLA's rotary rows of an HF checkpoint that rotates halves (megatron's MLA de-interleaves)."""
    stacked: bool = False
    """For an ``expert`` rule: its one HF tensor holds every expert of the layer, each transposed:
    ``hf[e]`` is expert ``e``'s ``[in, out]``, so megatron's expert ``e`` is ``hf[e].T`` (Qwen3-VL-MoE's
    ``experts.gate_up_proj`` ``[E, hidden, 2 x width]`` of ``[gate | up]`` columns and
    ``experts.down_proj`` ``[E, width, hidden]``, as the hub stores them). ``spec.mcore_to_hf`` gives
    that row as ``name[e]``; ``spec.ExpertStacker`` assembles the rows."""


@dataclass(frozen=True)
class ArchSpec:
    """The rule table for a family of HF architectures."""

    model_types: tuple[str, ...]
    rules: tuple[ParamRule, ...]
    hf_aliases: tuple[tuple[str, str], ...] = ()
    """(prefix in ``rules``, alternative prefix): where an HF name may be found instead."""


# -- building rules ------------------------------------------------------------------


def _copy(
    mcore: str | tuple[str, ...], hf: str, shape: ShapeFn, tp_dim: int | None = None, **kw
) -> ParamRule:
    """A ``Layout.COPY`` rule: one HF tensor, same layout; replicated unless ``tp_dim`` is given."""
    mcore = (mcore,) if isinstance(mcore, str) else mcore
    return ParamRule(mcore=mcore, hf=(hf,), layout=Layout.COPY, tp_dim=tp_dim, shape=shape, **kw)


def _hidden(a: ModelArch, tp: int) -> tuple[int, ...]:
    """A norm over the hidden size (replicated)."""
    return (a.hidden_size,)


def _head_width(a: ModelArch, tp: int) -> tuple[int, ...]:
    """A per-head q/k norm (replicated)."""
    return (a.head_dim,)


def _vocab_rows(a: ModelArch, tp: int) -> tuple[int, ...]:
    """The embedding and the LM head: (vocabulary padded for TP size ``tp``, hidden size)."""
    return (a.padded_vocab_size(tp), a.hidden_size)


# -- text decoders -----------------------------------------------------------------


def _qkv_rows(a: ModelArch) -> int:
    return (a.num_attention_heads + 2 * a.num_kv_heads) * a.head_dim


def _vocab(a: ModelArch) -> int:
    return a.vocab_size


def _qkv_bias(a: ModelArch) -> bool:
    return a.qkv_bias


def _qk_norm(a: ModelArch) -> bool:
    return a.qk_norm


def _dense_layer(a: ModelArch, layer: int) -> bool:
    return not a.is_moe_layer(layer)


def _moe_layer(a: ModelArch, layer: int) -> bool:
    return a.is_moe_layer(layer)


def _shared_expert(a: ModelArch) -> bool:
    return a.moe.shared_expert_ffn_hidden_size is not None


def _expert_bias(a: ModelArch) -> bool:
    return a.moe.expert_bias


def _q_lora(a: ModelArch) -> bool:
    return a.mla.q_lora_rank is not None


def _no_q_lora(a: ModelArch) -> bool:
    return a.mla.q_lora_rank is None


def _interleave(rope: int, offset: int) -> list[int]:
    """HF rows of megatron's rotary rows ``offset ..`` when HF rotates halves (``rope_interleave``
    false). megatron's MLA de-interleaves the rotary part before its ``rotate_half``
    (``_apply_rotary_pos_emb_bshd(multi_latent_attention=True)``: ``[x0, x2, ..; x1, x3, ..]``),
    as transformers' ``apply_rotary_pos_emb_interleave`` does, so HF's interleaved rows load as
    stored; HF's halves ``[h0 .. h_{r/2-1}; h_{r/2} ..]`` must be stored interleaved
    ``(h0, h_{r/2}), (h1, h_{r/2+1}), ..`` for that de-interleaving to give them back."""
    half = rope // 2
    return [offset + i for j in range(half) for i in (j, half + j)]


def _q_rows(a: ModelArch) -> tuple[int, ...]:
    """Each head's query rows ``[nope | rope]``, the rope rows interleaved when HF's are halves."""
    m, d = a.mla, a.mla.q_head_dim
    if m.rope_interleave:
        return tuple(range(a.num_attention_heads * d))
    return tuple(
        row
        for h in range(a.num_attention_heads)
        for row in (
            *range(h * d, h * d + m.qk_nope_head_dim),
            *_interleave(m.qk_rope_head_dim, h * d + m.qk_nope_head_dim),
        )
    )


def _kv_down_rows(a: ModelArch) -> tuple[int, ...]:
    """The latent's rows ``[kv_lora_rank | rope]``, the rope rows interleaved when HF's are halves."""
    m = a.mla
    if m.rope_interleave:
        return tuple(range(m.kv_lora_rank + m.qk_rope_head_dim))
    return (*range(m.kv_lora_rank), *_interleave(m.qk_rope_head_dim, m.kv_lora_rank))


def _untied_lm_head(a: ModelArch) -> bool:
    return a.head == "lm" and not a.tie_word_embeddings


def _tied_lm_head(a: ModelArch) -> bool:
    return a.head == "lm" and a.tie_word_embeddings


def _scalar_head(a: ModelArch) -> bool:
    return a.head != "lm"


def _scalar_head_bias(a: ModelArch) -> bool:
    return a.head != "lm" and a.head_bias


@dataclass(frozen=True)
class MoENames:
    """Where a family's HF checkpoint keeps a sparse layer's tensors (under ``model.layers.{layer}.``)."""

    block: str
    """The sparse MLP module: ``mlp`` (Qwen) or ``block_sparse_moe`` (Mixtral)."""
    gate: str
    up: str
    down: str
    """An expert's projections: ``gate_proj``/``up_proj``/``down_proj`` (Qwen) or ``w1``/``w3``/``w2`` (Mixtral)."""
    stacked: bool = False
    """One tensor per projection holds all the layer's experts (``block.experts.<gate>`` with
    ``gate`` = ``up``: the ``[gate | up]`` stack, and ``block.experts.<down>``; Qwen3-VL-MoE)."""


QWEN_MOE = MoENames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_MOE = MoENames("block_sparse_moe", "w1", "w3", "w2")
QWEN3_VL_MOE = MoENames("mlp", "gate_up_proj", "gate_up_proj", "down_proj", stacked=True)


def _embedding_rules(e: str) -> tuple[ParamRule, ...]:
    """The word embedding, split over TP by vocabulary rows (padded; ``hf_size`` is HF's vocabulary)."""
    return (
        _copy(
            e + "embedding.word_embeddings.weight",
            "model.embed_tokens.weight",
            tp_dim=0,
            shape=_vocab_rows,
            hf_size=_vocab,
        ),
    )


def _attention_rules(L: str, H: str) -> tuple[ParamRule, ...]:
    """A layer's input norm (the transformer-engine spec fuses it into linear_qkv), q/k/v into
    megatron's column-parallel linear_qkv (biases: Qwen2), per-head q/k norms (Qwen3) and the
    row-parallel output projection."""
    S, A = L + "self_attention.", H + "self_attn."
    return (
        _copy(
            (L + "input_layernorm.weight", S + "linear_qkv.layer_norm_weight"),
            H + "input_layernorm.weight",
            shape=_hidden,
        ),
        ParamRule(
            mcore=(S + "linear_qkv.weight",),
            hf=tuple(A + f"{p}_proj.weight" for p in "qkv"),
            layout=Layout.QKV,
            tp_dim=0,
            shape=lambda a, tp: (_qkv_rows(a), a.hidden_size),
        ),
        ParamRule(
            mcore=(S + "linear_qkv.bias",),
            hf=tuple(A + f"{p}_proj.bias" for p in "qkv"),
            layout=Layout.QKV,
            tp_dim=0,
            shape=lambda a, tp: (_qkv_rows(a),),
            when=_qkv_bias,
        ),
        _copy(S + "q_layernorm.weight", A + "q_norm.weight", shape=_head_width, when=_qk_norm),
        _copy(S + "k_layernorm.weight", A + "k_norm.weight", shape=_head_width, when=_qk_norm),
        _copy(
            S + "linear_proj.weight",
            A + "o_proj.weight",
            tp_dim=1,
            shape=lambda a, tp: (a.hidden_size, a.num_attention_heads * a.head_dim),
        ),
    )


def _mla_attention_rules(L: str, H: str) -> tuple[ParamRule, ...]:
    """Multi-latent attention (DeepSeek-V3) with megatron's local spec: the input norm, the query's
    low-rank pair with its norm (or one ``q_proj``), the fused key/value latent plus the shared rotary
    key, its norm, the up-projection to per-head ``[k_nope | v]``, and the output projection.

    The local spec's down-projections are column-parallel (each TP rank holds a slice of the latent
    rows and gathers them); the up-projections split heads; the norms are replicated. The rotary
    rows load as stored when HF interleaves them (DeepSeek's default: megatron's MLA de-interleaves
    them itself) and are reordered (``row_order``) into pairs when HF rotates halves."""
    S, A = L + "self_attention.", H + "self_attn."

    return (
        _copy(L + "input_layernorm.weight", H + "input_layernorm.weight", shape=_hidden),
        _copy(
            S + "linear_q_down_proj.weight",
            A + "q_a_proj.weight",
            tp_dim=0,
            shape=lambda a, tp: (a.mla.q_lora_rank, a.hidden_size),
            when=_q_lora,
        ),
        _copy(
            S + "q_layernorm.weight",
            A + "q_a_layernorm.weight",
            shape=lambda a, tp: (a.mla.q_lora_rank,),
            when=_q_lora,
        ),
        _copy(
            S + "linear_q_up_proj.weight",
            A + "q_b_proj.weight",
            tp_dim=0,
            shape=lambda a, tp: (a.num_attention_heads * a.mla.q_head_dim, a.mla.q_lora_rank),
            when=_q_lora,
            row_order=_q_rows,
        ),
        _copy(
            S + "linear_q_proj.weight",
            A + "q_proj.weight",
            tp_dim=0,
            shape=lambda a, tp: (a.num_attention_heads * a.mla.q_head_dim, a.hidden_size),
            when=_no_q_lora,
            row_order=_q_rows,
        ),
        _copy(
            S + "linear_kv_down_proj.weight",
            A + "kv_a_proj_with_mqa.weight",
            tp_dim=0,
            shape=lambda a, tp: (a.mla.kv_lora_rank + a.mla.qk_rope_head_dim, a.hidden_size),
            row_order=_kv_down_rows,
        ),
        _copy(
            S + "kv_layernorm.weight", A + "kv_a_layernorm.weight", shape=lambda a, tp: (a.mla.kv_lora_rank,)
        ),
        _copy(
            S + "linear_kv_up_proj.weight",
            A + "kv_b_proj.weight",
            tp_dim=0,
            shape=lambda a, tp: (
                a.num_attention_heads * (a.mla.qk_nope_head_dim + a.mla.v_head_dim),
                a.mla.kv_lora_rank,
            ),
        ),
        _copy(
            S + "linear_proj.weight",
            A + "o_proj.weight",
            tp_dim=1,
            shape=lambda a, tp: (a.hidden_size, a.num_attention_heads * a.mla.v_head_dim),
        ),
    )


def _mlp_rules(L: str, H: str) -> tuple[ParamRule, ...]:
    """A dense layer's norm (fused into linear_fc1 by the transformer-engine spec) and SwiGLU MLP:
    column-parallel ``[gate; up]``, row-parallel down. Every layer of a dense family; the layers
    outside ``ModelArch.is_moe_layer`` of a mixture-of-experts one."""
    return (
        _copy(
            (L + "pre_mlp_layernorm.weight", L + "mlp.linear_fc1.layer_norm_weight"),
            H + "post_attention_layernorm.weight",
            shape=_hidden,
            on_layer=_dense_layer,
        ),
        ParamRule(
            mcore=(L + "mlp.linear_fc1.weight",),
            hf=(H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"),
            layout=Layout.GATE_UP,
            tp_dim=0,
            shape=lambda a, tp: (2 * a.ffn_hidden_size, a.hidden_size),
            on_layer=_dense_layer,
        ),
        _copy(
            L + "mlp.linear_fc2.weight",
            H + "mlp.down_proj.weight",
            tp_dim=1,
            shape=lambda a, tp: (a.hidden_size, a.ffn_hidden_size),
            on_layer=_dense_layer,
        ),
    )


def _expert_rules(L: str, H: str, names: MoENames) -> tuple[ParamRule, ...]:
    """A sparse layer's routed experts, each a SwiGLU MLP split by expert tensor parallelism.

    Megatron names: the local spec's SequentialMLP first, then the transformer-engine
    spec's TEGroupedMLP; ``{expert}`` is the global expert index in both. ``names.stacked``: each
    expert is a row of the layer's stacked HF tensors (``ParamRule.stacked``)."""
    if names.stacked:
        return _stacked_expert_rules(L, H, names)
    M, X = L + "mlp.experts.", H + f"{names.block}.experts.{{expert}}."
    return (
        ParamRule(
            mcore=(M + "local_experts.{expert}.linear_fc1.weight", M + "linear_fc1.weight{expert}"),
            hf=(X + f"{names.gate}.weight", X + f"{names.up}.weight"),
            layout=Layout.GATE_UP,
            tp_dim=0,
            shape=lambda a, tp: (2 * a.moe.ffn_hidden_size, a.hidden_size),
            on_layer=_moe_layer,
            expert=True,
        ),
        _copy(
            (M + "local_experts.{expert}.linear_fc2.weight", M + "linear_fc2.weight{expert}"),
            X + f"{names.down}.weight",
            tp_dim=1,
            shape=lambda a, tp: (a.hidden_size, a.moe.ffn_hidden_size),
            on_layer=_moe_layer,
            expert=True,
        ),
    )


def _stacked_expert_rules(L: str, H: str, names: MoENames) -> tuple[ParamRule, ...]:
    """``_expert_rules`` for a checkpoint that stacks the layer's experts: expert ``e``'s ``[gate; up]``
    is row ``e`` of ``experts.<gate>`` transposed, its down projection row ``e`` of ``experts.<down>``."""
    M, X = L + "mlp.experts.", H + f"{names.block}.experts."
    return (
        ParamRule(
            mcore=(M + "local_experts.{expert}.linear_fc1.weight", M + "linear_fc1.weight{expert}"),
            hf=(X + names.gate,),
            layout=Layout.GATE_UP,
            tp_dim=0,
            shape=lambda a, tp: (2 * a.moe.ffn_hidden_size, a.hidden_size),
            on_layer=_moe_layer,
            expert=True,
            stacked=True,
        ),
        _copy(
            (M + "local_experts.{expert}.linear_fc2.weight", M + "linear_fc2.weight{expert}"),
            X + names.down,
            tp_dim=1,
            shape=lambda a, tp: (a.hidden_size, a.moe.ffn_hidden_size),
            on_layer=_moe_layer,
            expert=True,
            stacked=True,
        ),
    )


def _shared_mlp_rules(S: str, X: str) -> tuple[ParamRule, ...]:
    """A sparse layer's shared-expert SwiGLU MLP (megatron ``S``, HF ``X``): on every token, split
    by the attention's TP."""
    return (
        ParamRule(
            mcore=(S + "linear_fc1.weight",),
            hf=(X + "gate_proj.weight", X + "up_proj.weight"),
            layout=Layout.GATE_UP,
            tp_dim=0,
            shape=lambda a, tp: (2 * a.moe.shared_expert_ffn_hidden_size, a.hidden_size),
            when=_shared_expert,
            on_layer=_moe_layer,
        ),
        _copy(
            S + "linear_fc2.weight",
            X + "down_proj.weight",
            tp_dim=1,
            shape=lambda a, tp: (a.hidden_size, a.moe.shared_expert_ffn_hidden_size),
            when=_shared_expert,
            on_layer=_moe_layer,
        ),
    )


def _shared_expert_rules(L: str, H: str) -> tuple[ParamRule, ...]:
    """Qwen2-MoE's shared expert: its MLP's output scaled by ``sigmoid(gate_weight @ x)``."""
    return (
        *_shared_mlp_rules(L + "mlp.shared_experts.", H + "mlp.shared_expert."),
        _copy(
            L + "mlp.shared_experts.gate_weight",
            H + "mlp.shared_expert_gate.weight",
            shape=lambda a, tp: (1, a.hidden_size),
            when=_shared_expert,
            on_layer=_moe_layer,
        ),
    )


def _deepseek_shared_expert_rules(L: str, H: str) -> tuple[ParamRule, ...]:
    """DeepSeek-V3's / GLM-4.5's shared experts: one MLP of ``n_shared_experts`` experts' width,
    added without a gate."""
    return _shared_mlp_rules(L + "mlp.shared_experts.", H + "mlp.shared_experts.")


def _deepseek_moe_layer_rules(L: str, H: str) -> tuple[ParamRule, ...]:
    """A DeepSeekMoE sparse layer (DeepSeek-V3, GLM-4.5): norm, sigmoid router with its
    score-correction bias (megatron's ``expert_bias`` buffer), routed and shared experts."""
    norm_router_experts = _moe_layer_rules(L, H, QWEN_MOE)[:4]  # norm, router, experts (no Qwen2 gate)
    return (
        *norm_router_experts,
        _copy(
            L + "mlp.router.expert_bias",
            H + "mlp.gate.e_score_correction_bias",
            shape=lambda a, tp: (a.moe.num_experts,),
            when=_expert_bias,
            on_layer=_moe_layer,
        ),
        *_deepseek_shared_expert_rules(L, H),
    )


def _moe_layer_rules(L: str, H: str, names: MoENames) -> tuple[ParamRule, ...]:
    """A sparse layer's norm, router, routed experts and (Qwen2-MoE) gated shared expert."""
    return (
        # The norm before the experts is a module of its own with either spec; the local spec's
        # checkpoint spells it like the dense layer's fused norm. Names: local module, local
        # checkpoint key, transformer-engine module (last, as ``fused_norms`` expects).
        _copy(
            (
                L + "pre_mlp_layernorm.weight",
                L + "mlp.linear_fc1.layer_norm_weight",
                L + "pre_mlp_layernorm.weight",
            ),
            H + "post_attention_layernorm.weight",
            shape=_hidden,
            on_layer=_moe_layer,
        ),
        _copy(
            L + "mlp.router.weight",
            H + f"{names.block}.gate.weight",
            shape=lambda a, tp: (a.moe.num_experts, a.hidden_size),
            on_layer=_moe_layer,
        ),
        *_expert_rules(L, H, names),
        *_shared_expert_rules(L, H),
    )


def _output_rules(e: str) -> tuple[ParamRule, ...]:
    """The final norm and the head on top of it: the LM head, or a critic's / reward model's score."""
    return (
        _copy(e + "decoder.final_layernorm.weight", "model.norm.weight", shape=_hidden),
        _copy(
            e + "output_layer.weight",
            "lm_head.weight",
            tp_dim=0,
            shape=_vocab_rows,
            when=_untied_lm_head,
            hf_size=_vocab,
        ),
        # Tied embeddings: the last pipeline stage keeps its own copy of the
        # embedding as output layer (megatron syncs the two); it is loaded from the
        # embedding and not exported, as HF stores the tensor once.
        _copy(
            e + "output_layer.weight",
            "model.embed_tokens.weight",
            tp_dim=0,
            shape=_vocab_rows,
            when=_tied_lm_head,
            exported=False,
            hf_size=_vocab,
        ),
        # Critic / reward model: a one-output head, replicated on every TP rank
        # (see heads.py), stored like HF's *ForTokenClassification / *ForSequenceClassification.
        _copy(
            e + "output_layer.weight",
            "score.weight",
            shape=lambda a, tp: (1, a.hidden_size),
            when=_scalar_head,
        ),
        _copy(e + "output_layer.bias", "score.bias", shape=lambda a, tp: (1,), when=_scalar_head_bias),
    )


def decoder_rules(prefix: str = "", moe: MoENames | None = None) -> tuple[ParamRule, ...]:
    """A Llama-style decoder; megatron names under ``prefix`` (the vision-language wrapper's
    ``language_model.``), HF names as the hub stores them. ``moe``: the sparse layers' HF names
    of a mixture-of-experts family (its dense layers keep the plain MLP)."""
    e, L, H = prefix, prefix + "decoder.layers.{layer}.", "model.layers.{layer}."
    return (
        *_embedding_rules(e),
        *_attention_rules(L, H),
        *_mlp_rules(L, H),
        *(_moe_layer_rules(L, H, moe) if moe is not None else ()),
        *_output_rules(e),
    )


def deepseek_moe_decoder_rules(mla: bool) -> tuple[ParamRule, ...]:
    """DeepSeek-V3 (``mla``: multi-latent attention) and GLM-4.5 (grouped-query attention with q/k/v
    biases and optional q/k norms): dense first layers, then DeepSeekMoE sparse layers."""
    L, H = "decoder.layers.{layer}.", "model.layers.{layer}."
    return (
        *_embedding_rules(""),
        *(_mla_attention_rules(L, H) if mla else _attention_rules(L, H)),
        *_mlp_rules(L, H),
        *_deepseek_moe_layer_rules(L, H),
        *_output_rules(""),
    )


# -- the vision tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) -----------------------------------


def _layernorm(a: ModelArch) -> bool:
    return a.vision.norm == "layernorm"


def _swiglu(a: ModelArch) -> bool:
    return a.vision.mlp == "swiglu"


def _fc1_fc2(a: ModelArch) -> bool:
    """fc1 -> activation -> fc2 (Qwen2-VL's QuickGELU, Qwen3-VL's tanh-GELU)."""
    return a.vision.mlp in ("quick_gelu", "gelu_tanh")


def _patch_bias(a: ModelArch) -> bool:
    return a.vision.patch_bias


def _learned_positions(a: ModelArch) -> bool:
    return a.vision.num_position_embeddings is not None


def _vh(a: ModelArch) -> int:
    return a.vision.hidden_size


def _vffn(a: ModelArch, tp: int) -> int:
    return a.vision.padded_intermediate_size(tp)


def _vffn_hf(a: ModelArch) -> int:
    return a.vision.intermediate_size


def _vision_hidden(a: ModelArch, tp: int) -> tuple[int, ...]:
    """A vision norm or row-parallel bias over the block width (replicated)."""
    return (_vh(a),)


def _merged_width(a: ModelArch, tp: int) -> tuple[int, ...]:
    """A norm over ``m x m`` patches side by side (Qwen3-VL's DeepStack mergers; replicated)."""
    return (a.vision.merged_hidden_size,)


def _vision_norm_rules(
    mcore: tuple[str, ...], hf: str, shape: ShapeFn = _vision_hidden
) -> tuple[ParamRule, ...]:
    """A vision norm: its weight, and its bias when it is a LayerNorm (Qwen2-VL, Qwen3-VL)."""
    bias = tuple(m.removesuffix("weight") + "bias" for m in mcore)  # layer_norm_weight -> layer_norm_bias
    return (
        _copy(mcore, hf + ".weight", shape=shape),
        _copy(bias, hf + ".bias", shape=shape, when=_layernorm),
    )


def _vision_attention_rules(S: str, A: str) -> tuple[ParamRule, ...]:
    """A block's attention: HF's fused ``[q; k; v]`` with biases, multi-head (``_vision_qkv``)."""
    return (
        ParamRule(
            mcore=(S + "linear_qkv.weight",),
            hf=(A + "qkv.weight",),
            layout=Layout.QKV,
            tp_dim=0,
            shape=lambda a, tp: (3 * _vh(a), _vh(a)),
            qkv=_vision_qkv,
        ),
        ParamRule(
            mcore=(S + "linear_qkv.bias",),
            hf=(A + "qkv.bias",),
            layout=Layout.QKV,
            tp_dim=0,
            shape=lambda a, tp: (3 * _vh(a),),
            qkv=_vision_qkv,
        ),
        _copy(S + "linear_proj.weight", A + "proj.weight", tp_dim=1, shape=lambda a, tp: (_vh(a), _vh(a))),
        _copy(S + "linear_proj.bias", A + "proj.bias", shape=_vision_hidden),
    )


def _vision_mlp_rules(M: str, H: str, fc: tuple[str, str] = ("fc1", "fc2")) -> tuple[ParamRule, ...]:
    """A block's MLP. Megatron pads its rows (``_vffn``); ``hf_size`` is HF's intermediate size.
    ``fc``: HF's names of the two linears of an fc1 -> activation -> fc2 MLP."""
    return (
        # Qwen2.5-VL: SwiGLU with biases.
        ParamRule(
            mcore=(M + "linear_fc1.weight",),
            hf=(H + "gate_proj.weight", H + "up_proj.weight"),
            layout=Layout.GATE_UP,
            tp_dim=0,
            shape=lambda a, tp: (2 * _vffn(a, tp), _vh(a)),
            when=_swiglu,
            hf_size=_vffn_hf,
        ),
        ParamRule(
            mcore=(M + "linear_fc1.bias",),
            hf=(H + "gate_proj.bias", H + "up_proj.bias"),
            layout=Layout.GATE_UP,
            tp_dim=0,
            shape=lambda a, tp: (2 * _vffn(a, tp),),
            when=_swiglu,
            hf_size=_vffn_hf,
        ),
        _copy(
            M + "linear_fc2.weight",
            H + "down_proj.weight",
            tp_dim=1,
            shape=lambda a, tp: (_vh(a), _vffn(a, tp)),
            when=_swiglu,
            hf_size=_vffn_hf,
        ),
        _copy(M + "linear_fc2.bias", H + "down_proj.bias", shape=_vision_hidden, when=_swiglu),
        # Qwen2-VL: fc1 -> QuickGELU -> fc2; Qwen3-VL: linear_fc1 -> tanh-GELU -> linear_fc2.
        _copy(
            M + "linear_fc1.weight",
            H + fc[0] + ".weight",
            tp_dim=0,
            shape=lambda a, tp: (_vffn(a, tp), _vh(a)),
            when=_fc1_fc2,
            hf_size=_vffn_hf,
        ),
        _copy(
            M + "linear_fc1.bias",
            H + fc[0] + ".bias",
            tp_dim=0,
            shape=lambda a, tp: (_vffn(a, tp),),
            when=_fc1_fc2,
            hf_size=_vffn_hf,
        ),
        _copy(
            M + "linear_fc2.weight",
            H + fc[1] + ".weight",
            tp_dim=1,
            shape=lambda a, tp: (_vh(a), _vffn(a, tp)),
            when=_fc1_fc2,
            hf_size=_vffn_hf,
        ),
        _copy(M + "linear_fc2.bias", H + fc[1] + ".bias", shape=_vision_hidden, when=_fc1_fc2),
    )


def _vision_block_rules(V: str, H: str, fc: tuple[str, str] = ("fc1", "fc2")) -> tuple[ParamRule, ...]:
    """A vision block as a megatron TransformerLayer: norm1, attention, norm2, MLP (the
    transformer-engine spec fuses each norm into the linear after it)."""
    return (
        *_vision_norm_rules(
            (V + "input_layernorm.weight", V + "self_attention.linear_qkv.layer_norm_weight"), H + "norm1"
        ),
        *_vision_attention_rules(V + "self_attention.", H + "attn."),
        *_vision_norm_rules(
            (V + "pre_mlp_layernorm.weight", V + "mlp.linear_fc1.layer_norm_weight"), H + "norm2"
        ),
        *_vision_mlp_rules(V + "mlp.", H + "mlp.", fc),
    )


def _merger_rules(
    M: str, H: str, names: tuple[str, str, str] = ("ln_q", "mlp.0", "mlp.2"), postshuffle: bool = False
) -> tuple[ParamRule, ...]:
    """The merger: norm, then a column-parallel fc1 -> GELU -> row-parallel fc2 over m x m patches.
    ``names``: HF's norm, fc1 and fc2; ``postshuffle``: the norm spans the m x m patches (Qwen3-VL's
    DeepStack mergers) rather than one patch."""
    norm, fc1, fc2 = names
    return (
        *_vision_norm_rules((M + "ln_q.weight",), H + norm, _merged_width if postshuffle else _vision_hidden),
        _copy(
            M + "mlp.linear_fc1.weight",
            H + fc1 + ".weight",
            tp_dim=0,
            shape=lambda a, tp: _merged_width(a, tp) * 2,
        ),
        _copy(
            M + "mlp.linear_fc1.bias",
            H + fc1 + ".bias",
            tp_dim=0,
            shape=_merged_width,
        ),
        _copy(
            M + "mlp.linear_fc2.weight",
            H + fc2 + ".weight",
            tp_dim=1,
            shape=lambda a, tp: (a.vision.out_hidden_size, a.vision.merged_hidden_size),
        ),
        _copy(M + "mlp.linear_fc2.bias", H + fc2 + ".bias", shape=lambda a, tp: (a.vision.out_hidden_size,)),
    )


def _patch_embed_rule() -> ParamRule:
    """HF's Conv3d weight ``[hidden, C, T, P, P]``, replicated."""
    return _copy(
        "vision_model.patch_embed.weight",
        "visual.patch_embed.proj.weight",
        shape=lambda a, tp: (
            _vh(a),
            a.vision.in_channels,
            a.vision.temporal_patch_size,
            *[a.vision.patch_size] * 2,
        ),
    )


def vision_rules() -> tuple[ParamRule, ...]:
    """The vision tower under ``vision_model.``: megatron TransformerLayers as ``decoder.layers.{block}``."""
    return (
        _patch_embed_rule(),
        *_vision_block_rules("vision_model.decoder.layers.{block}.", "visual.blocks.{block}."),
        *_merger_rules("vision_model.merger.", "visual.merger."),
    )


def qwen3_vision_rules() -> tuple[ParamRule, ...]:
    """Qwen3-VL's tower: the patch embedding with its bias, the learned positions, LayerNorm blocks
    with a tanh-GELU MLP, the merger and the DeepStack mergers (``{deepstack}``)."""
    fc = ("linear_fc1", "linear_fc2")
    merger = ("norm", "linear_fc1", "linear_fc2")
    return (
        _patch_embed_rule(),
        _copy(
            "vision_model.patch_embed.bias",
            "visual.patch_embed.proj.bias",
            shape=_vision_hidden,
            when=_patch_bias,
        ),
        _copy(
            "vision_model.pos_embed",
            "visual.pos_embed.weight",
            shape=lambda a, tp: (a.vision.num_position_embeddings, _vh(a)),
            when=_learned_positions,
        ),
        *_vision_block_rules("vision_model.decoder.layers.{block}.", "visual.blocks.{block}.", fc),
        *_merger_rules("vision_model.merger.", "visual.merger.", merger),
        *_merger_rules(
            "vision_model.deepstack_mergers.{deepstack}.",
            "visual.deepstack_merger_list.{deepstack}.",
            merger,
            postshuffle=True,
        ),
    )


def _rehomed(rules: tuple[ParamRule, ...], prefixes: dict[str, str]) -> tuple[ParamRule, ...]:
    """``rules`` with HF names moved to other prefixes (the first matching prefix of each name)."""

    def move(name: str) -> str:
        old = next((p for p in prefixes if name.startswith(p)), None)
        return name if old is None else prefixes[old] + name[len(old) :]

    return tuple(dataclasses.replace(r, hf=tuple(move(n) for n in r.hf)) for r in rules)


_TEXT_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_MOE_TYPES = {"qwen2_moe": QWEN_MOE, "qwen3_moe": QWEN_MOE, "mixtral": MIXTRAL_MOE}
_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
_VL_SPEC = ArchSpec(
    _VL_TYPES,
    vision_rules() + decoder_rules("language_model."),
    # transformers 5.x may save the tower and the language model under model.*.
    hf_aliases=(("visual.", "model.visual."), ("model.", "model.language_model.")),
)


def _qwen3_vl_spec(model_type: str, moe: MoENames | None = None) -> ArchSpec:
    """Qwen3-VL (``moe`` None) or Qwen3-VL-MoE. Their checkpoints (the hub's and transformers 5's)
    keep the tower under model.visual.* and the language model under model.language_model.*, the
    names vLLM's Qwen3-VL loads; older layouts alias."""
    return ArchSpec(
        (model_type,),
        _rehomed(
            qwen3_vision_rules() + decoder_rules("language_model.", moe=moe),
            {"visual.": "model.visual.", "model.": "model.language_model."},
        ),
        hf_aliases=(("model.visual.", "visual."), ("model.language_model.", "model.")),
    )


SPECS: dict[str, ArchSpec] = {
    **{t: ArchSpec((t,), decoder_rules()) for t in _TEXT_TYPES},
    **{t: ArchSpec((t,), decoder_rules(moe=names)) for t, names in _MOE_TYPES.items()},
    **dict.fromkeys(_VL_TYPES, _VL_SPEC),
    "qwen3_vl": _qwen3_vl_spec("qwen3_vl"),
    "qwen3_vl_moe": _qwen3_vl_spec("qwen3_vl_moe", QWEN3_VL_MOE),
    "deepseek_v3": ArchSpec(("deepseek_v3",), deepseek_moe_decoder_rules(mla=True)),
    "glm4_moe": ArchSpec(("glm4_moe",), deepseek_moe_decoder_rules(mla=False)),
}
