"""What a Hugging Face ``config.json`` says about a model, in one typed object.

``ModelArch`` is the project's single description of a model: validation and the
memory planner (``config/``) read it before any process starts, ``models/`` builds a
megatron-core ``TransformerConfig`` from it, the HF⇄mcore spec uses it for tensor
shapes and layouts, the weight converter (``weights/``) for its plan, and
checkpoints store it as JSON. A preset's ``model_arch`` section and a checkpoint's
``config.json`` are parsed by the same ``from_hf_config``.

Supported families (causal LM, plus the token/sequence-classification variants
used for critics and reward models): Llama 2/3/3.x, Mistral, Qwen2/Qwen2.5,
Qwen3; the mixture-of-experts Qwen2-MoE, Qwen3-MoE and Mixtral (top-k softmax
routers over SwiGLU experts, described by ``MoEArch``) and GLM-4.5 (``Glm4MoeForCausalLM``:
DeepSeekMoE's sigmoid router with a score-correction bias, group-limited top-k and shared
experts, over grouped-query attention with partial rotary and optional q/k norms); and the
vision-language
Qwen2-VL and Qwen2.5-VL (``*ForConditionalGeneration``: a Qwen2 language model
with M-RoPE plus a vision tower, described by ``VisionArch``) and Qwen3-VL (a Qwen3 language
model with interleaved M-RoPE and DeepStack features from the tower) with its
mixture-of-experts sibling Qwen3-VL-MoE (Qwen3-VL-30B-A3B, 235B-A22B: a Qwen3-MoE language model,
whose router always renormalises its top-k). Anything else is rejected here, with the list of what
is supported, so an unsupported model never reaches megatron.

Vision-language configs come in two layouts, both accepted: the hub's (text keys at
the top level, ``rope_scaling: {type: mrope, mrope_section}``, ``vision_config``) and
transformers 5.x's ``save_pretrained`` (``text_config`` / ``vision_config``,
``rope_parameters`` holding ``mrope_section``).

This module reads JSON only; it imports neither megatron nor transformers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HeadKind",
    "MLAArch",
    "MoEArch",
    "ModelArch",
    "RopeScaling",
    "UnsupportedModelError",
    "VisionArch",
]

HeadKind = Literal["lm", "value", "reward"]
"""What sits on top of the final norm: ``lm`` = vocabulary logits, ``value`` =
one scalar per token (PPO critic), ``reward`` = one scalar per token of which
the caller reads the last valid one (reward model)."""

_TEXT_HEADS: dict[str, HeadKind] = {
    "ForCausalLM": "lm",
    "ForTokenClassification": "value",
    "ForSequenceClassification": "reward",
}
_VL_HEADS: dict[str, HeadKind] = {"ForConditionalGeneration": "lm"}


@dataclass(frozen=True)
class _Family:
    prefix: str
    """HF class-name prefix, e.g. ``Qwen2``."""
    qkv_bias: bool
    qk_norm: bool
    heads: dict[str, HeadKind]
    """HF class-name suffix -> head, for the classes config.json may name."""
    vision: bool = False
    norm_eps: float = 1e-6
    """transformers' default ``rms_norm_eps`` when config.json omits it."""
    moe: bool = False
    """Mixture-of-experts MLPs (read by ``_moe_arch``)."""


