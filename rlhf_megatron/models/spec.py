"""HF ⇄ megatron-core parameter spec: declarative tables (``spec_rules.py``), one engine (here).

Every megatron parameter of a supported model is described by one
``ParamRule``: its megatron name(s), the HF tensor(s) it is made from, the
``Layout`` transform between the two, its tensor-parallel partition dim and
its full shape. The functions below are the only code that interprets rules,
so adding an architecture means adding a table, not loading code.

Two directions, both pure (no processes, no megatron import):

- ``hf_to_mcore(name, arch, source, tp_rank, tp_size)``: the TP shard of one
  megatron parameter, reading only the rows/columns it needs from ``source``
  (a ``TensorSource``, e.g. safetensors slices; wrap it in ``hf_source`` so a
  family's alternative HF names are found). Used by ``loader.py``.
- ``mcore_to_hf(name, full, arch)``: the HF tensors for one FULL megatron
  tensor. "Full" means the TP-independent layout that megatron's distributed
  checkpoint stores; for every parameter but ``linear_fc1`` (SwiGLU) it is the
  plain concatenation of the TP shards along ``tp_partition_dim``.
  ``linear_fc1`` is ``[gate; up]`` in full, but each TP rank holds
  ``[gate_r; up_r]``, so use ``gather_tp_shards`` / ``split_tp_shard`` (or the
  slices from ``tp_shard_slices``) rather than a bare ``torch.cat``.

Names use *global* layer numbers (``decoder.layers.3.…``); a model chunk's
own names are local to its pipeline stage: ``local_to_global_layer`` and
friends (from ``pipeline_stages.py``, re-exported here) translate. Vision blocks
(``vision_model.decoder.layers.{block}.…``) are never split over stages.
Both megatron spellings of the fused norms are accepted: the local layer spec
(``input_layernorm.weight``, ``pre_mlp_layernorm.weight``) and the
transformer-engine spec / distributed checkpoint
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``).

Megatron layouts handled here:

- QKV: ``linear_qkv`` is ``[groups × (q_per_group + 2) × head_dim, hidden]``:
  for each key/value group, its query heads, then its key head, then its value
  head. TP splits whole groups. Biases follow the same row order. HF stores
  q, k and v apart (language models) or fused as ``[q; k; v]`` (vision blocks,
  one group per head).
- Padding: megatron's embedding and output layer have
  ``arch.padded_vocab_size(tp)`` rows, the vision MLP
  ``vision.padded_intermediate_size(tp)``; the extra rows (columns for
  ``linear_fc2``) are zero on import and trimmed on export.
- Stacked experts (Qwen3-VL-MoE, ``ParamRule.stacked``): one HF tensor per
  projection holds all of a layer's experts, ``[E, in, out]``; megatron's expert
  ``e`` is row ``e`` transposed. ``hf_to_mcore`` reads only that row;
  ``mcore_to_hf`` returns it as ``name[e]`` (``split_stacked_row``) and
  ``ExpertStacker`` turns the rows of all experts back into the HF tensor.
  ``hf_source`` also reads a checkpoint saved by transformers 5, which stores
  the stack transposed (``[E, out, in]``), as the hub's layout.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf_megatron.models.pipeline_stages import (
    StageError,
    expert_owner,
    global_to_local_layer,
    layer_offset,
    local_to_global_expert,
    local_to_global_layer,
    param_owner,
)
from rlhf_megatron.models.spec_rules import SPECS, ArchSpec, Layout, ParamRule
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = [
    "ArchSpec",
    "DictTensorSource",
    "ExpertStacker",
    "Layout",
    "ParamRule",
    "ShardSlice",
    "SpecError",
    "StageError",
    "TensorSource",
    "expected_hf_shapes",
    "expert_owner",
    "gather_tp_shards",
    "get_arch_spec",
    "global_to_local_layer",
    "hf_names",
    "hf_source",
    "hf_to_mcore",
    "is_expert_param",
    "layer_offset",
    "local_to_global_expert",
    "local_to_global_layer",
    "mcore_full_shape",
    "mcore_param_names",
    "mcore_to_hf",
    "param_owner",
    "split_stacked_row",
    "split_tp_shard",
    "tp_partition_dim",
    "tp_shard_slices",
]


class SpecError(ValueError):
    """A name, shape or size does not fit the spec; the message says which and why."""


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

    def __contains__(self, name: str) -> bool: ...

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


class _AliasedSource:
    """A ``TensorSource`` that finds each spec name under the family's alternative prefixes too,
    and shows a stacked expert tensor stored transposed (``[E, out, in]``, transformers 5's
    ``save_pretrained``) in the hub's ``[E, in, out]`` (``stacked``: name -> the hub's shape).

    Other attributes (e.g. ``HFCheckpoint.dir``) pass through to the wrapped source.
    """

    def __init__(
        self,
        source: TensorSource,
        aliases: tuple[tuple[str, str], ...],
        stacked: Mapping[str, tuple[int, ...]] | None = None,
    ):
        self._source = source
        self._aliases = aliases
        self._stacked = stacked or {}

    def _find(self, name: str) -> str:
        if name in self._source:
            return name
        for prefix, alternative in self._aliases:
            if name.startswith(prefix) and alternative + name[len(prefix) :] in self._source:
                return alternative + name[len(prefix) :]
        return name

    def __contains__(self, name: str) -> bool:
        return self._find(name) in self._source

    def _transposed(self, name: str) -> bool:
        hub = self._stacked.get(name)
        if hub is None:
            return False
        swapped = (hub[0], hub[2], hub[1])  # a square expert is refused by ModelArch: never ambiguous
        return swapped != hub and self._source.shape(self._find(name)) == swapped

    def shape(self, name: str) -> tuple[int, ...]:
        if self._transposed(name):
            return self._stacked[name]
        return self._source.shape(self._find(name))

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None):
        if not self._transposed(name):
            return self._source.read(self._find(name), dim, start, stop)
        stored_dim = {1: 2, 2: 1}.get(dim, dim) if dim is not None else None
        return self._source.read(self._find(name), stored_dim, start, stop).transpose(1, 2)

    def where(self, name: str) -> str:
        return self._source.where(self._find(name))

    def __getattr__(self, attr):
        if attr.startswith("_"):  # not set yet (copying, unpickling): do not recurse
            raise AttributeError(attr)
        return getattr(self._source, attr)


def hf_source(source: TensorSource, arch: ModelArch) -> TensorSource:
    """``source`` as ``hf_to_mcore`` should read it for ``arch``: a vision-language checkpoint
    saved with ``model.visual.*`` / ``model.language_model.*`` names reads like the hub's
    ``visual.*`` / ``model.*`` (and the other way round for Qwen3-VL), and stacked experts saved
    transposed read in the hub's orientation. Families needing neither get ``source`` back."""
    aliases = get_arch_spec(arch).hf_aliases
    stacked = _stacked_hf_shapes(arch)
    return _AliasedSource(source, aliases, stacked) if aliases or stacked else source


