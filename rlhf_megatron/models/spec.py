"""HF ⇄ megatron-core parameter spec: one declarative table, one engine.

Every megatron parameter of a supported model is described by one
``ParamRule``: its megatron name(s), the HF tensor(s) it is made from, the
``Layout`` transform between the two, its tensor-parallel partition dim and
its full shape. The functions below are the only code that interprets rules,
so adding an architecture means adding a table, not loading code.

Two directions, both pure (no processes, no megatron import):

- ``hf_to_mcore(name, arch, source, tp_rank, tp_size)``: the TP shard of one
  megatron parameter, reading only the rows/columns it needs from ``source``
  (a ``TensorSource``, e.g. safetensors slices). Used by ``loader.py``.
- ``mcore_to_hf(name, full, arch)``: the HF tensors for one FULL megatron
  tensor. "Full" means the TP-independent layout that megatron's distributed
  checkpoint stores; for every parameter but ``linear_fc1`` it is the plain
  concatenation of the TP shards along ``tp_partition_dim``. ``linear_fc1``
  (gate/up, SwiGLU) is ``[gate; up]`` in full, but each TP rank holds
  ``[gate_r; up_r]``, so use ``gather_tp_shards`` / ``split_tp_shard`` (or the
  slices from ``tp_shard_slices``) rather than a bare ``torch.cat``.

Names use *global* layer numbers (``decoder.layers.3.…``); a model chunk's
own names are local to its pipeline stage: ``local_to_global_layer`` and
friends (from ``stages.py``, re-exported here) translate.
Both megatron spellings of the fused norms are accepted: the local layer spec
(``input_layernorm.weight``, ``pre_mlp_layernorm.weight``) and the
transformer-engine spec / distributed checkpoint
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``).

Megatron layouts handled here:

- QKV: ``linear_qkv`` is ``[groups × (q_per_group + 2) × head_dim, hidden]``:
  for each key/value group, its query heads, then its key head, then its value
  head. TP splits whole groups. Biases follow the same row order.
- Vocabulary: megatron's embedding and output layer have
  ``arch.padded_vocab_size(tp)`` rows; the extra rows are zero on import and
  trimmed on export.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf_megatron.config.model_arch import ModelArch
from rlhf_megatron.models.stages import StageError, global_to_local_layer, layer_offset, local_to_global_layer

__all__ = [
    "ArchSpec",
    "DictTensorSource",
    "Layout",
    "ParamRule",
    "ShardSlice",
    "SpecError",
    "StageError",
    "TensorSource",
    "expected_hf_shapes",
    "gather_tp_shards",
    "get_arch_spec",
    "global_to_local_layer",
    "hf_names",
    "hf_to_mcore",
    "layer_offset",
    "local_to_global_layer",
    "mcore_full_shape",
    "mcore_param_names",
    "mcore_to_hf",
    "split_tp_shard",
    "tp_partition_dim",
    "tp_shard_slices",
]


class SpecError(ValueError):
    """A name, shape or size does not fit the spec; the message says which and why."""


class Layout(enum.Enum):
    """How the HF tensors of a rule become the megatron tensor."""

    COPY = "copy"  # one HF tensor, same layout
    QKV = "qkv"  # HF q, k, v -> megatron's group-interleaved linear_qkv
    GATE_UP = "gate_up"  # HF gate, up -> [gate; up] (TP shard: [gate_r; up_r])
    VOCAB = "vocab"  # HF [V, h] -> [padded V, h], zero rows appended


ShapeFn = Callable[[ModelArch, int], tuple[int, ...]]


@dataclass(frozen=True)
class ParamRule:
    """One megatron parameter and the HF tensors it corresponds to."""

    mcore: tuple[str, ...]
    """Megatron name templates (``{layer}`` = global layer); the first is the
    local-spec name, a second one the transformer-engine/checkpoint name."""
    hf: tuple[str, ...]
    """HF name templates, in the order ``Layout`` expects (q, k, v / gate, up)."""
    layout: Layout
    tp_dim: int | None
    """Dim along which TP splits the parameter; None = replicated on every TP rank."""
    shape: ShapeFn
    """Full megatron shape for ``(arch, tp_size)`` (tp matters only for vocabulary padding)."""
    when: Callable[[ModelArch], bool] = lambda arch: True
    """Whether the parameter exists for this arch (biases, q/k norms, which head)."""
    exported: bool = True
    """False for parameters that are read from HF but not written back (tied LM head)."""


@dataclass(frozen=True)
class ArchSpec:
    """The rule table for a family of HF architectures."""

    model_types: tuple[str, ...]
    rules: tuple[ParamRule, ...]


@dataclass(frozen=True)
class ShardSlice:
    """Rows ``[local_start, local_start+length)`` of a TP shard along ``dim`` are
    rows ``[full_start, full_start+length)`` of the full tensor."""

    dim: int
    local_start: int
    full_start: int
    length: int


class TensorSource(Protocol):
    """Where ``hf_to_mcore`` reads HF tensors from (whole or by slice)."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """The tensor, or only ``[start, stop)`` along ``dim`` when ``dim`` is given."""
        ...

    def where(self, name: str) -> str:
        """A human description of where ``name`` lives (for error messages)."""
        ...


class DictTensorSource:
    """A ``TensorSource`` over in-memory tensors (tests, and the weight converter)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._tensors:
            raise KeyError(name)
        return tuple(self._tensors[name].shape)

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        t = self._tensors[name]
        return t if dim is None else t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start)

    def where(self, name: str) -> str:
        return name


