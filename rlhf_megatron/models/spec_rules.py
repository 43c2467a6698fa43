"""The HF⇄mcore rule tables: one ``ParamRule`` per megatron parameter of a family.

Data only; ``spec.py`` is the engine that interprets it. A family is a table of
rules (names, layouts, TP dims, shapes, when a parameter exists) plus the
alternative HF name prefixes its checkpoints may use; adding a family means
adding a table here.

- Text decoders (Llama, Mistral, Qwen2, Qwen3) share ``decoder_rules()``: HF's
  Llama naming, switches on ``ModelArch`` for biases, q/k norms and heads.
- Mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE, Mixtral) are the same
  decoder whose sparse layers (``ModelArch.is_moe_layer``) carry a router and
  ``num_experts`` experts instead of the dense MLP (``_moe_layer_rules``), plus
  Qwen2-MoE's gated shared expert. Megatron's local spec keeps each expert as
  ``mlp.experts.local_experts.{expert}.linear_fc1/2`` (SequentialMLP), the
  transformer-engine spec as ``mlp.experts.linear_fc1.weight{expert}``
  (TEGroupedMLP); ``{expert}`` is the *global* expert index, ``stages.py`` maps
  a rank's local experts onto it. Experts are split by expert tensor parallelism
  (``ParamRule.expert``), not by the attention's TP.
- Qwen2-VL / Qwen2.5-VL (``vision_language_rules()``) are the same decoder under
  the wrapper's ``language_model.`` prefix (HF names unchanged: the hub layout
  ``model.layers.*``), plus the vision tower under ``vision_model.`` (HF
  ``visual.*``): patch embedding, ``depth`` blocks (``{block}``, all on the first
  pipeline stage) and the patch merger. transformers-5 checkpoints written with
  other prefixes (``model.visual.``, ``model.language_model.``) are read through
  ``ArchSpec.hf_aliases``.

Name templates: ``{layer}`` is a global language-model layer, ``{block}`` a
vision block, ``{expert}`` a global expert of a sparse layer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from rlhf_megatron.config.model_arch import ModelArch

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


@dataclass(frozen=True)
class ArchSpec:
    """The rule table for a family of HF architectures."""

    model_types: tuple[str, ...]
    rules: tuple[ParamRule, ...]
    hf_aliases: tuple[tuple[str, str], ...] = ()
    """(prefix in ``rules``, alternative prefix): where an HF name may be found instead."""


# -- text decoders -----------------------------------------------------------------


def _qkv_rows(a: ModelArch) -> int:
    return (a.num_attention_heads + 2 * a.num_kv_heads) * a.head_dim


def _vocab(a: ModelArch) -> int:
    return a.vocab_size


def _dense_layer(a: ModelArch, layer: int) -> bool:
    return not a.is_moe_layer(layer)


def _moe_layer(a: ModelArch, layer: int) -> bool:
    return a.is_moe_layer(layer)


@dataclass(frozen=True)
class MoENames:
    """Where a family's HF checkpoint keeps a sparse layer's tensors (under ``model.layers.{layer}.``)."""

    block: str
    """The sparse MLP module: ``mlp`` (Qwen) or ``block_sparse_moe`` (Mixtral)."""
    gate: str
    up: str
    down: str
    """An expert's projections: ``gate_proj``/``up_proj``/``down_proj`` (Qwen) or ``w1``/``w3``/``w2`` (Mixtral)."""


QWEN_MOE = MoENames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_MOE = MoENames("block_sparse_moe", "w1", "w3", "w2")