def get_arch_spec(arch: ModelArch) -> ArchSpec:
    """The rule table for ``arch``."""
    try:
        return SPECS[arch.model_type]
    except KeyError:
        raise SpecError(
            f"no HF⇄mcore spec for model_type {arch.model_type!r}; have {sorted(SPECS)}"
        ) from None


# -- stacked experts -----------------------------------------------------------

_STACKED_ROW = re.compile(r"(?P<name>.+)\[(?P<row>\d+)\]")


def split_stacked_row(hf_name: str) -> tuple[str, int | None]:
    """``mcore_to_hf``'s ``name[e]`` (row ``e`` of a stacked expert tensor) -> ``(name, e)``; any
    other HF name -> ``(hf_name, None)``."""
    m = _STACKED_ROW.fullmatch(hf_name)
    return (m.group("name"), int(m.group("row"))) if m else (hf_name, None)


class ExpertStacker:
    """Turns ``mcore_to_hf``'s output into whole HF tensors, for writers of a checkpoint.

    ``add(hf_name, tensor)`` returns what is complete: an ordinary tensor at once, a stacked
    expert tensor (``name[e]`` rows, ``ParamRule.stacked``) once all ``num_experts`` rows have
    arrived, in any order. Each stacked tensor is allocated at its first row and the rows are
    copied in, so a writer holds the stacked tensors in flight (one layer's, in model order) and
    nothing more. ``pending`` names those still missing rows.
    """

    def __init__(self, arch: ModelArch):
        self._rows = arch.moe.num_experts if arch.moe is not None else 0
        self._stacks: dict[str, tuple[torch.Tensor, set[int]]] = {}

    def add(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        name, row = split_stacked_row(hf_name)
        if row is None:
            return [(hf_name, tensor)]
        if name not in self._stacks:
            stack = torch.empty((self._rows, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
            self._stacks[name] = (stack, set())
        stack, seen = self._stacks[name]
        if row in seen or not 0 <= row < self._rows:
            raise SpecError(f"{hf_name}: expert {row} arrived twice or is outside the {self._rows} experts")
        stack[row].copy_(tensor)
        seen.add(row)
        if len(seen) < self._rows:
            return []
        del self._stacks[name]
        return [(name, stack)]

    @property
    def pending(self) -> list[str]:
        """Stacked tensors some of whose rows never arrived."""
        return sorted(self._stacks)


# -- rule lookup ---------------------------------------------------------------

_INDEXES = ("layer", "block", "expert", "deepstack")


@functools.cache
def _template_regex(template: str) -> re.Pattern[str]:
    pattern = re.escape(template)
    for index in _INDEXES:
        pattern = pattern.replace(rf"\{{{index}\}}", rf"(?P<{index}>\d+)")
    return re.compile(pattern + r"\Z")


def _index_of(template: str) -> str | None:
    """Which index a template repeats over first (``layer``, ``block``), if any."""
    return next((i for i in _INDEXES if "{" + i + "}" in template), None)


def _count(index: str, arch: ModelArch) -> int:
    if index == "expert":
        return arch.moe.num_experts if arch.moe is not None else 0
    if index == "deepstack":
        return len(arch.vision.deepstack_visual_indexes)
    return arch.num_layers if index == "layer" else arch.vision.depth


_WHAT = {"layer": "layers", "block": "vision blocks", "expert": "experts", "deepstack": "DeepStack mergers"}


@dataclass(frozen=True)
class _Resolved:
    rule: ParamRule
    index: dict[str, int]

    def hf(self) -> tuple[str, ...]:
        return tuple(t.format(**self.index) for t in self.rule.hf)


@functools.lru_cache(maxsize=8192)
def _resolve(name: str, arch: ModelArch) -> _Resolved:
    matched_rule_absent = False
    for rule in get_arch_spec(arch).rules:
        for template in rule.mcore:
            m = _template_regex(template).match(name)
            if not m:
                continue
            index = {k: int(v) for k, v in m.groupdict().items()}
            if not rule.when(arch) or (rule.on_layer is not None and not rule.on_layer(arch, index["layer"])):
                matched_rule_absent = True
                continue
            for k, i in index.items():
                n = _count(k, arch)
                if not 0 <= i < n:
                    raise SpecError(f"{name}: {k} {i} is outside the model's {n} {_WHAT[k]}")
            return _Resolved(rule, index)
    why = (
        "that parameter does not exist for this configuration (check qkv_bias / qk_norm / head / tied "
        "embeddings / the vision norm and MLP kind / which layers are dense and which have experts)"
        if matched_rule_absent
        else "it is not a known parameter name (names use global layer numbers, see local_to_global_layer)"
    )
    raise SpecError(f"{name!r} has no mapping for {arch.architecture} (head={arch.head}): {why}")


def tp_partition_dim(name: str, arch: ModelArch) -> int | None:
    """The dim TP splits ``name`` along, or None when every TP rank holds all of it.

    For a routed expert's weight (``is_expert_param``) the split is over the expert
    tensor-parallel group: pass the ETP rank and size wherever a TP rank and size go.
    """
    return _resolve(name, arch).rule.tp_dim


def is_expert_param(name: str, arch: ModelArch) -> bool:
    """A routed expert's weight: split by expert tensor parallelism, held by one expert-parallel rank."""
    return _resolve(name, arch).rule.expert


def mcore_full_shape(name: str, arch: ModelArch, tp_size: int = 1) -> tuple[int, ...]:
    """Shape of the full (TP-gathered) megatron tensor; padded rows are counted for ``tp_size``."""
    return _resolve(name, arch).rule.shape(arch, tp_size)


def hf_names(name: str, arch: ModelArch) -> tuple[str, ...]:
    """The HF tensors ``name`` is built from (q, k, v for linear_qkv; gate, up for linear_fc1)."""
    return _resolve(name, arch).hf()


def mcore_param_names(arch: ModelArch, fused_norms: bool = False) -> list[str]:
    """All global megatron parameter names of ``arch``, in model order.

    A run of consecutive rules that repeat over layers (or vision blocks) is
    expanded block by block, so the order is: vision tower, embedding, layer 0,
    layer 1, …, final norm, output layer. Inside a sparse layer the experts come
    one after another (expert 0's fc1 and fc2, then expert 1's, …). ``fused_norms``
    picks the transformer-engine spelling of the per-layer norms
    (``linear_qkv.layer_norm_weight``) and of grouped experts
    (``mlp.experts.linear_fc1.weight{expert}``) over the local spec's.
    """
    names: list[str] = []
    run: list[tuple[str, ParamRule]] = []
    run_index: str | None = None

    def expand(i: int) -> list[str]:
        out, experts = [], []
        for template, rule in [*run, ("", None)]:  # a sentinel flushes a trailing group of experts
            if rule is not None and "{expert}" in template and rule.on_layer(arch, i):
                experts.append(template)
                continue
            out += [t.format(layer=i, expert=e) for e in range(_count("expert", arch)) for t in experts]
            experts = []
            if rule is not None and (rule.on_layer is None or rule.on_layer(arch, i)):
                out.append(template.format(**{run_index: i}))
        return out

    def flush():
        if run:
            names.extend(n for i in range(_count(run_index, arch)) for n in expand(i))
            run.clear()

    for rule in get_arch_spec(arch).rules:
        if not rule.when(arch):
            continue
        template = rule.mcore[-1] if fused_norms else rule.mcore[0]
        index = _index_of(template)
        if index != run_index:
            flush()
            run_index = index
        if index is None:
            names.append(template)
        else:
            run.append((template, rule))
    flush()
    return names


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
    slice for ordinary splits, two for ``linear_fc1`` with SwiGLU (its gate rows,
    then its up rows).
    """
    if not 0 <= tp_rank < tp_size:
        raise SpecError(f"{name}: tp_rank {tp_rank} is outside tp_size {tp_size}")
    rule = _resolve(name, arch).rule
    if rule.tp_dim is None:
        return []
    full = rule.shape(arch, tp_size)[rule.tp_dim]
    if rule.layout is Layout.GATE_UP:
        half = full // 2
        what = "ffn_hidden_size" if rule.hf_size is None else "padded vision intermediate_size"
        f = _divide(half, tp_size, what, name)
        return [ShardSlice(0, 0, tp_rank * f, f), ShardSlice(0, f, half + tp_rank * f, f)]
    if rule.layout is Layout.QKV:
        what = "vision_config.num_heads" if name.startswith("vision_model.") else "num_key_value_heads"
        _divide(rule.qkv(arch)[0], tp_size, what, name)
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
    Padding (vocabulary rows, vision MLP rows/columns) is trimmed. A routed expert stored
    stacked (``ParamRule.stacked``) gives its row of the stack, ``[in, out]``, named
    ``stack_name[e]``: pass the output through ``ExpertStacker`` to write a checkpoint.
    """
    resolved = _resolve(name, arch)
    rule, hf = resolved.rule, resolved.hf()
    if not rule.exported:
        return []
    if rule.stacked:
        return [(f"{hf[0]}[{resolved.index['expert']}]", full.transpose(0, 1))]
    if rule.layout is Layout.COPY:
        if rule.hf_size is not None:
            full = full.narrow(rule.tp_dim, 0, rule.hf_size(arch))
        if rule.row_order is not None:  # HF row i is megatron row inverse[i]
            full = full.index_select(0, _inverse_order(rule, arch).to(full.device))
        return [(hf[0], full)]
    if rule.layout is Layout.GATE_UP:
        gate, up = full.chunk(2, dim=0)
        if rule.hf_size is not None:
            gate, up = gate[: rule.hf_size(arch)], up[: rule.hf_size(arch)]
        return [(hf[0], gate), (hf[1], up)]
    # QKV: [groups, (q_per_group + 2) * head_dim, ...] -> q, k, v
    g, qpg, d = rule.qkv(arch)
    rest = full.shape[1:]
    q, k, v = full.reshape(g, (qpg + 2) * d, *rest).split([qpg * d, d, d], dim=1)
    q, k, v = (t.reshape(-1, *rest) for t in (q, k, v))
    if len(hf) == 1:  # fused [q; k; v] (vision blocks)
        return [(hf[0], torch.cat([q, k, v]))]
    return [(hf[0], q), (hf[1], k), (hf[2], v)]


def expected_hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor of ``arch``'s checkpoint, in export order (a fresh dict); stacked
    experts in the hub's orientation."""
    return dict(_expected_hf_shapes(arch))


@functools.lru_cache(maxsize=64)
def _expected_hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    stacker = ExpertStacker(arch)
    for name in mcore_param_names(arch):
        # Run the export transform on shape-only tensors: the spec is its own shape oracle.
        meta = torch.empty(_resolve(name, arch).rule.shape(arch, 1), device="meta")
        for hf_row, t in mcore_to_hf(name, meta, arch):
            for hf_name, whole in stacker.add(hf_row, t):
                shapes[hf_name] = tuple(whole.shape)
    return shapes


@functools.lru_cache(maxsize=64)
def _stacked_hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """The stacked expert tensors of ``arch``'s checkpoint and their shapes (hub orientation)."""
    stacked = {
        t.format(layer=i)
        for rule in get_arch_spec(arch).rules
        if rule.stacked and rule.when(arch)
        for i in range(arch.num_layers)
        if rule.on_layer is None or rule.on_layer(arch, i)
        for t in rule.hf
    }
    return {n: s for n, s in _expected_hf_shapes(arch).items() if n in stacked}


def _read_padded(
    source: TensorSource,
    hf_name: str,
    dim: int,
    start: int,
    length: int,
    hf_size: int,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """Rows ``[start, start + length)`` along ``dim`` of an HF tensor of ``hf_size`` rows there,
    zero beyond them (megatron's padding)."""
    stop = min(start + length, hf_size)
    rows = source.read(hf_name, dim, start, stop) if stop > start else None
    if rows is not None and rows.shape[dim] == length:
        return rows
    out_shape = list(shape)
    out_shape[dim] = length
    out = torch.zeros(out_shape, dtype=rows.dtype if rows is not None else torch.float32)
    if rows is not None:
        out.narrow(dim, 0, rows.shape[dim]).copy_(rows)
    return out


@functools.lru_cache(maxsize=256)
def _order(rule: ParamRule, arch: ModelArch) -> torch.Tensor:
    return torch.tensor(rule.row_order(arch), dtype=torch.long)


@functools.lru_cache(maxsize=256)
def _inverse_order(rule: ParamRule, arch: ModelArch) -> torch.Tensor:
    return torch.argsort(_order(rule, arch))


def _read_reordered(
    source: TensorSource, hf_name: str, rule: ParamRule, arch: ModelArch, slices: list[ShardSlice]
) -> torch.Tensor:
    """A ``row_order`` rule's rows (this rank's slice along dim 0, or all): reads only the span of
    HF rows they come from."""
    order = _order(rule, arch)
    if slices:
        order = order[slices[0].full_start : slices[0].full_start + slices[0].length]
    lo, hi = int(order.min()), int(order.max()) + 1
    return source.read(hf_name, 0, lo, hi)[order - lo]


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
    if rule.stacked:  # expert e's row of the layer's stack, [in, out] -> megatron's [out, in]
        e = resolved.index["expert"]
        whole = source.read(hf[0], 0, e, e + 1)[0].transpose(0, 1)
        return split_tp_shard(name, whole, arch, tp_rank, tp_size).contiguous()
    slices = tp_shard_slices(name, arch, tp_rank, tp_size)
    if rule.layout is Layout.COPY and rule.row_order is not None:
        return _read_reordered(source, hf[0], rule, arch, slices)
    if rule.layout is Layout.COPY:
        if not slices:
            return source.read(hf[0])
        s = slices[0]
        if rule.hf_size is None:
            return source.read(hf[0], s.dim, s.full_start, s.full_start + s.length)
        return _read_padded(source, hf[0], s.dim, s.full_start, s.length, rule.hf_size(arch), expected[hf[0]])
    if rule.layout is Layout.GATE_UP:
        f = slices[0].length
        size = expected[hf[0]][0]
        return torch.cat([_read_padded(source, h, 0, tp_rank * f, f, size, expected[h]) for h in hf], dim=0)
    # QKV: this rank owns key/value groups [g0, g0 + groups).
    g, qpg, d = rule.qkv(arch)
    groups = g // tp_size
    g0 = tp_rank * groups
    if len(hf) == 1:  # fused [q; k; v]: the three are row ranges of one tensor
        fused = (hf[0], hf[0], hf[0])
        offsets = (0, g * qpg * d, g * qpg * d + g * d)
    else:
        fused, offsets = hf, (0, 0, 0)
    q = source.read(fused[0], 0, offsets[0] + g0 * qpg * d, offsets[0] + (g0 + groups) * qpg * d)
    k = source.read(fused[1], 0, offsets[1] + g0 * d, offsets[1] + (g0 + groups) * d)
    v = source.read(fused[2], 0, offsets[2] + g0 * d, offsets[2] + (g0 + groups) * d)
    rest = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(groups, qpg * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    )
    return grouped.reshape(groups * (qpg + 2) * d, *rest)
