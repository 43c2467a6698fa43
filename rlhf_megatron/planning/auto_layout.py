"""``parallelism: auto``: search the layouts that fit and pick the fastest predicted one.

Role: a layout key set to ``auto`` (actor/ref/critic ``megatron.tensor_model_parallel_size``,
``pipeline_model_parallel_size``, ``context_parallel_size``, ``expert_model_parallel_size``, the
rollout's ``tensor_model_parallel_size``, a per-GPU micro-batch, a trained role's
``megatron.use_distributed_optimizer``), or every such key a config leaves
unset under the top-level ``parallelism: auto``, is searched here:

1. ``take_auto`` takes the ``auto`` values out of the loader's flat layers before the typed merge
   (the schema's fields are ints), so the config is built with the schema's defaults there;
2. ``search_layouts`` enumerates the values of the searched keys (divisors of the world for
   parallel sizes, tensor parallelism within a node; for micro-batches, a rank's share of the
   batch halved down to 1), keeps the candidates ``validate_config`` accepts whose memory plan
   (``planner.plan_memory``) leaves ``MEMORY_MARGIN`` of ``trainer.gpu_memory_gb`` free in every
   phase (of what vLLM's budget leaves, where it is awake), and ranks them by the cost model's
   predicted step time (``cost_model.predict_step``); per layout it keeps the largest
   micro-batches that fit (fewer passes are faster; found by bisection), or with a pipeline the
   cheapest of those that fit (smaller ones shrink the bubble), sized with the optimizer state
   sharded; then, with those micro-batches, an unsharded (plain DDP) optimizer where it still
   fits and is predicted faster;
3. ``resolve_auto`` writes the winner's numbers back into the config, which then goes through the
   ordinary validation and normalisation. Explicit keys are never changed.

When nothing fits, the error names the role and memory term that overflows in the layout that
came closest, and what would fit: the largest micro-batches, or the smallest GPU memory and
GPU count.

Boundaries: no processes; reads and writes a built config.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import pickle
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config import roles as roles_mod
from rlhf_megatron.config.auto_keys import LAYOUT_KEYS, MICRO_KEYS, OPTIMIZER_KEYS, ROLLOUT_TP
from rlhf_megatron.config.errors import ConfigError
from rlhf_megatron.config.normalize import normalize_config
from rlhf_megatron.config.roles import MICRO_BATCH_SPECS, ROLE_SECTIONS
from rlhf_megatron.planning.arch import arch_for_role, count_parameters
from rlhf_megatron.planning.cost_model import CostConstants, StepCost, load_constants, predict_step
from rlhf_megatron.planning.memory import DTYPE_BYTES, GIB, MemoryPlan, Phase, plan_memory
from rlhf_megatron.planning.validate import validate_config

__all__ = [
    "MEMORY_MARGIN",
    "Candidate",
    "LayoutSearch",
    "format_search",
    "resolve_auto",
    "search_layouts",
]

MEMORY_MARGIN = 0.10
"""Share of ``trainer.gpu_memory_gb`` a chosen layout leaves free (the planner is within ~3% on
H100; allocator fragmentation and the unmodelled take the rest). Where vLLM is awake, a share of
what its budget leaves: the budget is vLLM's own reservation, not an estimate."""


@dataclass
class Candidate:
    """One layout that passed validation: its values, memory plan and predicted step."""

    values: dict[str, int]
    plan: MemoryPlan
    cost: StepCost | None = None
    fits: bool = False

    @property
    def peak_gib(self) -> float:
        return self.plan.peak.total / GIB

    def describe(self) -> str:
        return describe_values(self.values)


@dataclass
class LayoutSearch:
    """The ranked candidates (fastest first) and why others were dropped."""

    keys: list[str]
    ranked: list[Candidate] = field(default_factory=list)
    too_big: list[Candidate] = field(default_factory=list)
    invalid: int = 0
    first_error: ConfigError | None = None
    """Validation's objections to the first rejected layout (raised when none passes)."""
    constants: CostConstants | None = None


