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
routers over SwiGLU experts, described by ``MoEArch``); and the vision-language
Qwen2-VL and Qwen2.5-VL (``*ForConditionalGeneration``: a Qwen2 language model
with M-RoPE plus a vision tower, described by ``VisionArch``). Anything else is
rejected here, with the list of what is supported, so an unsupported model never
reaches megatron.

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
    "qwen2_vl": _Family("Qwen2VL", True, False, _VL_HEADS, vision=True, norm_eps=1e-5),
    "qwen2_5_vl": _Family("Qwen2_5_VL", True, False, _VL_HEADS, vision=True, norm_eps=1e-5),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(
    f.prefix + suffix for f in _FAMILIES.values() for suffix in f.heads
)
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
    ``linear`` matches megatron's ``seq_len_interpolation_factor``.
    """

    rope_type: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class VisionArch:
    """The vision tower of Qwen2-VL / Qwen2.5-VL (HF ``vision_config``)."""

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
    """Block and merger norms: RMSNorm (Qwen2.5-VL) or LayerNorm with bias (Qwen2-VL)."""
    mlp: Literal["swiglu", "quick_gelu"]
    """SwiGLU with biases (Qwen2.5-VL) or fc1 -> QuickGELU -> fc2 (Qwen2-VL)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

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
    """The mixture-of-experts MLPs of Qwen2-MoE, Qwen3-MoE and Mixtral.

    A sparse layer routes each token to ``top_k`` of ``num_experts`` SwiGLU experts:
    router logits in fp32, softmax, top-k (renormalised over the k when ``norm_topk_prob``),
    the experts' outputs summed with those weights. Qwen2-MoE adds a shared expert on
    every token, scaled by ``sigmoid(shared_expert_gate(x))``. Layers not in
    ``moe_layers`` are dense (``ModelArch.ffn_hidden_size``).
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
    """Qwen2-MoE's shared expert width (``shared_expert_intermediate_size``); None without one."""

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer (optionally with a vision tower) as described by an HF ``config.json``."""

    architecture: str
    """HF class name, e.g. ``LlamaForCausalLM`` (one of ``SUPPORTED_ARCHITECTURES``)."""
    model_type: str
    """HF ``model_type``: ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``qwen2_moe``, ``qwen3_moe``,
    ``mixtral``, ``qwen2_vl`` or ``qwen2_5_vl``."""
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
    image_token_id: int | None = None
    """The ``<|image_pad|>`` token: one per merged image patch; its embeddings are the vision
    tower's output."""
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    moe: MoEArch | None = None
    """The experts of a mixture-of-experts model; None for dense models."""

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
            data["vision"] = VisionArch(**vision)
        if data.get("mrope_section") is not None:
            data["mrope_section"] = tuple(data["mrope_section"])
        if data.get("moe") is not None:
            data["moe"] = MoEArch(**{**data["moe"], "moe_layers": tuple(data["moe"]["moe_layers"])})
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

        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        # transformers' Qwen2-VL attention derives head_dim from hidden / heads, whatever config says.
        head_dim = hidden // heads if family.vision else int(text.get("head_dim") or hidden // heads)
        theta, scaling = _rope(text, source, allow_mrope=family.vision)
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
            qkv_bias=bool(text.get("qkv_bias", True)) if model_type == "qwen2_moe" else family.qkv_bias,
            qk_norm=family.qk_norm,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(text.get("rms_norm_eps", family.norm_eps)),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            sliding_window=_sliding_window(text, model_type, source),
            head=head_of_config,
            head_bias=head_of_config == "value" and bool(text.get("token_classification_bias", True)),
            initializer_range=float(text.get("initializer_range", 0.02)),
            moe=moe,
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
    if not family.qkv_bias and config.get("attention_bias"):
        raise UnsupportedModelError(
            f"{source}: attention_bias=true (bias on the output projection) is not supported for {model_type}"
        )
    if config.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")


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


def _rope(config: dict[str, Any], source: str, allow_mrope: bool = False) -> tuple[float, RopeScaling | None]:
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
        f"{source}: RoPE scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


# -- mixture of experts ------------------------------------------------------------


# transformers' defaults for a family's missing MoE keys: (experts, per token, expert width, shared width).
_MOE_DEFAULTS = {
    "mixtral": (8, 2, None, None),
    "qwen2_moe": (60, 4, 1408, 5632),
    "qwen3_moe": (128, 8, 768, None),
}


def _moe_arch(config: dict[str, Any], model_type: str, source: str) -> MoEArch:
    """``MoEArch`` from a Qwen2-MoE / Qwen3-MoE / Mixtral config (transformers' defaults for missing keys).

    Hub configs name the expert count ``num_experts`` (Qwen) or ``num_local_experts``
    (Mixtral); transformers 5 writes ``num_local_experts`` for Qwen3-MoE too.
    """
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
            bool(config.get("norm_topk_prob", False)),
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
            f"(vision_config.{'out_hidden_size' if model_type == 'qwen2_5_vl' else 'hidden_size'}) but the "
            f"language model's hidden_size is {hidden}; they must be equal"
        )
    tokens = {k: int(config.get(k, text.get(k, v))) for k, v in _VL_TOKEN_DEFAULTS.items()}
    return {"vision": vision, "mrope_section": section, **tokens}


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
            **common,
        )
        if vision.window_tokens < 1:
            raise UnsupportedModelError(
                f"{source}: vision_config.window_size={window} is smaller than one merged token "
                f"(patch_size x spatial_merge_size = {vision.patch_size * vision.spatial_merge_size} pixels)"
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
