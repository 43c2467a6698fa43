"""Pipeline stages: which model chunk holds which parameter, and local ⇄ global layer names.

A model chunk numbers its layers from 0; the HF⇄mcore spec, megatron's
distributed checkpoints and the weight converter use global layer numbers.
Megatron's even split is assumed (no uneven first/last stages, no custom
pipeline layout): with ``pp`` stages and ``vpp`` virtual stages the model is
cut into ``pp × vpp`` equal chunks assigned round-robin, so chunk ``v`` of
pipeline rank ``p`` is chunk ``v·pp + p`` (checked against megatron's
``get_transformer_layer_offset`` in the tests).

Only the language model's layers are split: ``decoder.layers.N.`` of a text
model, ``language_model.decoder.layers.N.`` of a vision-language one. The
vision tower (``vision_model.``, whose own blocks are also called
``decoder.layers``) lives whole on the first chunk of pipeline rank 0, with
the embedding; the final norm and output layer live on the last chunk of the
last rank.

Experts follow the same idea one level down: expert parallelism (EP) gives each
EP rank ``num_experts / ep`` consecutive experts, numbered from 0 in its chunk
(``mlp.experts.local_experts.{i}``, or ``mlp.experts.linear_fc1.weight{i}`` with
transformer-engine's grouped experts); ``local_to_global_expert`` and
``expert_owner`` translate. Pure functions, no megatron.
"""

from __future__ import annotations

import re

__all__ = [
    "FIRST_STAGE_PREFIXES",
    "StageError",
    "expert_owner",
    "local_to_global_expert",
    "global_to_local_layer",
    "layer_offset",
    "local_to_global_layer",
    "param_owner",
]


class StageError(ValueError):
    """The layers do not fit the pipeline layout, or a name is outside its chunk."""


# The language model's layers, with or without the vision-language wrapper's prefix.
_LAYER_RE = re.compile(r"^(?P<prefix>(?:language_model\.)?decoder\.layers\.)(?P<layer>\d+)\.")
FIRST_STAGE_PREFIXES = ("embedding.", "language_model.embedding.", "vision_model.")
"""Parameters that live on the first chunk of pipeline rank 0 (besides its layers)."""


def _layers_per_chunk(num_layers: int, pp_size: int, vpp_size: int | None) -> int:
    chunks = pp_size * (vpp_size or 1)
    if num_layers % chunks:
        raise StageError(
            f"{num_layers} layers do not split evenly over PP={pp_size} x VPP={vpp_size or 1} = {chunks} "
            "model chunks; pick sizes whose product divides the number of layers"
        )
    return num_layers // chunks


def layer_offset(
    num_layers: int, pp_rank: int, pp_size: int, vpp_rank: int | None = None, vpp_size: int | None = None
) -> int:
    """Global index of the first layer of chunk ``vpp_rank`` on pipeline rank ``pp_rank``.

    Megatron's even split: with VPP, the model is cut into ``pp × vpp`` chunks
    assigned round-robin, so chunk ``v`` of rank ``p`` is chunk ``v·pp + p``.
    """
    per_chunk = _layers_per_chunk(num_layers, pp_size, vpp_size)
    return ((vpp_rank or 0) * pp_size + pp_rank) * per_chunk


def local_to_global_layer(
    name: str,
    num_layers: int,
    pp_rank: int,
    pp_size: int,
    vpp_rank: int | None = None,
    vpp_size: int | None = None,
) -> str:
    """Rewrite a model chunk's parameter name to global layer numbering (other names pass through)."""
    m = _LAYER_RE.match(name)
    if not m:
        return name
    per_chunk = _layers_per_chunk(num_layers, pp_size, vpp_size)
    local = int(m.group("layer"))
    if local >= per_chunk:
        raise StageError(f"{name}: local layer {local} is beyond this chunk's {per_chunk} layers")
    offset = layer_offset(num_layers, pp_rank, pp_size, vpp_rank, vpp_size)
    return f"{m.group('prefix')}{offset + local}.{name[m.end() :]}"


def global_to_local_layer(
    name: str, num_layers: int, pp_size: int, vpp_size: int | None = None
) -> tuple[int | None, int | None, str]:
    """``(pp_rank, vpp_rank, local name)`` of the chunk that owns a language-model layer parameter.

    Returns ``(None, None, name)`` for every other parameter (see ``param_owner``).
    """
    m = _LAYER_RE.match(name)
    if not m:
        return None, None, name
    per_chunk = _layers_per_chunk(num_layers, pp_size, vpp_size)
    layer = int(m.group("layer"))
    chunk, local = divmod(layer, per_chunk)
    vpp_rank, pp_rank = divmod(chunk, pp_size)
    return pp_rank, (vpp_rank if vpp_size else None), f"{m.group('prefix')}{local}.{name[m.end() :]}"


def param_owner(
    name: str, num_layers: int, pp_size: int, vpp_size: int | None = None
) -> tuple[int, int | None, str]:
    """``(pp_rank, vpp_rank, local name)`` of the chunk holding any global parameter name.

    Language-model layers follow the even split; the embedding and the whole vision
    tower sit on the first chunk of rank 0; everything else (final norm, output layer)
    on the last chunk of the last rank.
    """
    pp_rank, vpp_rank, local = global_to_local_layer(name, num_layers, pp_size, vpp_size)
    if pp_rank is not None:
        return pp_rank, vpp_rank, local
    if name.startswith(FIRST_STAGE_PREFIXES):
        return 0, (0 if vpp_size else None), name
    return pp_size - 1, ((vpp_size - 1) if vpp_size else None), name


# A routed expert's index: SequentialMLP's ``local_experts.{i}.`` or TEGroupedMLP's ``weight{i}`` suffix.
_EXPERT_RE = re.compile(
    r"(?P<head>\.mlp\.experts\.(?:local_experts\.|linear_fc[12]\.weight))(?P<expert>\d+)(?P<tail>\.|$)"
)


def _experts_per_rank(num_experts: int, ep_size: int) -> int:
    if ep_size < 1 or num_experts % ep_size:
        raise StageError(
            f"{num_experts} experts do not split evenly over expert_model_parallel_size={ep_size}; "
            "pick an EP size that divides the number of experts"
        )
    return num_experts // ep_size


def local_to_global_expert(name: str, num_experts: int, ep_rank: int, ep_size: int) -> str:
    """Rewrite an EP rank's local expert index in ``name`` to the global one (other names pass through)."""
    m = _EXPERT_RE.search(name)
    if not m:
        return name
    per_rank = _experts_per_rank(num_experts, ep_size)
    local = int(m.group("expert"))
    if local >= per_rank:
        raise StageError(f"{name}: local expert {local} is beyond this EP rank's {per_rank} experts")
    return (
        f"{name[: m.start()]}{m.group('head')}{ep_rank * per_rank + local}{m.group('tail')}{name[m.end() :]}"
    )


def expert_owner(name: str, num_experts: int, ep_size: int) -> tuple[int | None, str]:
    """``(ep_rank, name with the local expert index)`` of a global expert parameter; ``(None, name)``
    for parameters every EP rank holds."""
    m = _EXPERT_RE.search(name)
    if not m:
        return None, name
    ep_rank, local = divmod(int(m.group("expert")), _experts_per_rank(num_experts, ep_size))
    return ep_rank, f"{name[: m.start()]}{m.group('head')}{local}{m.group('tail')}{name[m.end() :]}"