def describe_values(values: dict[str, int]) -> str:
    """``actor TP1 PP1 CP1 EP1 DDP, rollout TP1, micro actor.ppo 32 ref.log_prob 128`` (``DDP``: a
    plain data-parallel optimizer, ``ZeRO-1``: the distributed one)."""
    abbrev = {"tensor": "TP", "pipeline": "PP", "context": "CP", "expert": "EP"}
    roles: dict[str, list[str]] = {}
    micro = []
    for key, value in sorted(values.items()):
        parts = key.split(".")
        if key in MICRO_KEYS:
            micro.append(f"{parts[-2]}.{parts[-1].replace('_micro_batch_size_per_gpu', '')} {value}")
            continue
        role = "rollout" if key == ROLLOUT_TP else parts[-3]
        if key in OPTIMIZER_KEYS:
            roles.setdefault(role, []).append("ZeRO-1" if value else "DDP")
            continue
        roles.setdefault(role, []).append(f"{abbrev[parts[-1].split('_')[0]]}{value}")
    out = [f"{role} {' '.join(sizes)}" for role, sizes in roles.items()]
    return ", ".join(out + ([f"micro {' '.join(micro)}"] if micro else []))


def _rollout_tp_across_nodes(cfg: DictConfig, divisors: list[int], node: int) -> list[int]:
    """vLLM's TP over several nodes, only where one node's share of vLLM's memory
    (``gpu_memory_utilization``) cannot hold the model's weights (DeepSeek-V3's 1.34 TB of bf16 on
    8 x 141 GB): the smallest multiple of the node size that can, as vLLM holds every expert."""
    arch = arch_for_role(cfg, "actor")[0]
    if arch is None:
        return []
    r = cfg.actor_rollout_ref.rollout
    budget = r.gpu_memory_utilization * cfg.trainer.gpu_memory_gb * GIB
    weights = count_parameters(arch).total * DTYPE_BYTES[r.dtype]
    if weights / node <= budget:
        return []
    return [d for d in divisors if d > node and d % node == 0 and weights / d <= budget][:1]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layout_values(cfg: DictConfig, key: str, world: int) -> list[int]:
    """The values ``key`` may take. Tensor parallelism (Megatron's and vLLM's) stays inside a node:
    its collectives run in every layer, so across nodes they would run over the network. The one
    exception is vLLM's where a node cannot hold the weights (``_rollout_tp_across_nodes``)."""
    if key == ROLLOUT_TP:
        node = roles_mod.rollout_gpus_per_node(cfg)
        divisors = _divisors(roles_mod.rollout_world_size(cfg, world))
        return [d for d in divisors if d <= node] + _rollout_tp_across_nodes(cfg, divisors, node)
    if key.endswith("tensor_model_parallel_size"):
        return [d for d in _divisors(world) if d <= cfg.trainer.n_gpus_per_node]
    arch = arch_for_role(cfg, "actor")[0]
    if key.endswith("expert_model_parallel_size"):
        experts = arch.moe.num_experts if arch is not None and arch.moe is not None else 0
        return [d for d in _divisors(world) if experts % d == 0] if experts else [1]
    if key.endswith("pipeline_model_parallel_size"):
        layers = arch.num_layers if arch is not None else world
        return [d for d in _divisors(world) if d <= layers]
    return _divisors(world)


def _model_parallel_keys() -> list[list[str]]:
    """Each trainer role's TP, PP and CP keys, whose product must divide the trainer's world."""
    return [
        [
            f"{ROLE_SECTIONS[role]}.megatron.{k}"
            for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
        ]
        for role in ("actor", "ref", "critic")
    ]


def _divides_world(cfg: DictConfig, layout: dict[str, int], world: int) -> bool:
    """Each role's TP x PP x CP (searched or as configured) divides the trainer's world."""
    for keys in _model_parallel_keys():
        if world % math.prod(layout.get(k, OmegaConf.select(cfg, k) or 1) for k in keys):
            return False
    return True