# The text families differ only in the switches; everything else is shared.
_FAMILIES: dict[str, _Family] = {
    "llama": _Family("Llama", False, False, _TEXT_HEADS),
    "mistral": _Family("Mistral", False, False, _TEXT_HEADS),
    "qwen2": _Family("Qwen2", True, False, _TEXT_HEADS),
    "qwen3": _Family("Qwen3", False, True, _TEXT_HEADS),
    "qwen2_moe": _Family("Qwen2Moe", True, False, _TEXT_HEADS, moe=True),
    "qwen3_moe": _Family("Qwen3Moe", False, True, _TEXT_HEADS, moe=True),
    "mixtral": _Family("Mixtral", False, False, _TEXT_HEADS, norm_eps=1e-5, moe=True),
    "deepseek_v3": _Family("DeepseekV3", False, False, _TEXT_HEADS, moe=True),
    "glm4_moe": _Family("Glm4Moe", False, False, _TEXT_HEADS, norm_eps=1e-5, moe=True),
    "qwen2_vl": _Family("Qwen2VL", True, False, _VL_HEADS, vision=True, norm_eps=1e-5),
    "qwen2_5_vl": _Family("Qwen2_5_VL", True, False, _VL_HEADS, vision=True, norm_eps=1e-5),
    "qwen3_vl": _Family("Qwen3VL", False, True, _VL_HEADS, vision=True),
    "qwen3_vl_moe": _Family("Qwen3VLMoe", False, True, _VL_HEADS, vision=True, moe=True),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(
    f.prefix + suffix for f in _FAMILIES.values() for suffix in f.heads
)
# model_type spellings of a family's configs (Kimi-K2 ships DeepseekV3ForCausalLM as kimi_k2).
_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
# Families whose routers are DeepSeekMoE's: sigmoid scores, score-correction bias, groups.
_SIGMOID_ROUTER_FAMILIES = ("deepseek_v3", "glm4_moe")
# Qwen3-VL's tower, interleaved M-RoPE and frames apart, on a dense or a mixture-of-experts decoder.
_QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# Critic/reward variants of any family (for a vision-language family they exist only
# inside this project: HF has no such class).
_SCALAR_HEAD_SUFFIXES = {"value": "ForTokenClassification", "reward": "ForSequenceClassification"}

# megatron-core 0.16's RotaryEmbedding._apply_scaling is called with the factor
# only; the other llama3 parameters are fixed at these values inside megatron.
_MCORE_LLAMA3_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# transformers' defaults for the Qwen-VL token ids, used when config.json omits them.
_VL_TOKEN_DEFAULTS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
# The vision MLP is padded to a multiple of lcm(this, TP): Qwen2.5-VL's 3420 is not
# divisible by 8; with a TP-independent multiple the padded size (3424) is the same
# at TP 1, 2, 4, 8 and 16, so distributed checkpoints reshard across those sizes.
VISION_FFN_MULTIPLE = 8

_REQUIRED_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


class UnsupportedModelError(ValueError):
    """The HF config describes a model (or a setting) that this project cannot build."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, in HF's terms.

    ``llama3`` matches megatron's ``rope_scaling=True`` (only with megatron's
    fixed low/high frequency factors 1 and 4 and original context 8192);
    ``linear`` matches megatron's ``seq_len_interpolation_factor``; ``yarn`` (multi-latent
    attention only) matches megatron's ``YarnRotaryEmbedding``: frequencies blended between
    ``beta_fast`` and ``beta_slow`` rotations, cos/sin scaled by
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the softmax by
    ``mscale(factor, mscale_all_dim)^2``, as DeepSeek's reference code does.
    """

    rope_type: Literal["llama3", "linear", "yarn"]
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class MLAArch:
    """Multi-latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight).

    Queries go through a low-rank bottleneck (``q_a_proj`` -> RMSNorm -> ``q_b_proj``), or
    one ``q_proj`` when ``q_lora_rank`` is None; keys and values share one compressed
    latent (``kv_a_proj_with_mqa`` -> RMSNorm -> ``kv_b_proj``) plus a single rotary key
    part shared by every head. Each head's query/key is ``[nope | rope]``.
    """

    q_lora_rank: int | None
    """Query bottleneck width; None = a plain ``q_proj``."""
    kv_lora_rank: int
    """Key/value latent width."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary (megatron's ``qk_head_dim``)."""
    qk_rope_head_dim: int
    """Per-head rotary width (megatron's ``qk_pos_emb_head_dim``)."""
    v_head_dim: int
    rope_interleave: bool = True
    """HF stores the rotary rows in interleaved pairs (``rope_interleave``, DeepSeek's default);
    megatron's MLA de-interleaves them itself, so only halves (False) are reordered (``spec_rules``)."""

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class VisionArch:
    """The vision tower of Qwen2-VL / Qwen2.5-VL / Qwen3-VL (HF ``vision_config``)."""

    depth: int
    """Transformer blocks."""
    hidden_size: int
    """Block width (Qwen2-VL's ``embed_dim``)."""
    num_heads: int
    intermediate_size: int
    """MLP width as HF stores it (megatron pads it, see ``padded_intermediate_size``)."""
    out_hidden_size: int
    """Width of the merged image tokens: the language model's hidden size."""
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    """``m``: the merger turns ``m x m`` neighbouring patches into one LM token."""
    in_channels: int
    window_size: int | None
    """Windowed attention span in pixels (Qwen2.5-VL); None = every block attends over the whole image."""
    fullatt_block_indexes: tuple[int, ...]
    """Blocks attending over the whole image (every block when ``window_size`` is None)."""
    norm: Literal["rmsnorm", "layernorm"]
    """Block and merger norms: RMSNorm (Qwen2.5-VL) or LayerNorm with bias (Qwen2-VL, Qwen3-VL)."""
    mlp: Literal["swiglu", "quick_gelu", "gelu_tanh"]
    """SwiGLU with biases (Qwen2.5-VL), fc1 -> QuickGELU -> fc2 (Qwen2-VL) or fc1 -> tanh-GELU ->
    fc2 (Qwen3-VL's ``gelu_pytorch_tanh``)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tokens_per_second: float | None = None
    """Qwen2.5-VL: M-RoPE time positions per second of video (a video's temporal patch ``k``
    sits at ``int(k * second_per_grid * tokens_per_second)``); None: one per patch (Qwen2-VL)."""
    patch_bias: bool = False
    """The patch embedding (HF's Conv3d) has a bias (Qwen3-VL)."""
    num_position_embeddings: int | None = None
    """Qwen3-VL: a learned ``sqrt(n) x sqrt(n)`` grid of position embeddings, bilinearly
    resampled to each image's patch grid and added after the patch embedding; None: none."""
    deepstack_visual_indexes: tuple[int, ...] = ()
    """Qwen3-VL's DeepStack: after each of these blocks a merger of its own (LayerNorm over the
    ``m x m`` patches side by side) turns the block's output into LM-width features, which are
    added to the visual tokens' hidden states after decoder layer 0, 1, ... in order."""
    frames_apart: bool = False
    """Qwen3-VL: each video frame is its own run of video tokens, after a ``<t seconds>``
    timestamp in text; M-RoPE numbers every frame as a one-frame image (no time scaling)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch in ``pixel_values``: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_hidden_size(self) -> int:
        """The merger MLP's input: ``m x m`` patches side by side."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def window_tokens(self) -> int | None:
        """Window side in merged tokens (transformers' ``window_size // merge // patch``)."""
        if self.window_size is None:
            return None
        return self.window_size // self.spatial_merge_size // self.patch_size

    def full_attention(self, block: int) -> bool:
        return block in self.fullatt_block_indexes

    def padded_intermediate_size(self, tp_size: int = 1) -> int:
        """MLP rows megatron holds: a multiple of lcm(8, TP); the extra rows and columns are zero
        (exact: they contribute act(0) x 0 = 0 and get zero gradients) and trimmed on export."""
        multiple = math.lcm(VISION_FFN_MULTIPLE, tp_size)
        return -(-self.intermediate_size // multiple) * multiple


@dataclass(frozen=True)
class MoEArch:
    """The mixture-of-experts MLPs of Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3 and GLM-4.5.

    A sparse layer routes each token to ``top_k`` of ``num_experts`` SwiGLU experts:
    router logits in fp32, softmax, top-k (renormalised over the k when ``norm_topk_prob``),
    the experts' outputs summed with those weights. Qwen2-MoE adds a shared expert on
    every token, scaled by ``sigmoid(shared_expert_gate(x))``. DeepSeek-V3 and GLM-4.5 route
    on sigmoid scores instead (``score_function``, ``expert_bias``, groups, scaling factor) and
    add ungated shared experts. Layers not in ``moe_layers`` are dense
    (``ModelArch.ffn_hidden_size``).
    """

    num_experts: int
    top_k: int
    """Experts per token (HF ``num_experts_per_tok``)."""
    ffn_hidden_size: int
    """Width of one expert (HF ``moe_intermediate_size``; Mixtral's ``intermediate_size``)."""
    norm_topk_prob: bool
    """Renormalise the top-k probabilities to sum to 1 (Mixtral always does)."""
    aux_loss_coef: float
    """Load-balancing loss coefficient (HF ``router_aux_loss_coef``)."""
    moe_layers: tuple[int, ...]
    """The sparse layers (HF: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Width of the shared expert(s) every token goes through (Qwen2-MoE's
    ``shared_expert_intermediate_size``; DeepSeek's and GLM-4.5's ``n_shared_experts x
    moe_intermediate_size``); None without one."""
    shared_expert_gate: bool = True
    """The shared expert's output is scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE);
    False: added as is (DeepSeek, GLM-4.5)."""
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over the experts (Qwen, Mixtral) or a sigmoid per expert
    (DeepSeek-V3, GLM-4.5, whose top-k weights are renormalised over the k chosen)."""
    expert_bias: bool = False
    """A per-expert bias added to the sigmoid scores for choosing the experts, not for weighting
    them (HF ``e_score_correction_bias``); loaded from the checkpoint and kept fixed."""
    num_groups: int | None = None
    """Group-limited routing: the experts form this many equal groups (HF ``n_group``)..."""
    group_topk: int | None = None
    """...and each token picks among the experts of its best ``topk_group`` groups, a group
    scored by the sum of its two best (bias-corrected) scores. None: no groups."""
    routed_scaling_factor: float | None = None
    """The routed experts' weights are multiplied by this (HF ``routed_scaling_factor``)."""

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer (optionally with a vision tower) as described by an HF ``config.json``."""

    architecture: str
    """HF class name, e.g. ``LlamaForCausalLM`` (one of ``SUPPORTED_ARCHITECTURES``)."""
    model_type: str
    """HF ``model_type``: ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``qwen2_moe``, ``qwen3_moe``,
    ``mixtral``, ``deepseek_v3`` (Kimi-K2's ``kimi_k2`` too), ``glm4_moe``, ``qwen2_vl``, ``qwen2_5_vl``,
    ``qwen3_vl`` or ``qwen3_vl_moe``."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    """Key/value heads (= megatron's ``num_query_groups``); equal to the query heads without GQA."""
    head_dim: int
    """Per-head width (megatron's ``kv_channels``); Qwen3 and Mistral may set it apart from hidden/heads."""
    ffn_hidden_size: int
    vocab_size: int
    """Vocabulary size of the HF checkpoint (unpadded)."""
    tie_word_embeddings: bool
    qkv_bias: bool
    """Biases on q, k and v projections (Qwen2), none on the output projection."""
    qk_norm: bool
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    rope_theta: float
    rope_scaling: RopeScaling | None
    norm_eps: float
    max_position_embeddings: int
    sliding_window: int | None = None
    """Attention window (Mistral v0.1): a query attends to keys fewer than this many positions back."""
    head: HeadKind = "lm"
    head_bias: bool = False
    """The value head has a bias (HF ``*ForTokenClassification`` does by default); the others never do."""
    initializer_range: float = 0.02
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times the TP size."""
    vision: VisionArch | None = None
    """The vision tower of a vision-language model; None for text-only models."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE: rotary frequency pairs given to the (time, height, width) position streams;
    sums to head_dim / 2."""
    mrope_interleaved: bool = False
    """Qwen3-VL's interleaved M-RoPE: frequency pair ``j`` follows height when ``j % 3 == 1`` and
    ``j < 3 x mrope_section[1]``, width when ``j % 3 == 2`` and ``j < 3 x mrope_section[2]``,
    time otherwise (Qwen2-VL / Qwen2.5-VL: consecutive sections)."""
    image_token_id: int | None = None
    """The ``<|image_pad|>`` token: one per merged image patch; its embeddings are the vision
    tower's output."""
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    moe: MoEArch | None = None
    """The experts of a mixture-of-experts model; None for dense models."""
    mla: MLAArch | None = None
    """Multi-latent attention (DeepSeek-V3); None for grouped-query attention. With it
    ``num_kv_heads`` equals the query heads and ``head_dim`` is the query/key head width."""
    rotary_percent: float = 1.0
    """Share of each head's dimensions that RoPE rotates, the first ones (GLM-4.5's
    ``partial_rotary_factor``)."""
    mtp_layers: int = 0
    """Next-token-prediction layers after the decoder (HF ``num_nextn_predict_layers``, stored as
    ``model.layers.<num_layers + i>.*``); the engine does not build them: the conversion keeps
    their tensors aside and writes them back on export."""

    # -- derived sizes -------------------------------------------------------

    @property
    def queries_per_group(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_attention_heads // self.num_kv_heads

    @property
    def family(self) -> str:
        """The HF class-name prefix, e.g. ``Qwen2``."""
        return _FAMILIES[self.model_type].prefix

    @property
    def is_vision_language(self) -> bool:
        return self.vision is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) has routed experts."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Rows of megatron's embedding/output layer at TP size ``tp_size``.

        Megatron pads to a multiple of ``make_vocab_size_divisible_by × tp`` so
        every TP rank holds the same number of rows; the padding rows are zero
        and are trimmed on export.
        """
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple

    def with_head(self, head: HeadKind) -> ModelArch:
        """The same body with another head (e.g. a critic built from an actor's checkpoint)."""
        if head not in ("lm", "value", "reward"):
            raise ValueError(f"head must be 'lm', 'value' or 'reward', got {head!r}")
        if head == self.head:
            return self
        lm_suffix = next(iter(_FAMILIES[self.model_type].heads))
        suffix = lm_suffix if head == "lm" else _SCALAR_HEAD_SUFFIXES[head]
        return dataclasses.replace(
            self, head=head, architecture=self.family + suffix, head_bias=head == "value"
        )

    # -- (de)serialisation ---------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelArch:
        data = dict(data)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        if data.get("vision") is not None:
            vision = dict(data["vision"])
            vision["fullatt_block_indexes"] = tuple(vision["fullatt_block_indexes"])
            vision["deepstack_visual_indexes"] = tuple(vision.get("deepstack_visual_indexes", ()))
            data["vision"] = VisionArch(**vision)
        if data.get("mrope_section") is not None:
            data["mrope_section"] = tuple(data["mrope_section"])
        if data.get("moe") is not None:
            data["moe"] = MoEArch(**{**data["moe"], "moe_layers": tuple(data["moe"]["moe_layers"])})
        if data.get("mla") is not None:
            data["mla"] = MLAArch(**data["mla"])
        return cls(**data)

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path, head: HeadKind | None = None) -> ModelArch:
        """Read ``<hf_dir>/config.json``."""
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist; pass a Hugging Face model directory")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from e
        return cls.from_hf_config(config, head=head, source=str(path))

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], head: HeadKind | None = None, source: str = "config.json"
    ) -> ModelArch:
        """Parse an HF config dict; ``head`` overrides the head implied by ``architectures``."""
        architecture = _architecture(config, source)
        model_type = config.get("model_type") or _model_type_of(architecture)
        model_type = _MODEL_TYPE_ALIASES.get(model_type, model_type)
        if model_type not in _FAMILIES:
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} is not supported; supported architectures: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = _FAMILIES[model_type]
        if architecture not in [family.prefix + s for s in family.heads]:
            raise UnsupportedModelError(
                f"{source}: architectures[0] is {architecture!r} but model_type is {model_type!r}; "
                "the two must name the same family"
            )
        head_of_config = family.heads[architecture[len(family.prefix) :]]
        text = _text_config(config) if family.vision else config
        _reject_unsupported_options(text, family, model_type, source)

        missing = [k for k in _REQUIRED_KEYS if text.get(k) is None]
        if missing:
            raise UnsupportedModelError(f"{source}: required key(s) {', '.join(map(repr, missing))} missing")
        if model_type == "qwen3_vl_moe":
            _check_qwen3_vl_moe(config, text, source)

        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        mla = _mla_arch(text, source) if model_type == "deepseek_v3" else None
        # MLA has no key/value heads to share: every query head has its own key and value.
        kv_heads = heads if mla else int(text.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        # transformers' Qwen2-VL attention derives head_dim from hidden / heads, whatever config says.
        qwen2_vision = model_type in ("qwen2_vl", "qwen2_5_vl")
        head_dim = hidden // heads if qwen2_vision else int(text.get("head_dim") or hidden // heads)
        if mla is not None:
            head_dim = mla.q_head_dim  # HF's head_dim there is the rotary part only
        theta, scaling = _rope(text, source, allow_mrope=family.vision, allow_yarn=mla is not None)
        moe = _moe_arch(text, model_type, source) if family.moe else None
        arch = cls(
            architecture=architecture,
            model_type=model_type,
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            ffn_hidden_size=int(text["intermediate_size"]),
            vocab_size=int(text["vocab_size"]),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            # Qwen2-MoE's config may switch its q/k/v biases off (``qkv_bias``).
            qkv_bias=_qkv_bias(text, family, model_type),
            qk_norm=bool(text.get("use_qk_norm", False)) if model_type == "glm4_moe" else family.qk_norm,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(text.get("rms_norm_eps", family.norm_eps)),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            sliding_window=_sliding_window(text, model_type, source),
            head=head_of_config,
            head_bias=head_of_config == "value" and bool(text.get("token_classification_bias", True)),
            initializer_range=float(text.get("initializer_range", 0.02)),
            moe=moe,
            mla=mla,
            rotary_percent=_rotary_percent(text, model_type, source),
            mtp_layers=_mtp_layers(text),
            **(_vision_fields(config, text, model_type, hidden, head_dim, source) if family.vision else {}),
        )
        return arch.with_head(head) if head is not None else arch


def _architecture(config: dict[str, Any], source: str) -> str:
    archs = config.get("architectures") or []
    if not archs:
        model_type = config.get("model_type")
        if model_type in _FAMILIES:
            family = _FAMILIES[model_type]
            return family.prefix + next(iter(family.heads))
        raise UnsupportedModelError(
            f"{source}: neither 'architectures' nor a supported 'model_type' is set "
            f"(model_type={model_type!r}); supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architecture {archs[0]!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def _model_type_of(architecture: str) -> str:
    for model_type, family in _FAMILIES.items():
        if architecture in [family.prefix + s for s in family.heads]:
            return model_type
    raise AssertionError(architecture)  # _architecture() already validated it


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's keys of a vision-language config, from either layout.

    transformers 5.x nests them under ``text_config``; the hub's configs keep them at the
    top level. Top-level keys are the base and ``text_config`` wins, except that the
    embeddings count as tied when either level says so (as ``Qwen2_5_VLConfig`` does).
    """
    nested = config.get("text_config") or {}
    skip = ("text_config", "vision_config", "model_type", "architectures")
    text = {k: v for k, v in config.items() if k not in skip}
    text.update({k: v for k, v in nested.items() if k not in skip})
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings") or nested.get("tie_word_embeddings"))
    return text


def _reject_unsupported_options(
    config: dict[str, Any], family: _Family, model_type: str, source: str
) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(
            f"{source}: hidden_act {act!r} is not supported (only 'silu', i.e. SwiGLU)"
        )
    # Llama/Mistral/Qwen3 put attention_bias on q, k, v *and* o; megatron can
    # only bias o together with every MLP linear (add_bias_linear), so refuse.
    # (GLM-4.5's attention_bias is on q, k and v only.)
    if not family.qkv_bias and model_type != "glm4_moe" and config.get("attention_bias"):
        raise UnsupportedModelError(
            f"{source}: attention_bias=true (bias on the output projection) is not supported for {model_type}"
        )
    if config.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method", "?")
        raise UnsupportedModelError(
            f"{source}: quantization_config ({method}) is set, but the engine trains unquantised weights; "
            "convert the checkpoint to bf16 (e.g. DeepSeek's fp8_cast_bf16.py) and remove quantization_config"
        )


def _qkv_bias(config: dict[str, Any], family: _Family, model_type: str) -> bool:
    if model_type == "qwen2_moe":  # Qwen2-MoE's config may switch its q/k/v biases off
        return bool(config.get("qkv_bias", True))
    if model_type == "glm4_moe":
        return bool(config.get("attention_bias", False))
    return family.qkv_bias


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE keys from either transformers-5 ``rope_parameters`` or 4.x ``rope_scaling`` (the first wins)."""
    return {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}


def _rotary_percent(config: dict[str, Any], model_type: str, source: str) -> float:
    if model_type != "glm4_moe":
        return 1.0
    # transformers' Glm4MoeConfig default is 0.5 (GLM-4.5 ships it)
    factor = float(
        _rope_params(config).get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    )
    if not 0.0 < factor <= 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor {factor} must be in (0, 1]")
    return factor


def _mtp_layers(config: dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0)


def _mla_arch(config: dict[str, Any], source: str) -> MLAArch:
    """``MLAArch`` from a DeepSeek-V3 config (transformers' defaults for missing keys)."""
    q_lora = config.get("q_lora_rank", 1536)
    mla = MLAArch(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(config.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(config.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(config.get("qk_rope_head_dim", 64)),
        v_head_dim=int(config.get("v_head_dim", 128)),
        rope_interleave=bool(config.get("rope_interleave", True)),
    )
    if mla.qk_rope_head_dim % 2 or mla.qk_rope_head_dim <= 0:
        raise UnsupportedModelError(
            f"{source}: qk_rope_head_dim {mla.qk_rope_head_dim} must be a positive even number"
        )
    return mla


def _sliding_window(config: dict[str, Any], model_type: str, source: str) -> int | None:
    window = config.get("sliding_window")
    if model_type.startswith(("qwen2", "qwen3")):
        # Qwen applies the window only from layer max_window_layers on, and only
        # with use_sliding_window; that per-layer pattern is not supported.
        if config.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"{source}: use_sliding_window=true is not supported for {model_type}; set it to false"
            )
        return None
    if window is None or window >= int(config.get("max_position_embeddings", 0) or 0) > 0:
        return None  # the window never bites
    return int(window)


def _rope(
    config: dict[str, Any], source: str, allow_mrope: bool = False, allow_yarn: bool = False
) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling, from either transformers-5 ``rope_parameters`` or 4.x keys.

    M-RoPE (``type: mrope``, vision-language models) is plain RoPE per position stream;
    its sections are read by ``_mrope_section``.
    """
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    scaling = params if params.get("rope_type", "default") != "default" else config.get("rope_scaling")
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default" or (rope_type == "mrope" and allow_mrope):
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    if rope_type == "yarn" and allow_yarn:
        # megatron's YarnRotaryEmbedding rounds the correction range (HF truncate=true), derives the
        # cos/sin factor from mscale and mscale_all_dim (HF does so only when both are set).
        unsupported = {
            k: scaling[k]
            for k in ("attention_factor", "truncate")
            if scaling.get(k) is not None and not (k == "truncate" and scaling[k])
        }
        if not scaling.get("mscale") and scaling.get("mscale_all_dim"):
            unsupported["mscale"] = scaling.get("mscale")
        if unsupported:
            raise UnsupportedModelError(
                f"{source}: yarn RoPE scaling with {unsupported} is not supported by megatron-core's "
                "YarnRotaryEmbedding; remove attention_factor / truncate, or set mscale (1.0) next to mscale_all_dim"
            )
        original = scaling.get("original_max_position_embeddings") or config.get("max_position_embeddings")
        return theta, RopeScaling(
            "yarn",
            float(scaling["factor"]),
            original_max_position_embeddings=int(original or 4096),
            beta_fast=float(scaling.get("beta_fast") or 32.0),
            beta_slow=float(scaling.get("beta_slow") or 1.0),
            mscale=float(scaling.get("mscale") or 1.0),
            mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
        )
    if rope_type == "llama3":
        values = {k: float(scaling.get(k, v)) for k, v in _MCORE_LLAMA3_DEFAULTS.items()}
        wrong = {k: v for k, v in values.items() if v != _MCORE_LLAMA3_DEFAULTS[k]}
        if wrong:
            raise UnsupportedModelError(
                f"{source}: llama3 RoPE scaling with {wrong} is not supported: megatron-core 0.16 "
                f"applies llama3 scaling with fixed {_MCORE_LLAMA3_DEFAULTS} and only the factor free"
            )
        return theta, RopeScaling(
            "llama3",
            float(scaling["factor"]),
            values["low_freq_factor"],
            values["high_freq_factor"],
            int(values["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(
        f"{source}: RoPE scaling type {rope_type!r} is not supported (supported: default, linear, llama3"
        f"{', yarn' if allow_yarn else '; yarn with multi-latent attention (DeepSeek-V3) only'})"
    )


# -- mixture of experts ------------------------------------------------------------


# transformers' defaults for a family's missing MoE keys: (experts, per token, expert width, shared width).
_MOE_DEFAULTS = {
    "mixtral": (8, 2, None, None),
    "qwen2_moe": (60, 4, 1408, 5632),
    "qwen3_moe": (128, 8, 768, None),
    "qwen3_vl_moe": (60, 4, 1408, None),
}


def _moe_arch(config: dict[str, Any], model_type: str, source: str) -> MoEArch:
    """``MoEArch`` from a Qwen2-MoE / Qwen3-MoE / Qwen3-VL-MoE / Mixtral config (transformers' defaults
    for missing keys).

    Hub configs name the expert count ``num_experts`` (Qwen) or ``num_local_experts``
    (Mixtral); transformers 5 writes ``num_local_experts`` for Qwen3-MoE too. Qwen3-VL-MoE's
    router renormalises its top-k whatever ``norm_topk_prob`` says (``_check_qwen3_vl_moe``
    refuses a config saying false, which vLLM would follow).
    """
    if model_type in _SIGMOID_ROUTER_FAMILIES:
        return _deepseek_moe_arch(config, model_type, source)
    experts, top_k, width, shared = _MOE_DEFAULTS[model_type]
    experts = int(config.get("num_experts") or config.get("num_local_experts") or experts)
    top_k = int(config.get("num_experts_per_tok") or top_k)
    layers = int(config["num_hidden_layers"])
    if model_type == "mixtral":
        if float(config.get("router_jitter_noise") or 0.0) > 0:
            raise UnsupportedModelError(
                f"{source}: router_jitter_noise={config['router_jitter_noise']} is not supported (megatron's "
                "jitter multiplies only the router input); set it to 0.0 as Mixtral's release does"
            )
        width, norm, sparse = int(config["intermediate_size"]), True, tuple(range(layers))
    else:
        width, norm = (
            int(config.get("moe_intermediate_size") or width),
            model_type == "qwen3_vl_moe" or bool(config.get("norm_topk_prob", False)),
        )
        step = int(config.get("decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in config.get("mlp_only_layers") or ()}
        bad = sorted(i for i in dense if not 0 <= i < layers)
        if step < 1 or bad:
            raise UnsupportedModelError(
                f"{source}: decoder_sparse_step={step} / mlp_only_layers {bad} do not describe layers "
                f"0..{layers - 1}; decoder_sparse_step must be >= 1 and mlp_only_layers name existing layers"
            )
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if not 1 <= top_k <= experts:
        raise UnsupportedModelError(
            f"{source}: num_experts_per_tok={top_k} must be between 1 and the {experts} experts"
        )
    if model_type == "qwen2_moe":
        shared = config.get("shared_expert_intermediate_size", shared)
    return MoEArch(
        num_experts=experts,
        top_k=top_k,
        ffn_hidden_size=width,
        norm_topk_prob=norm,
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        moe_layers=sparse,
        shared_expert_ffn_hidden_size=int(shared) if shared else None,
    )


def _check_qwen3_vl_moe(config: dict[str, Any], text: dict[str, Any], source: str) -> None:
    """Refuse a Qwen3-VL-MoE config that transformers and vLLM would run as two different models.

    - transformers' router always renormalises the top-k; vLLM follows ``norm_topk_prob``.
    - transformers ties the LM head by the top-level ``tie_word_embeddings`` (default false), vLLM
      by ``text_config.tie_word_embeddings`` (whose transformers default is true).
    - The checkpoint stacks each layer's experts into ``experts.gate_up_proj`` / ``down_proj``,
      the hub as ``[E, hidden, 2 x width]`` / ``[E, width, hidden]``, transformers 5's
      ``save_pretrained`` transposed; the orientation is read from the shape, which a square
      expert (``hidden_size`` equal to ``moe_intermediate_size`` or twice it) leaves ambiguous,
      and transformers and vLLM then read it in opposite ways.
    """
    if text.get("norm_topk_prob") is False:
        raise UnsupportedModelError(
            f"{source}: norm_topk_prob=false is not supported for qwen3_vl_moe: transformers' "
            "Qwen3-VL-MoE router renormalises its top-k whatever the key says and vLLM follows the key; "
            "set text_config.norm_topk_prob to true"
        )
    nested = config.get("text_config")
    top = bool(config.get("tie_word_embeddings", False))
    inner = bool(nested.get("tie_word_embeddings", True)) if nested else top
    if top != inner:
        raise UnsupportedModelError(
            f"{source}: tie_word_embeddings is {str(top).lower()} (transformers ties the LM head by this "
            f"top-level key) but text_config.tie_word_embeddings is {str(inner).lower()} (vLLM ties by it; "
            "transformers' default there is true); set both to the same value"
        )
    hidden = int(text["hidden_size"])
    width = int(text.get("moe_intermediate_size") or _MOE_DEFAULTS["qwen3_vl_moe"][2])
    if hidden in (width, 2 * width):
        raise UnsupportedModelError(
            f"{source}: moe_intermediate_size={width} with hidden_size={hidden} is not supported: the "
            "stacked expert tensors (experts.gate_up_proj, experts.down_proj) are then square per expert, "
            "so their orientation (the hub's [experts, hidden, 2 x width] or transformers 5's transpose) "
            "cannot be told from the shape, and transformers and vLLM read them in opposite ways"
        )


# transformers' defaults: (routed experts, per token, expert width, shared experts, groups,
# groups per token, leading dense layers, routed scaling factor).
_DEEPSEEK_MOE_DEFAULTS = {
    "deepseek_v3": (256, 8, 2048, 1, 8, 4, 3, 2.5),
    "glm4_moe": (128, 8, 1408, 1, 1, 1, 1, 1.0),
}


def _deepseek_moe_arch(config: dict[str, Any], model_type: str, source: str) -> MoEArch:
    """DeepSeekMoE (DeepSeek-V3, GLM-4.5): a sigmoid router whose top-k is chosen on scores plus
    ``e_score_correction_bias`` (within the best ``topk_group`` of ``n_group`` groups), weighted by
    the plain scores renormalised and times ``routed_scaling_factor``; ``n_shared_experts`` shared
    experts on every token; the first ``first_k_dense_replace`` layers dense."""
    experts, top_k, width, shared, groups, group_topk, dense, scale = _DEEPSEEK_MOE_DEFAULTS[model_type]
    experts = int(config.get("n_routed_experts") or config.get("num_local_experts") or experts)
    top_k = int(config.get("num_experts_per_tok") or top_k)
    layers = int(config["num_hidden_layers"])
    topk_method = config.get("topk_method", "noaux_tc")
    if model_type == "deepseek_v3" and topk_method != "noaux_tc":
        raise UnsupportedModelError(
            f"{source}: topk_method {topk_method!r} is not supported; the engine routes as DeepSeek-V3's "
            "'noaux_tc' (sigmoid scores plus e_score_correction_bias, group-limited top-k)"
        )
    scoring = config.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedModelError(
            f"{source}: scoring_func {scoring!r} is not supported for {model_type}; only 'sigmoid' "
            "(DeepSeek-V3's and GLM-4.5's router)"
        )
    if not 1 <= top_k <= experts:
        raise UnsupportedModelError(
            f"{source}: num_experts_per_tok={top_k} must be between 1 and the {experts} experts"
        )
    norm = bool(config.get("norm_topk_prob", True))
    if not norm and top_k > 1:
        raise UnsupportedModelError(
            f"{source}: norm_topk_prob=false with a sigmoid router is not supported (megatron-core "
            "renormalises the chosen sigmoid scores); set norm_topk_prob to true as DeepSeek-V3 and GLM-4.5 ship"
        )
    groups = int(config.get("n_group") or groups)
    group_topk = int(config.get("topk_group") or group_topk)
    # megatron scores a group by the sum of its top (top_k // topk_group) experts, HF by its top 2.
    if groups > 1 and (experts % groups or not 1 <= group_topk <= groups or top_k // group_topk != 2):
        raise UnsupportedModelError(
            f"{source}: n_group={groups} / topk_group={group_topk} with {experts} experts and "
            f"num_experts_per_tok={top_k} is not supported: the groups must split the experts evenly and "
            "num_experts_per_tok // topk_group must be 2 (megatron-core scores a group by the sum of its "
            "best num_experts_per_tok // topk_group experts, transformers by its best 2)"
        )
    dense = int(config.get("first_k_dense_replace", dense) or 0)
    freq = int(config.get("moe_layer_freq", 1) or 1)
    if not 0 <= dense <= layers:
        raise UnsupportedModelError(
            f"{source}: first_k_dense_replace={dense} must be between 0 and num_hidden_layers={layers}"
        )
    shared = int(config.get("n_shared_experts", shared) or 0)
    width = int(config.get("moe_intermediate_size") or width)
    scale = float(config.get("routed_scaling_factor", scale) or 1.0)
    return MoEArch(
        num_experts=experts,
        top_k=top_k,
        ffn_hidden_size=width,
        norm_topk_prob=True,
        # DeepSeek balances through the bias (aux-loss-free), not through an auxiliary loss.
        aux_loss_coef=float(config.get("router_aux_loss_coef") or 0.0),
        moe_layers=tuple(i for i in range(dense, layers) if i % freq == 0),
        shared_expert_ffn_hidden_size=shared * width if shared else None,
        shared_expert_gate=False,
        score_function="sigmoid",
        expert_bias=True,
        num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
        routed_scaling_factor=scale if scale != 1.0 else None,
    )


# -- vision-language -------------------------------------------------------------


def _vision_fields(
    config: dict[str, Any], text: dict[str, Any], model_type: str, hidden: int, head_dim: int, source: str
) -> dict[str, Any]:
    """``vision``, ``mrope_section`` and the special token ids of a Qwen-VL config."""
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    # transformers' default when config.json names no sections.
    section = tuple(int(s) for s in rope.get("mrope_section") or (16, 24, 24))
    if len(section) != 3 or 2 * sum(section) != head_dim:
        raise UnsupportedModelError(
            f"{source}: mrope_section {list(section)} must have 3 entries summing to head_dim / 2 = "
            f"{head_dim // 2} (head_dim = hidden_size / num_attention_heads)"
        )
    vision = _vision_arch(config.get("vision_config"), model_type, source)
    if vision.out_hidden_size != hidden:
        raise UnsupportedModelError(
            f"{source}: the vision merger outputs {vision.out_hidden_size} values per token "
            f"(vision_config.{'hidden_size' if model_type == 'qwen2_vl' else 'out_hidden_size'}) but the "
            f"language model's hidden_size is {hidden}; they must be equal"
        )
    layers = int(text["num_hidden_layers"])
    if len(vision.deepstack_visual_indexes) > layers:
        raise UnsupportedModelError(
            f"{source}: vision_config.deepstack_visual_indexes has {len(vision.deepstack_visual_indexes)} "
            f"entries but the language model has only {layers} layers to add them to"
        )
    tokens = {k: int(config.get(k, text.get(k, v))) for k, v in _VL_TOKEN_DEFAULTS.items()}
    interleaved = model_type in _QWEN3_VL_TYPES
    if interleaved and rope.get("mrope_interleaved") is not True:
        # transformers always interleaves Qwen3-VL's sections; vLLM only when the config says so.
        raise UnsupportedModelError(
            f'{source}: a {model_type} config needs "mrope_interleaved": true in text_config.rope_parameters '
            "(or rope_scaling), as Qwen's released configs have it: without it vLLM rotates the M-RoPE "
            "sections one after another while transformers and the trainer interleave them"
        )
    return {"vision": vision, "mrope_section": section, "mrope_interleaved": interleaved, **tokens}


def _vision_arch(v: dict[str, Any] | None, model_type: str, source: str) -> VisionArch:
    """``vision_config``, with transformers' class defaults for missing keys."""
    if not v:
        raise UnsupportedModelError(f"{source}: a {model_type} config needs a 'vision_config' section")
    rope = v.get("rope_parameters") or {}
    common = dict(
        depth=int(v.get("depth", 32)),
        num_heads=int(v.get("num_heads", 16)),
        patch_size=int(v.get("patch_size", v.get("spatial_patch_size", 14))),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )
    if model_type == "qwen2_5_vl":
        act, want = v.get("hidden_act", "silu"), "silu"
        window = int(v.get("window_size", 112))
        vision = VisionArch(
            hidden_size=int(v.get("hidden_size", 3584)),
            intermediate_size=int(v.get("intermediate_size", 3420)),
            out_hidden_size=int(v.get("out_hidden_size", 3584)),
            window_size=window,
            fullatt_block_indexes=tuple(int(b) for b in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
            norm="rmsnorm",
            mlp="swiglu",
            tokens_per_second=float(v.get("tokens_per_second", 4)),  # transformers' default
            **common,
        )
        if vision.window_tokens < 1:
            raise UnsupportedModelError(
                f"{source}: vision_config.window_size={window} is smaller than one merged token "
                f"(patch_size x spatial_merge_size = {vision.patch_size * vision.spatial_merge_size} pixels)"
            )
    elif model_type in _QWEN3_VL_TYPES:
        # LayerNorm, fc1 -> tanh-GELU -> fc2, full attention, learned positions, DeepStack.
        act, want = v.get("hidden_act", "gelu_pytorch_tanh"), "gelu_pytorch_tanh"
        depth = common["depth"] = int(v.get("depth", 27))
        positions = int(v.get("num_position_embeddings", 2304))
        if math.isqrt(positions) ** 2 != positions:
            raise UnsupportedModelError(
                f"{source}: vision_config.num_position_embeddings={positions} is not a square "
                "(the learned positions form a square grid)"
            )
        deepstack = tuple(int(b) for b in v.get("deepstack_visual_indexes", (8, 16, 24)))
        bad = [b for b in deepstack if not 0 <= b < depth]
        if bad or len(set(deepstack)) != len(deepstack):
            raise UnsupportedModelError(
                f"{source}: vision_config.deepstack_visual_indexes {list(deepstack)} must name distinct "
                f"blocks of the {depth}"
            )
        common["patch_size"] = int(v.get("patch_size", 16))
        vision = VisionArch(
            hidden_size=int(v.get("hidden_size", 1152)),
            intermediate_size=int(v.get("intermediate_size", 4304)),
            out_hidden_size=int(v.get("out_hidden_size", 3584)),
            window_size=None,
            fullatt_block_indexes=tuple(range(depth)),
            norm="layernorm",
            mlp="gelu_tanh",
            patch_bias=True,
            num_position_embeddings=positions,
            deepstack_visual_indexes=deepstack,
            frames_apart=True,
            **common,
        )
    else:  # qwen2_vl: LayerNorm, fc1 -> QuickGELU -> fc2, full attention everywhere
        act, want = v.get("hidden_act", "quick_gelu"), "quick_gelu"
        embed = int(v.get("embed_dim", 1280))
        vision = VisionArch(
            hidden_size=embed,
            intermediate_size=int(embed * float(v.get("mlp_ratio", 4))),
            out_hidden_size=int(v.get("hidden_size", 3584)),
            window_size=None,
            fullatt_block_indexes=tuple(range(common["depth"])),
            norm="layernorm",
            mlp="quick_gelu",
            **common,
        )
    if act != want:
        raise UnsupportedModelError(
            f"{source}: vision_config.hidden_act {act!r} is not supported for {model_type} (only {want!r})"
        )
    if vision.hidden_size % vision.num_heads:
        raise UnsupportedModelError(
            f"{source}: vision hidden size {vision.hidden_size} is not a multiple of vision_config.num_heads "
            f"{vision.num_heads}"
        )
    bad = [b for b in vision.fullatt_block_indexes if not 0 <= b < vision.depth]
    if bad:
        raise UnsupportedModelError(
            f"{source}: vision_config.fullatt_block_indexes {bad} are outside the {vision.depth} blocks"
        )
    return vision