# -- the rule table ------------------------------------------------------------

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."


def _qkv_rows(a: ModelArch) -> int:
    return (a.num_attention_heads + 2 * a.num_kv_heads) * a.head_dim


_DECODER_RULES: tuple[ParamRule, ...] = (
    ParamRule(
        ("embedding.word_embeddings.weight",),
        ("model.embed_tokens.weight",),
        Layout.VOCAB,
        0,
        lambda a, tp: (a.padded_vocab_size(tp), a.hidden_size),
    ),
    ParamRule(
        (_L + "input_layernorm.weight", _L + "self_attention.linear_qkv.layer_norm_weight"),
        (_H + "input_layernorm.weight",),
        Layout.COPY,
        None,
        lambda a, tp: (a.hidden_size,),
    ),
    ParamRule(
        (_L + "self_attention.linear_qkv.weight",),
        tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"),
        Layout.QKV,
        0,
        lambda a, tp: (_qkv_rows(a), a.hidden_size),
    ),
    ParamRule(
        (_L + "self_attention.linear_qkv.bias",),
        tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"),
        Layout.QKV,
        0,
        lambda a, tp: (_qkv_rows(a),),
        when=lambda a: a.qkv_bias,
    ),
    ParamRule(
        (_L + "self_attention.q_layernorm.weight",),
        (_H + "self_attn.q_norm.weight",),
        Layout.COPY,
        None,
        lambda a, tp: (a.head_dim,),
        when=lambda a: a.qk_norm,
    ),
    ParamRule(
        (_L + "self_attention.k_layernorm.weight",),
        (_H + "self_attn.k_norm.weight",),
        Layout.COPY,
        None,
        lambda a, tp: (a.head_dim,),
        when=lambda a: a.qk_norm,
    ),
    ParamRule(
        (_L + "self_attention.linear_proj.weight",),
        (_H + "self_attn.o_proj.weight",),
        Layout.COPY,
        1,
        lambda a, tp: (a.hidden_size, a.num_attention_heads * a.head_dim),
    ),
    ParamRule(
        (_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight"),
        (_H + "post_attention_layernorm.weight",),
        Layout.COPY,
        None,
        lambda a, tp: (a.hidden_size,),
    ),
    ParamRule(
        (_L + "mlp.linear_fc1.weight",),
        (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
        Layout.GATE_UP,
        0,
        lambda a, tp: (2 * a.ffn_hidden_size, a.hidden_size),
    ),
    ParamRule(
        (_L + "mlp.linear_fc2.weight",),
        (_H + "mlp.down_proj.weight",),
        Layout.COPY,
        1,
        lambda a, tp: (a.hidden_size, a.ffn_hidden_size),
    ),
    ParamRule(
        ("decoder.final_layernorm.weight",),
        ("model.norm.weight",),
        Layout.COPY,
        None,
        lambda a, tp: (a.hidden_size,),
    ),
    ParamRule(
        ("output_layer.weight",),
        ("lm_head.weight",),
        Layout.VOCAB,
        0,
        lambda a, tp: (a.padded_vocab_size(tp), a.hidden_size),
        when=lambda a: a.head == "lm" and not a.tie_word_embeddings,
    ),
    # Tied embeddings: the last pipeline stage keeps its own copy of the
    # embedding as output layer (megatron syncs the two); it is loaded from the
    # embedding and not exported, as HF stores the tensor once.
    ParamRule(
        ("output_layer.weight",),
        ("model.embed_tokens.weight",),
        Layout.VOCAB,
        0,
        lambda a, tp: (a.padded_vocab_size(tp), a.hidden_size),
        when=lambda a: a.head == "lm" and a.tie_word_embeddings,
        exported=False,
    ),
    # Critic / reward model: a one-output head, replicated on every TP rank
    # (see heads.py), stored like HF's *ForTokenClassification / *ForSequenceClassification.
    ParamRule(
        ("output_layer.weight",),
        ("score.weight",),
        Layout.COPY,
        None,
        lambda a, tp: (1, a.hidden_size),
        when=lambda a: a.head != "lm",
    ),
    ParamRule(
        ("output_layer.bias",),
        ("score.bias",),
        Layout.COPY,
        None,
        lambda a, tp: (1,),
        when=lambda a: a.head != "lm" and a.head_bias,
    ),
)

# Llama, Mistral, Qwen2 and Qwen3 share HF's Llama naming; their differences
# (qkv bias, q/k norm) are switches on ModelArch that the table's `when`s read.
_SPECS: dict[str, ArchSpec] = {
    model_type: ArchSpec((model_type,), _DECODER_RULES)
    for model_type in ("llama", "mistral", "qwen2", "qwen3")
}


def get_arch_spec(arch: ModelArch) -> ArchSpec:
    """The rule table for ``arch``."""
    try:
        return _SPECS[arch.model_type]
    except KeyError:
        raise SpecError(
            f"no HF⇄mcore spec for model_type {arch.model_type!r}; have {sorted(_SPECS)}"
        ) from None


# -- rule lookup ---------------------------------------------------------------


@functools.cache
def _template_regex(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)") + r"\Z")


@dataclass(frozen=True)
class _Resolved:
    rule: ParamRule
    layer: int | None

    def hf(self) -> tuple[str, ...]:
        return tuple(t.format(layer=self.layer) for t in self.rule.hf)


@functools.lru_cache(maxsize=4096)
def _resolve(name: str, arch: ModelArch) -> _Resolved:
    matched_rule_absent = False
    for rule in get_arch_spec(arch).rules:
        for template in rule.mcore:
            m = _template_regex(template).match(name)
            if not m:
                continue
            if not rule.when(arch):
                matched_rule_absent = True
                continue
            layer = int(m.group("layer")) if "layer" in m.groupdict() else None
            if layer is not None and not 0 <= layer < arch.num_layers:
                raise SpecError(f"{name}: layer {layer} is outside the model's {arch.num_layers} layers")
            return _Resolved(rule, layer)
    why = (
        "that parameter does not exist for this configuration (check qkv_bias / qk_norm / head / tied embeddings)"
        if matched_rule_absent
        else "it is not a known parameter name (names use global layer numbers, see local_to_global_layer)"
    )
    raise SpecError(f"{name!r} has no mapping for {arch.architecture} (head={arch.head}): {why}")


def tp_partition_dim(name: str, arch: ModelArch) -> int | None:
    """The dim TP splits ``name`` along, or None when every TP rank holds all of it."""
    return _resolve(name, arch).rule.tp_dim


def mcore_full_shape(name: str, arch: ModelArch, tp_size: int = 1) -> tuple[int, ...]:
    """Shape of the full (TP-gathered) megatron tensor; vocabulary rows are padded for ``tp_size``."""
    return _resolve(name, arch).rule.shape(arch, tp_size)


def hf_names(name: str, arch: ModelArch) -> tuple[str, ...]:
    """The HF tensors ``name`` is built from (q, k, v for linear_qkv; gate, up for linear_fc1)."""
    return _resolve(name, arch).hf()


def mcore_param_names(arch: ModelArch, fused_norms: bool = False) -> list[str]:
    """All global megatron parameter names of ``arch``, in model order.

    ``fused_norms`` picks the transformer-engine spelling of the per-layer
    norms (``linear_qkv.layer_norm_weight``) over the local spec's.
    """
    names = []
    for rule in get_arch_spec(arch).rules:
        if not rule.when(arch):
            continue
        template = rule.mcore[-1] if fused_norms else rule.mcore[0]
        if "{layer}" in template:
            continue
        names.append(template)
    layer_rules = [r for r in get_arch_spec(arch).rules if r.when(arch) and "{layer}" in r.mcore[0]]
    per_layer = [
        [(r.mcore[-1] if fused_norms else r.mcore[0]).format(layer=i) for r in layer_rules]
        for i in range(arch.num_layers)
    ]
    embedding, rest = names[:1], names[1:]
    return embedding + [n for layer in per_layer for n in layer] + rest


# -- TP sharding ---------------------------------------------------------------


def _divide(n: int, tp_size: int, what: str, name: str) -> int:
    if n % tp_size:
        raise SpecError(
            f"{name}: {what} ({n}) is not divisible by the TP size {tp_size}; pick a TP size that divides it"
        )
    return n // tp_size


def tp_shard_slices(name: str, arch: ModelArch, tp_rank: int, tp_size: int) -> list[ShardSlice]:
    """Which rows of the full tensor TP rank ``tp_rank`` holds, and where in its shard.

    Empty for replicated parameters (the rank holds the whole tensor). One
    slice for ordinary splits, two for ``linear_fc1`` (its gate rows, then its
    up rows).
    """
    if not 0 <= tp_rank < tp_size:
        raise SpecError(f"{name}: tp_rank {tp_rank} is outside tp_size {tp_size}")
    rule = _resolve(name, arch).rule
    if rule.tp_dim is None:
        return []
    full = rule.shape(arch, tp_size)[rule.tp_dim]
    if rule.layout is Layout.GATE_UP:
        f = _divide(arch.ffn_hidden_size, tp_size, "ffn_hidden_size", name)
        return [ShardSlice(0, 0, tp_rank * f, f), ShardSlice(0, f, arch.ffn_hidden_size + tp_rank * f, f)]
    if rule.layout is Layout.QKV:
        _divide(arch.num_kv_heads, tp_size, "num_key_value_heads", name)
    n = _divide(full, tp_size, f"dim {rule.tp_dim}", name)
    return [ShardSlice(rule.tp_dim, 0, tp_rank * n, n)]


def split_tp_shard(
    name: str, full: torch.Tensor, arch: ModelArch, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """The TP shard of a full megatron tensor that rank ``tp_rank`` holds."""
    slices = tp_shard_slices(name, arch, tp_rank, tp_size)
    if not slices:
        return full
    return torch.cat([full.narrow(s.dim, s.full_start, s.length) for s in slices], dim=slices[0].dim)


def gather_tp_shards(name: str, shards: Sequence[torch.Tensor], arch: ModelArch) -> torch.Tensor:
    """Reassemble the full megatron tensor from the TP shards of all ranks, in rank order."""
    tp_size = len(shards)
    first = tp_shard_slices(name, arch, 0, tp_size)
    if not first:
        return shards[0]
    dim = first[0].dim
    pieces = sorted(
        (s.full_start, shard.narrow(dim, s.local_start, s.length))
        for rank, shard in enumerate(shards)
        for s in tp_shard_slices(name, arch, rank, tp_size)
    )
    return torch.cat([p for _, p in pieces], dim=dim)


# -- conversions ---------------------------------------------------------------


def mcore_to_hf(name: str, full: torch.Tensor, arch: ModelArch) -> list[tuple[str, torch.Tensor]]:
    """HF tensors for one full megatron tensor (views where possible; no copies of data).

    Returns ``[]`` for parameters HF does not store (the tied output layer).
    Vocabulary padding is trimmed.
    """
    resolved = _resolve(name, arch)
    rule, hf = resolved.rule, resolved.hf()
    if not rule.exported:
        return []
    if rule.layout is Layout.COPY:
        return [(hf[0], full)]
    if rule.layout is Layout.VOCAB:
        return [(hf[0], full[: arch.vocab_size])]
    if rule.layout is Layout.GATE_UP:
        gate, up = full.chunk(2, dim=0)
        return [(hf[0], gate), (hf[1], up)]
    # QKV: [groups, (q_per_group + 2) * head_dim, ...] -> q, k, v
    g, qpg, d = arch.num_kv_heads, arch.queries_per_group, arch.head_dim
    grouped = full.reshape(g, (qpg + 2) * d, *full.shape[1:])
    q, k, v = grouped.split([qpg * d, d, d], dim=1)
    return [
        (hf[0], q.reshape(-1, *full.shape[1:])),
        (hf[1], k.reshape(-1, *full.shape[1:])),
        (hf[2], v.reshape(-1, *full.shape[1:])),
    ]


def expected_hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor of ``arch``'s checkpoint, in export order (a fresh dict)."""
    return dict(_expected_hf_shapes(arch))


@functools.lru_cache(maxsize=64)
def _expected_hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for name in mcore_param_names(arch):
        # Run the export transform on shape-only tensors: the spec is its own shape oracle.
        meta = torch.empty(_resolve(name, arch).rule.shape(arch, 1), device="meta")
        for hf_name, t in mcore_to_hf(name, meta, arch):
            shapes[hf_name] = tuple(t.shape)
    return shapes


def hf_to_mcore(
    name: str, arch: ModelArch, source: TensorSource, tp_rank: int = 0, tp_size: int = 1
) -> torch.Tensor:
    """Build TP rank ``tp_rank``'s shard of megatron parameter ``name`` from HF tensors.

    Reads only the slices this rank needs (``source.read(..., dim, start, stop)``),
    so a rank never holds more than its shard plus one tensor's slice. Checks
    every HF source's shape against what ``arch`` implies before reading.
    """
    resolved = _resolve(name, arch)
    rule, hf = resolved.rule, resolved.hf()
    expected = _expected_hf_shapes(arch)
    for hf_name in dict.fromkeys(hf):
        got = source.shape(hf_name)
        if got != expected[hf_name]:
            raise SpecError(
                f"{source.where(hf_name)} has shape {list(got)}, but config.json "
                f"({arch.architecture}) implies {list(expected[hf_name])}; the weights and the config disagree"
            )
    slices = tp_shard_slices(name, arch, tp_rank, tp_size)
    if rule.layout is Layout.COPY:
        if not slices:
            return source.read(hf[0])
        s = slices[0]
        return source.read(hf[0], s.dim, s.full_start, s.full_start + s.length)
    if rule.layout is Layout.GATE_UP:
        f = slices[0].length
        return torch.cat([source.read(h, 0, tp_rank * f, (tp_rank + 1) * f) for h in hf], dim=0)
    if rule.layout is Layout.VOCAB:
        s = slices[0]
        stop = min(s.full_start + s.length, arch.vocab_size)
        rows = source.read(hf[0], 0, s.full_start, stop) if stop > s.full_start else None
        out_shape = (s.length, *expected[hf[0]][1:])
        if rows is not None and rows.shape[0] == s.length:
            return rows
        out = torch.zeros(out_shape, dtype=rows.dtype if rows is not None else torch.float32)
        if rows is not None:
            out[: rows.shape[0]] = rows
        return out
    # QKV: this rank owns key/value groups [g0, g0 + groups).
    groups = arch.num_kv_heads // tp_size
    g0, qpg, d = tp_rank * groups, arch.queries_per_group, arch.head_dim
    q = source.read(hf[0], 0, g0 * qpg * d, (g0 + groups) * qpg * d)
    k = source.read(hf[1], 0, g0 * d, (g0 + groups) * d)
    v = source.read(hf[2], 0, g0 * d, (g0 + groups) * d)
    rest = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(groups, qpg * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    )
    return grouped.reshape(groups * (qpg + 2) * d, *rest)