def _micro_share(cfg: DictConfig, key: str) -> int:
    """Sequences a DP rank holds in the pass ``key`` sizes (the largest useful micro-batch)."""
    spec = next(s for s in MICRO_BATCH_SPECS if s.per_gpu_key == key)
    world = roles_mod.world_size(cfg)
    dp = roles_mod.data_parallel_size(cfg, spec.role, world) or 1
    n = cfg.actor_rollout_ref.rollout.n
    if key in (roles_mod.ACTOR_TRAIN_MICRO.per_gpu_key, roles_mod.CRITIC_TRAIN_MICRO.per_gpu_key):
        mini = OmegaConf.select(cfg, key.rsplit(".", 1)[0] + ".ppo_mini_batch_size")
        return max(1, math.ceil(mini * n / dp))
    return max(1, math.ceil(cfg.data.train_batch_size * n / dp))


def _micro_levels(share: int) -> list[int]:
    """``share``, then halved down to 1: the micro-batches tried, largest first."""
    out = [share]
    while out[-1] > 1:
        out.append(max(1, out[-1] // 2))
    return out


def _best_micro(
    cfg: DictConfig,
    layout: dict[str, int],
    micro_keys: list[str],
    base: Candidate,
    world_size: int | None,
    gpu_gb: float | None,
    followers: dict[str, list[str]],
    constants: CostConstants,
) -> Candidate:
    """The layout's micro-batches, all keys stepping down their halvings together (``base``, every
    micro-batch 1, fits), priced. Memory grows with the micro-batch, so a bisection over the levels
    finds the largest that fits in log2 of the tries a scan would make. Without a pipeline the
    largest is the fastest (fewer passes); with one, more and smaller micro-batches shrink the
    pipeline bubble, so every smaller level is priced too and the cheapest kept."""
    shares = {k: _micro_share(base._cfg, k) for k in micro_keys}  # type: ignore[attr-defined]
    levels = {k: _micro_levels(s) for k, s in shares.items()}
    last = max(len(v) for v in levels.values()) - 1  # every key at 1: ``base``
    tried: dict[int, Candidate | ConfigError] = {last: base}  # the bisection's tries, priced once

    def at(level: int) -> Candidate | ConfigError:
        if level not in tried:
            values = layout | {k: v[min(level, len(v) - 1)] for k, v in levels.items()}
            tried[level] = _try(cfg, values, world_size, gpu_gb, followers)
        return tried[level]

    found, lo, hi = base, 0, last
    while lo < hi:
        mid = (lo + hi) // 2
        cand = at(mid)
        if isinstance(cand, Candidate) and cand.fits:
            found, hi = cand, mid
        else:
            lo = mid + 1
    found.cost = predict_step(found._cfg, constants)  # type: ignore[attr-defined]
    if _pipelined(found._cfg):  # type: ignore[attr-defined]
        for level in range(lo + 1, last + 1):
            cand = at(level)
            if isinstance(cand, Candidate) and cand.fits:
                cand.cost = cand.cost or predict_step(cand._cfg, constants)  # type: ignore[attr-defined]
                if cand.cost.total < found.cost.total:
                    found = cand
    return found


def _best_optimizer(
    cfg: DictConfig,
    found: Candidate,
    optimizer_keys: list[str],
    world_size: int | None,
    gpu_gb: float | None,
    followers: dict[str, list[str]],
    constants: CostConstants,
) -> Candidate:
    """``found`` (every searched role's optimizer sharded) or, with its micro-batches, the cheapest
    variant with some of them unsharded that still fits: a plain DDP optimizer holds the whole
    fp32 state on every rank, so it is taken only where the memory allows it and it is faster.
    A role at DP 1 has nothing to shard over: the same plan and price either way, so not tried."""
    world = roles_mod.world_size(found._cfg, world_size)  # type: ignore[attr-defined]
    optimizer_keys = [
        k
        for k in optimizer_keys
        if (roles_mod.data_parallel_size(found._cfg, k.split(".")[-3], world) or 1) > 1  # type: ignore[attr-defined]
    ]
    for combo in itertools.product((True, False), repeat=len(optimizer_keys)):
        if all(combo):
            continue
        cand = _try(cfg, found.values | dict(zip(optimizer_keys, combo)), world_size, gpu_gb, followers)
        if isinstance(cand, Candidate) and cand.fits:
            cand.cost = predict_step(cand._cfg, constants)  # type: ignore[attr-defined]
            if cand.cost.total < found.cost.total:  # type: ignore[union-attr]
                found = cand
    return found


def _pipelined(cfg: DictConfig) -> bool:
    """Whether a trained role runs a pipeline (its bubble depends on the micro-batch count)."""
    return any(
        (OmegaConf.select(cfg, f"{ROLE_SECTIONS[r]}.megatron.pipeline_model_parallel_size") or 1) > 1
        for r in ("actor", "critic")
    )


def _write(cfg: DictConfig, values: dict[str, int], followers: dict[str, list[str]]) -> None:
    for key, value in values.items():
        for target in (key, *followers.get(key, ())):
            OmegaConf.update(cfg, target, value, merge=False)


def _leaves_margin(plan: MemoryPlan, phase: Phase) -> bool:
    """Whether ``phase`` leaves ``MEMORY_MARGIN`` of the GPU free. Where vLLM is awake its part is
    its budget (``gpu_memory_utilization`` x the GPU), which vLLM keeps to itself by sizing its KV
    cache, not an estimate; the margin covers the estimated rest, so it is taken on what the
    budget leaves of the GPU."""
    reserved = phase.parts.get("vllm", 0.0)
    reserved = reserved if reserved == plan.rollout.budget else 0.0
    return phase.total - reserved <= (plan.gpu_memory - reserved) * (1 - MEMORY_MARGIN)


_PICKLED: dict[int, tuple[DictConfig, bytes]] = {}
"""The config each running search copies from, pickled once (``_fresh_copy``)."""


def _fresh_copy(cfg: DictConfig) -> DictConfig:
    """A deep copy of ``cfg``. Unpickling one pickle of it is ~6x faster than OmegaConf's deepcopy
    (3 ms against 22 ms for a preset), which was most of a candidate's cost: a search of a
    256-GPU MoE preset tries thousands."""
    entry = _PICKLED.get(id(cfg))
    if entry is None or entry[0] is not cfg:
        entry = _PICKLED[id(cfg)] = (cfg, pickle.dumps(cfg))
    return pickle.loads(entry[1])


def _try(
    cfg: DictConfig,
    values: dict[str, int],
    world: int | None,
    gpu_gb: float | None,
    followers: dict[str, list[str]],
) -> Candidate | ConfigError:
    """``values`` written into a copy of ``cfg``, planned; validation's error when it rejects them."""

    trial = _fresh_copy(cfg)
    _write(trial, values, followers)
    try:
        validate_config(trial, world_size=world)
        normalize_config(trial, world_size=world)
        plan = plan_memory(trial, gpu_memory_gb=gpu_gb, world_size=world)
    except ConfigError as exc:
        return exc
    # A role the planner cannot size (its checkpoint is not there yet) does not rule a layout out.
    memory_problems = [p for p in plan.problems if not p.startswith("not planned:")]
    fits = not memory_problems and all(_leaves_margin(plan, p) for p in plan.phases)
    cand = Candidate(values=dict(values), plan=plan, fits=fits)
    cand._cfg = trial  # type: ignore[attr-defined]  # for the cost model, once it fits
    return cand


def search_layouts(
    cfg: DictConfig,
    keys: list[str],
    world_size: int | None = None,
    gpu_memory_gb: float | None = None,
    constants: CostConstants | None = None,
    followers: dict[str, list[str]] | None = None,
) -> LayoutSearch:
    """Every combination of the searched layout keys, each with the largest micro-batches that
    fit; the fitting ones ranked by predicted step time (see the module doc)."""
    import warnings

    world = roles_mod.world_size(cfg, world_size)
    constants = constants or load_constants("cpu" if cfg.trainer.device == "cpu" else "cuda")
    search = LayoutSearch(keys=keys, constants=constants)
    followers = followers or {}
    layout_keys = [k for k in keys if k in LAYOUT_KEYS]
    micro_keys = [k for k in keys if k in MICRO_KEYS]
    optimizer_keys = [k for k in keys if k in OPTIMIZER_KEYS]
    sharded = {k: True for k in optimizer_keys}  # the micro-batches are sized with the smaller state
    options = [_layout_values(cfg, k, world) for k in layout_keys]
    with warnings.catch_warnings(), _pickled_once(cfg):
        warnings.simplefilter("ignore")  # each candidate would repeat the config's own warnings
        for combo in itertools.product(*options):
            layout = dict(zip(layout_keys, combo))
            if not _divides_world(cfg, layout, world):  # what validation would say, without asking it
                search.invalid += 1
                continue
            base = _try(
                cfg, layout | sharded | {k: 1 for k in micro_keys}, world_size, gpu_memory_gb, followers
            )
            if isinstance(base, ConfigError):
                search.invalid += 1
                search.first_error = search.first_error or base
                continue
            best = base
            if base.fits and micro_keys:
                best = _best_micro(
                    cfg, layout | sharded, micro_keys, base, world_size, gpu_memory_gb, followers, constants
                )
            if best.fits:
                best.cost = best.cost or predict_step(best._cfg, constants)  # type: ignore[attr-defined]
                if optimizer_keys:
                    best = _best_optimizer(
                        cfg, best, optimizer_keys, world_size, gpu_memory_gb, followers, constants
                    )
                search.ranked.append(best)
            else:
                search.too_big.append(best)
    search.ranked.sort(key=lambda c: c.cost.total if c.cost else math.inf)
    return search


@contextlib.contextmanager
def _pickled_once(cfg: DictConfig):
    """Keep ``cfg``'s pickle for the search's copies; forget it after."""
    try:
        yield
    finally:
        _PICKLED.pop(id(cfg), None)


def _overflow(cand: Candidate) -> str:
    """The phase, role and memory term that make ``cand`` too big."""
    peak = cand.plan.peak
    part = max(peak.parts, key=lambda name: peak.parts[name])
    role = next((r for r in cand.plan.roles if r.role == part), None)
    if role is None:
        term = f"{part} {peak.parts[part] / GIB:.2f} GiB"
    else:
        terms = {n: getattr(role, n) for n in ("weights", "grads", "optimizer", "activations", "logits")}
        name = max(terms, key=lambda n: terms[n])
        term = f"{part}'s {name} {terms[name] / GIB:.2f} GiB (of {peak.parts[part] / GIB:.2f} GiB)"
    return f"{peak.name} needs {peak.total / GIB:.2f} GiB per GPU, the largest part {term}"


def _what_fits(
    cfg: DictConfig,
    keys: list[str],
    world_size: int | None,
    gpu_gb: float | None,
    followers: dict[str, list[str]],
    closest: Candidate,
) -> str:
    """The largest micro-batches (if explicit ones are too big), else the smallest GPU memory or
    GPU count on which the closest layout fits (its parallel sizes kept, micro-batches searched)."""
    explicit_micro = [k for k in MICRO_KEYS if k not in keys and OmegaConf.select(cfg, k) is not None]
    explicit_micro = [k for k in explicit_micro if k.split(".")[-2] in ("actor", "rollout", "ref", "critic")]
    if explicit_micro:
        wider = search_layouts(
            cfg, sorted(set(keys) | set(explicit_micro)), world_size, gpu_gb, followers=followers
        )
        if wider.ranked:
            best = wider.ranked[0]
            sizes = ", ".join(f"{k}={best.values[k]}" for k in explicit_micro if k in best.values)
            return f"the largest micro-batches that fit: {sizes} (or set them to auto)"
    pinned = cfg.copy()
    _write(pinned, {k: v for k, v in closest.values.items() if k in LAYOUT_KEYS}, followers)
    micro = [k for k in keys if k in MICRO_KEYS]
    world = roles_mod.world_size(cfg, world_size)
    gpu = gpu_gb if gpu_gb is not None else cfg.trainer.gpu_memory_gb
    options = []
    for factor in (2, 4, 8, 16, 32, 64, 128):
        if search_layouts(pinned, micro, world_size, gpu * factor, followers=followers).ranked:
            options.append(f"{world} GPUs of {gpu * factor:g} GiB (trainer.gpu_memory_gb)")
            break
    for factor in (2, 4, 8, 16, 32, 64):
        if search_layouts(pinned, micro, world * factor, gpu, followers=followers).ranked:
            options.append(f"{world * factor} GPUs of {gpu:g} GiB (trainer.nnodes x n_gpus_per_node)")
            break
    return " or ".join(options) or "no layout of this model and batch up to 64x the GPUs or 128x the memory"


def _nothing_divides(cfg: DictConfig, keys: list[str], world: int) -> str:
    """Why no layout was tried: the sizes set in the config (not searched) divide no world."""
    pinned = [
        f"{k}={value}"
        for role_keys in _model_parallel_keys()
        for k in role_keys
        if k not in keys and (value := OmegaConf.select(cfg, k) or 1) > 1
    ]
    sizes = ", ".join(pinned) if pinned else "no parallel size"
    return (
        f"parallelism auto: no layout to search: the sizes set in the config ({sizes}) do not divide "
        f"the {world} GPUs (trainer.nnodes x trainer.n_gpus_per_node); leave them out of the config "
        "(auto searches them) or use a GPU count they divide"
    )


def resolve_auto(
    cfg: DictConfig,
    keys: list[str],
    world_size: int | None = None,
    gpu_memory_gb: float | None = None,
    followers: dict[str, list[str]] | None = None,
    constants: CostConstants | None = None,
) -> LayoutSearch:
    """Search ``keys`` and write the fastest fitting layout into ``cfg``; raise ``ConfigError``
    naming what overflows and what would fit when none does."""
    search = search_layouts(cfg, keys, world_size, gpu_memory_gb, constants, followers)
    if not search.ranked:
        world = roles_mod.world_size(cfg, world_size)
        gpu = gpu_memory_gb if gpu_memory_gb is not None else cfg.trainer.gpu_memory_gb
        if not search.too_big and search.first_error is not None:
            # Nothing valid in any layout: validation's own messages say what to change (with the
            # first layout tried written in), as they would without auto.
            raise search.first_error
        if not search.too_big:
            raise ConfigError([_nothing_divides(cfg, keys, world)])
        closest = min(search.too_big, key=lambda c: c.plan.peak.total)
        raise ConfigError(
            [
                f"parallelism auto: no layout fits {world} GPUs x {gpu:g} GiB with a "
                f"{MEMORY_MARGIN:.0%} margin; the closest ({closest.describe()}): {_overflow(closest)}. "
                f"What would fit: {_what_fits(cfg, keys, world_size, gpu_memory_gb, followers or {}, closest)}"
            ]
        )
    _write(cfg, search.ranked[0].values, followers or {})
    return search


def format_search(search: LayoutSearch, limit: int | None = 2) -> str:
    """The choice and the runner-up (or the first ``limit`` ranks; None: all) with predicted
    memory and step time."""
    searched = ", ".join(k.replace("actor_rollout_ref.", "").replace(".megatron", "") for k in search.keys)
    lines = [
        f"parallelism auto: {len(search.ranked)} layouts fit ({len(search.too_big)} too big, "
        f"{search.invalid} invalid); searched {searched}"
    ]
    if search.constants is not None:
        lines.append(f"  cost model: {search.constants.source}")
    shown = search.ranked if limit is None else search.ranked[:limit]
    for i, cand in enumerate(shown):
        label = "chosen" if i == 0 else "runner-up" if i == 1 else f"#{i + 1}"
        phases = (
            " ".join(f"{k} {v:.2f}" for k, v in cand.cost.phases.items() if v >= 0.005) if cand.cost else ""
        )
        lines.append(
            f"  {label:<9} {cand.describe()}: step {cand.cost.total:.2f} s predicted ({phases}); "
            f"peak {cand.peak_gib:.2f} of {cand.plan.gpu_memory / GIB:g} GiB ({cand.plan.peak.name})"
        )
    for cand in search.too_big[: (None if limit is None else 0)]:
        lines.append(f"  too big   {cand.describe()}: {_overflow(cand)}")
    return "\n".join(lines)