def _moe_layer_rules(L: str, H: str, names: MoENames) -> tuple[ParamRule, ...]:
    """A sparse layer's router, routed experts and (Qwen2-MoE) gated shared expert."""
    X = H + f"{names.block}.experts.{{expert}}."

    def rule(mcore, hf, layout, tp_dim, shape, **kw) -> ParamRule:
        return ParamRule(mcore, hf, layout, tp_dim, shape, on_layer=_moe_layer, **kw)

    def shared(a: ModelArch) -> bool:
        return a.moe.shared_expert_ffn_hidden_size is not None

    return (
        # The norm before the experts is a module of its own with either spec; the local spec's
        # checkpoint spells it like the dense layer's fused norm. Names: local module, local
        # checkpoint key, transformer-engine module (last, as ``fused_norms`` expects).
        rule((L + "pre_mlp_layernorm.weight", L + "mlp.linear_fc1.layer_norm_weight", L + "pre_mlp_layernorm.weight"),
             (H + "post_attention_layernorm.weight",), Layout.COPY, None, lambda a, tp: (a.hidden_size,)),
        rule((L + "mlp.router.weight",), (H + f"{names.block}.gate.weight",), Layout.COPY, None,
             lambda a, tp: (a.moe.num_experts, a.hidden_size)),
        rule((L + "mlp.experts.local_experts.{expert}.linear_fc1.weight", L + "mlp.experts.linear_fc1.weight{expert}"),
             (X + f"{names.gate}.weight", X + f"{names.up}.weight"), Layout.GATE_UP, 0,
             lambda a, tp: (2 * a.moe.ffn_hidden_size, a.hidden_size), expert=True),
        rule((L + "mlp.experts.local_experts.{expert}.linear_fc2.weight", L + "mlp.experts.linear_fc2.weight{expert}"),
             (X + f"{names.down}.weight",), Layout.COPY, 1,
             lambda a, tp: (a.hidden_size, a.moe.ffn_hidden_size), expert=True),
        rule((L + "mlp.shared_experts.linear_fc1.weight",),
             (H + "mlp.shared_expert.gate_proj.weight", H + "mlp.shared_expert.up_proj.weight"), Layout.GATE_UP, 0,
             lambda a, tp: (2 * a.moe.shared_expert_ffn_hidden_size, a.hidden_size), when=shared),
        rule((L + "mlp.shared_experts.linear_fc2.weight",), (H + "mlp.shared_expert.down_proj.weight",), Layout.COPY,
             1, lambda a, tp: (a.hidden_size, a.moe.shared_expert_ffn_hidden_size), when=shared),
        rule((L + "mlp.shared_experts.gate_weight",), (H + "mlp.shared_expert_gate.weight",), Layout.COPY, None,
             lambda a, tp: (1, a.hidden_size), when=shared),
    )  # fmt: skip


