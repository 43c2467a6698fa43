"""What a Hugging Face ``config.json`` says about a model, in one typed object.

``ModelArch`` is the project's single description of a model: validation and the
memory planner (``config/``) read it before any process starts, ``models/`` builds a
megatron-core ``TransformerConfig`` from it, the HF⇄mcore spec uses it for tensor
shapes and layouts, the weight converter (``weights/``) for its plan, and
checkpoints store it as JSON. A preset's ``model_arch`` section and a checkpoint's
``config.json`` are parsed by the same ``from_hf_config``.

Supported families (causal LM, plus the token/sequence-classification variants
used for critics and reward models): Llama 2/3/3.x, Mistral, Qwen2/Qwen2.5,
Qwen3. Anything else is rejected here, with the list of what is supported, so
an unsupported model never reaches megatron.

This module reads JSON only; it imports neither megatron nor transformers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HeadKind",
    "ModelArch",
    "RopeScaling",
    "UnsupportedModelError",
]

HeadKind = Literal["lm", "value", "reward"]
"""What sits on top of the final norm: ``lm`` = vocabulary logits, ``value`` =
one scalar per token (PPO critic), ``reward`` = one scalar per token of which
the caller reads the last valid one (reward model)."""

# model_type -> (class-name prefix, qkv bias, q/k RMSNorm). The three
# flavours differ only in these two switches; everything else is shared.
_FAMILIES: dict[str, tuple[str, bool, bool]] = {
    "llama": ("Llama", False, False),
    "mistral": ("Mistral", False, False),
    "qwen2": ("Qwen2", True, False),
    "qwen3": ("Qwen3", False, True),
}
_HEAD_SUFFIXES: dict[str, HeadKind] = {
    "ForCausalLM": "lm",
    "ForTokenClassification": "value",
    "ForSequenceClassification": "reward",
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(
    prefix + suffix for prefix, _, _ in _FAMILIES.values() for suffix in _HEAD_SUFFIXES
)

# megatron-core 0.16's RotaryEmbedding._apply_scaling is called with the factor
# only; the other llama3 parameters are fixed at these values inside megatron.
_MCORE_LLAMA3_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


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
class ModelArch:
    """A decoder-only transformer as described by an HF ``config.json``."""

    architecture: str
    """HF class name, e.g. ``LlamaForCausalLM`` (one of ``SUPPORTED_ARCHITECTURES``)."""
    model_type: str
    """HF ``model_type``: ``llama``, ``mistral``, ``qwen2`` or ``qwen3``."""
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

    # -- derived sizes -------------------------------------------------------

    @property
    def queries_per_group(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_attention_heads // self.num_kv_heads

    @property
    def family(self) -> str:
        """The HF class-name prefix, e.g. ``Qwen2``."""
        return _FAMILIES[self.model_type][0]

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
        suffix = {v: k for k, v in _HEAD_SUFFIXES.items()}[head]
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
        prefix, qkv_bias, qk_norm = _FAMILIES[model_type]
        if not architecture.startswith(prefix):
            raise UnsupportedModelError(
                f"{source}: architectures[0] is {architecture!r} but model_type is {model_type!r}; "
                "the two must name the same family"
            )
        head_of_config = _HEAD_SUFFIXES[architecture[len(prefix) :]]
        _reject_unsupported_options(config, model_type, source)

        missing = [k for k in _REQUIRED_KEYS if config.get(k) is None]
        if missing:
            raise UnsupportedModelError(f"{source}: required key(s) {', '.join(map(repr, missing))} missing")

        def need(key: str) -> Any:
            return config[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        theta, scaling = _rope(config, source)
        arch = cls(
            architecture=architecture,
            model_type=model_type,
            num_layers=int(need("num_hidden_layers")),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(config.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            sliding_window=_sliding_window(config, model_type, source),
            head=head_of_config,
            head_bias=head_of_config == "value" and bool(config.get("token_classification_bias", True)),
            initializer_range=float(config.get("initializer_range", 0.02)),
        )
        return arch.with_head(head) if head is not None else arch


def _architecture(config: dict[str, Any], source: str) -> str:
    archs = config.get("architectures") or []
    if not archs:
        model_type = config.get("model_type")
        if model_type in _FAMILIES:
            return _FAMILIES[model_type][0] + "ForCausalLM"
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
    for model_type, (prefix, _, _) in _FAMILIES.items():
        if architecture.startswith(prefix) and architecture[len(prefix) :] in _HEAD_SUFFIXES:
            return model_type
    raise AssertionError(architecture)  # _architecture() already validated it


def _reject_unsupported_options(config: dict[str, Any], model_type: str, source: str) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(
            f"{source}: hidden_act {act!r} is not supported (only 'silu', i.e. SwiGLU)"
        )
    # Llama/Mistral/Qwen3 put attention_bias on q, k, v *and* o; megatron can
    # only bias o together with every MLP linear (add_bias_linear), so refuse.
    if model_type != "qwen2" and config.get("attention_bias"):
        raise UnsupportedModelError(
            f"{source}: attention_bias=true (bias on the output projection) is not supported for {model_type}"
        )
    if config.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")


def _sliding_window(config: dict[str, Any], model_type: str, source: str) -> int | None:
    window = config.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
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


def _rope(config: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling, from either transformers-5 ``rope_parameters`` or 4.x keys."""
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    scaling = params if params.get("rope_type", "default") != "default" else config.get("rope_scaling")
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
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