def decoder_rules(prefix: str = "", moe: MoENames | None = None) -> tuple[ParamRule, ...]:
    """A Llama-style decoder; megatron names under ``prefix`` (the vision-language wrapper's
    ``language_model.``), HF names as the hub stores them. ``moe``: the sparse layers' HF names
    of a mixture-of-experts family (its dense layers keep the plain MLP)."""
    e, L, H = prefix, prefix + "decoder.layers.{layer}.", "model.layers.{layer}."
    return (
        ParamRule(
            (e + "embedding.word_embeddings.weight",),
            ("model.embed_tokens.weight",),
            Layout.COPY,
            0,
            lambda a, tp: (a.padded_vocab_size(tp), a.hidden_size),
            hf_size=_vocab,
        ),
        ParamRule(
            (L + "input_layernorm.weight", L + "self_attention.linear_qkv.layer_norm_weight"),
            (H + "input_layernorm.weight",),
            Layout.COPY,
            None,
            lambda a, tp: (a.hidden_size,),
        ),
        ParamRule(
            (L + "self_attention.linear_qkv.weight",),
            tuple(H + f"self_attn.{p}_proj.weight" for p in "qkv"),
            Layout.QKV,
            0,
            lambda a, tp: (_qkv_rows(a), a.hidden_size),
        ),
        ParamRule(
            (L + "self_attention.linear_qkv.bias",),
            tuple(H + f"self_attn.{p}_proj.bias" for p in "qkv"),
            Layout.QKV,
            0,
            lambda a, tp: (_qkv_rows(a),),
            when=lambda a: a.qkv_bias,
        ),
        ParamRule(
            (L + "self_attention.q_layernorm.weight",),
            (H + "self_attn.q_norm.weight",),
            Layout.COPY,
            None,
            lambda a, tp: (a.head_dim,),
            when=lambda a: a.qk_norm,
        ),
        ParamRule(
            (L + "self_attention.k_layernorm.weight",),
            (H + "self_attn.k_norm.weight",),
            Layout.COPY,
            None,
            lambda a, tp: (a.head_dim,),
            when=lambda a: a.qk_norm,
        ),
        ParamRule(
            (L + "self_attention.linear_proj.weight",),
            (H + "self_attn.o_proj.weight",),
            Layout.COPY,
            1,
            lambda a, tp: (a.hidden_size, a.num_attention_heads * a.head_dim),
        ),
        ParamRule(
            (L + "pre_mlp_layernorm.weight", L + "mlp.linear_fc1.layer_norm_weight"),
            (H + "post_attention_layernorm.weight",),
            Layout.COPY,
            None,
            lambda a, tp: (a.hidden_size,),
            on_layer=_dense_layer,
        ),
        ParamRule(
            (L + "mlp.linear_fc1.weight",),
            (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"),
            Layout.GATE_UP,
            0,
            lambda a, tp: (2 * a.ffn_hidden_size, a.hidden_size),
            on_layer=_dense_layer,
        ),
        ParamRule(
            (L + "mlp.linear_fc2.weight",),
            (H + "mlp.down_proj.weight",),
            Layout.COPY,
            1,
            lambda a, tp: (a.hidden_size, a.ffn_hidden_size),
            on_layer=_dense_layer,
        ),
        *(_moe_layer_rules(L, H, moe) if moe is not None else ()),
        ParamRule(
            (e + "decoder.final_layernorm.weight",),
            ("model.norm.weight",),
            Layout.COPY,
            None,
            lambda a, tp: (a.hidden_size,),
        ),
        ParamRule(
            (e + "output_layer.weight",),
            ("lm_head.weight",),
            Layout.COPY,
            0,
            lambda a, tp: (a.padded_vocab_size(tp), a.hidden_size),
            when=lambda a: a.head == "lm" and not a.tie_word_embeddings,
            hf_size=_vocab,
        ),
        # Tied embeddings: the last pipeline stage keeps its own copy of the
        # embedding as output layer (megatron syncs the two); it is loaded from the
        # embedding and not exported, as HF stores the tensor once.
        ParamRule(
            (e + "output_layer.weight",),
            ("model.embed_tokens.weight",),
            Layout.COPY,
            0,
            lambda a, tp: (a.padded_vocab_size(tp), a.hidden_size),
            when=lambda a: a.head == "lm" and a.tie_word_embeddings,
            exported=False,
            hf_size=_vocab,
        ),
        # Critic / reward model: a one-output head, replicated on every TP rank
        # (see heads.py), stored like HF's *ForTokenClassification / *ForSequenceClassification.
        ParamRule(
            (e + "output_layer.weight",),
            ("score.weight",),
            Layout.COPY,
            None,
            lambda a, tp: (1, a.hidden_size),
            when=lambda a: a.head != "lm",
        ),
        ParamRule(
            (e + "output_layer.bias",),
            ("score.bias",),
            Layout.COPY,
            None,
            lambda a, tp: (1,),
            when=lambda a: a.head != "lm" and a.head_bias,
        ),
    )


# -- the vision tower (Qwen2-VL, Qwen2.5-VL) -------------------------------------------


def _layernorm(a: ModelArch) -> bool:
    return a.vision.norm == "layernorm"


def _swiglu(a: ModelArch) -> bool:
    return a.vision.mlp == "swiglu"


def _quick_gelu(a: ModelArch) -> bool:
    return a.vision.mlp == "quick_gelu"


def _vh(a: ModelArch) -> int:
    return a.vision.hidden_size


def _vffn(a: ModelArch, tp: int) -> int:
    return a.vision.padded_intermediate_size(tp)


def _vffn_hf(a: ModelArch) -> int:
    return a.vision.intermediate_size


def _norm_rules(mcore: tuple[str, ...], hf: str) -> tuple[ParamRule, ...]:
    """A vision norm: its weight, and its bias when it is a LayerNorm (Qwen2-VL)."""
    bias = tuple(m.removesuffix("weight") + "bias" for m in mcore)  # layer_norm_weight -> layer_norm_bias
    return (
        ParamRule(mcore, (hf + ".weight",), Layout.COPY, None, lambda a, tp: (_vh(a),)),
        ParamRule(bias, (hf + ".bias",), Layout.COPY, None, lambda a, tp: (_vh(a),), when=_layernorm),
    )


def vision_rules() -> tuple[ParamRule, ...]:
    """The vision tower under ``vision_model.``: megatron TransformerLayers as ``decoder.layers.{block}``."""
    V, H = "vision_model.decoder.layers.{block}.", "visual.blocks.{block}."

    def rule(mcore, hf, layout, tp_dim, shape, **kw) -> ParamRule:
        return ParamRule((V + mcore,), tuple(H + h for h in hf), layout, tp_dim, shape, **kw)

    return (
        ParamRule(
            ("vision_model.patch_embed.weight",),
            ("visual.patch_embed.proj.weight",),
            Layout.COPY,
            None,
            lambda a, tp: (
                _vh(a),
                a.vision.in_channels,
                a.vision.temporal_patch_size,
                *[a.vision.patch_size] * 2,
            ),
        ),
        *_norm_rules(
            (V + "input_layernorm.weight", V + "self_attention.linear_qkv.layer_norm_weight"), H + "norm1"
        ),
        rule(
            "self_attention.linear_qkv.weight",
            ("attn.qkv.weight",),
            Layout.QKV,
            0,
            lambda a, tp: (3 * _vh(a), _vh(a)),
            qkv=_vision_qkv,
        ),
        rule(
            "self_attention.linear_qkv.bias",
            ("attn.qkv.bias",),
            Layout.QKV,
            0,
            lambda a, tp: (3 * _vh(a),),
            qkv=_vision_qkv,
        ),
        rule(
            "self_attention.linear_proj.weight",
            ("attn.proj.weight",),
            Layout.COPY,
            1,
            lambda a, tp: (_vh(a), _vh(a)),
        ),
        rule(
            "self_attention.linear_proj.bias", ("attn.proj.bias",), Layout.COPY, None, lambda a, tp: (_vh(a),)
        ),
        *_norm_rules((V + "pre_mlp_layernorm.weight", V + "mlp.linear_fc1.layer_norm_weight"), H + "norm2"),
        # Qwen2.5-VL: SwiGLU with biases.
        rule(
            "mlp.linear_fc1.weight",
            ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            Layout.GATE_UP,
            0,
            lambda a, tp: (2 * _vffn(a, tp), _vh(a)),
            when=_swiglu,
            hf_size=_vffn_hf,
        ),
        rule(
            "mlp.linear_fc1.bias",
            ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
            Layout.GATE_UP,
            0,
            lambda a, tp: (2 * _vffn(a, tp),),
            when=_swiglu,
            hf_size=_vffn_hf,
        ),
        rule(
            "mlp.linear_fc2.weight",
            ("mlp.down_proj.weight",),
            Layout.COPY,
            1,
            lambda a, tp: (_vh(a), _vffn(a, tp)),
            when=_swiglu,
            hf_size=_vffn_hf,
        ),
        rule(
            "mlp.linear_fc2.bias",
            ("mlp.down_proj.bias",),
            Layout.COPY,
            None,
            lambda a, tp: (_vh(a),),
            when=_swiglu,
        ),
        # Qwen2-VL: fc1 -> QuickGELU -> fc2.
        rule(
            "mlp.linear_fc1.weight",
            ("mlp.fc1.weight",),
            Layout.COPY,
            0,
            lambda a, tp: (_vffn(a, tp), _vh(a)),
            when=_quick_gelu,
            hf_size=_vffn_hf,
        ),
        rule(
            "mlp.linear_fc1.bias",
            ("mlp.fc1.bias",),
            Layout.COPY,
            0,
            lambda a, tp: (_vffn(a, tp),),
            when=_quick_gelu,
            hf_size=_vffn_hf,
        ),
        rule(
            "mlp.linear_fc2.weight",
            ("mlp.fc2.weight",),
            Layout.COPY,
            1,
            lambda a, tp: (_vh(a), _vffn(a, tp)),
            when=_quick_gelu,
            hf_size=_vffn_hf,
        ),
        rule(
            "mlp.linear_fc2.bias",
            ("mlp.fc2.bias",),
            Layout.COPY,
            None,
            lambda a, tp: (_vh(a),),
            when=_quick_gelu,
        ),
        # The merger: norm, then a column-parallel fc1 -> GELU -> row-parallel fc2 over m x m patches.
        *_norm_rules(("vision_model.merger.ln_q.weight",), "visual.merger.ln_q"),
        ParamRule(
            ("vision_model.merger.mlp.linear_fc1.weight",),
            ("visual.merger.mlp.0.weight",),
            Layout.COPY,
            0,
            lambda a, tp: (a.vision.merged_hidden_size,) * 2,
        ),
        ParamRule(
            ("vision_model.merger.mlp.linear_fc1.bias",),
            ("visual.merger.mlp.0.bias",),
            Layout.COPY,
            0,
            lambda a, tp: (a.vision.merged_hidden_size,),
        ),
        ParamRule(
            ("vision_model.merger.mlp.linear_fc2.weight",),
            ("visual.merger.mlp.2.weight",),
            Layout.COPY,
            1,
            lambda a, tp: (a.vision.out_hidden_size, a.vision.merged_hidden_size),
        ),
        ParamRule(
            ("vision_model.merger.mlp.linear_fc2.bias",),
            ("visual.merger.mlp.2.bias",),
            Layout.COPY,
            None,
            lambda a, tp: (a.vision.out_hidden_size,),
        ),
    )


_TEXT_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_MOE_TYPES = {"qwen2_moe": QWEN_MOE, "qwen3_moe": QWEN_MOE, "mixtral": MIXTRAL_MOE}
_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
_VL_SPEC = ArchSpec(
    _VL_TYPES,
    vision_rules() + decoder_rules("language_model."),
    # transformers 5.x may save the tower and the language model under model.*.
    hf_aliases=(("visual.", "model.visual."), ("model.", "model.language_model.")),
)
SPECS: dict[str, ArchSpec] = {
    **{t: ArchSpec((t,), decoder_rules()) for t in _TEXT_TYPES},
    **{t: ArchSpec((t,), decoder_rules(moe=names)) for t, names in _MOE_TYPES.items()},
    **dict.fromkeys(_VL_TYPES, _VL_SPEC),
}
