"""Predicted seconds per RL step of a loaded config, phase by phase (``parallelism: auto`` ranks layouts by it).

Role: turn a layout (actor TP, PP, CP, EP, sequence parallelism, DP, the rollout's TP, the
per-GPU micro-batches) into counts of what a step does, and price the counts with measured
constants. Each phase's time is a linear combination ``sum(constant[name] * feature[name])``
of features this module counts:

* ``flops``: floating-point operations one process runs (2 x active parameters per token for a
  forward pass, 3x that for forward + backward), the pipeline bubble included;
* ``layer_passes``: one micro-batch through one layer on one rank (the per-layer fixed cost of
  launching kernels and Python, which many small micro-batches pay many times);
* ``collectives`` and ``collective_bytes``: TP collectives per layer (2 all-reduces, or with
  sequence parallelism 2 all-gathers + 2 reduce-scatters, doubled in backward; 3 more per
  micro-batch for the vocab-parallel loss), CP's ring exchanges, PP's sends between stages, and
  per optimizer step the DP gradient all-reduce and the gradient norm's and non-finite check's
  synchronisations;
* ``sharded_bytes``: the distributed optimizer's gradient reduce-scatter and parameter all-gather
  in place of the all-reduce (priced on their own: over gloo the pair costs twice the all-reduce);
* ``optimizer_params``: parameters the optimizer steps on one rank per step (the rank's model
  shard, divided by DP under the distributed optimizer: the memory-bound Adam update it saves);
* ``engine_steps`` and ``engine_collectives``: vLLM iterations per engine (prefill chunks, then one
  per response token), and at rollout TP > 1 its all-reduces per iteration (2 per layer + the
  step's broadcast);
* ``sync_bytes`` and ``reshards``: the weights sent to vLLM, and whether they change layout;
* ``fixed``: one per phase.

The constants (``CostConstants``) come from ``tools/calibrate_cost_model.py``: a probe of this
machine (matmul throughput, gloo collective latency and bandwidth) and a least-squares fit of
the per-phase times in the ``metrics.jsonl`` of short runs at several layouts. They are stored
as JSON under ``configs/cost_model/`` (``cpu.json``; ``gpu.json`` from the H200 measurements
under ``docs/``). Absolute times transfer between machines only roughly; the ranking is what
the search uses.

Boundaries: arithmetic on a normalised config; no processes, no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config import roles as roles_mod
from rlhf_megatron.config.presets import CONFIGS_DIR
from rlhf_megatron.planning.arch import arch_for_role, count_parameters

__all__ = [
    "COST_MODEL_DIR",
    "PHASES",
    "CostConstants",
    "StepCost",
    "load_constants",
    "phase_features",
    "predict_step",
]

COST_MODEL_DIR = CONFIGS_DIR / "cost_model"
PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "sync_weights")
"""The phases priced, named as ``metrics.jsonl``'s ``timing_s/<phase>``."""
FORWARD_PHASES = ("old_log_prob", "ref", "values")
UPDATE_PHASES = ("update_critic", "update_actor")
"""Megatron passes: the forward-only ones share one set of constants (``forward``), the updates
another (``update``: a layer pass there also runs backward and a share of the optimizer)."""
FEATURES = {
    "forward": ("flops", "layer_passes", "collectives", "collective_bytes", "fixed"),
    "update": (
        "flops",
        "layer_passes",
        "collectives",
        "collective_bytes",
        "sharded_bytes",
        "optimizer_params",
        "fixed",
    ),
    "gen": ("flops", "engine_steps", "engine_collectives", "fixed"),
    "sync_weights": ("sync_bytes", "reshards", "fixed"),
    "step": ("fixed",),
}
"""Each constant group's features; ``step`` is what a step spends outside the priced phases."""


def _group(phase: str) -> str:
    if phase in FORWARD_PHASES:
        return "forward"
    return "update" if phase in UPDATE_PHASES else phase


@dataclass(frozen=True)
class CostConstants:
    """Seconds per unit of each feature, per constant group (``FEATURES``)."""

    device: str
    seconds: dict[str, dict[str, float]]
    """``{"forward": {"flops": 6e-12, ...}, "update": {...}, "gen": {...}, "sync_weights": {...},
    "step": {...}}``."""
    source: str = ""
    """Where the numbers came from (the calibration run, its date and machine)."""

    def __post_init__(self) -> None:
        """A group or feature the model does not price would be ignored silently: refuse it."""
        for group, prices in self.seconds.items():
            if group not in FEATURES:
                raise ValueError(
                    f"cost constants ({self.source}): unknown group {group!r}; groups: {list(FEATURES)}"
                )
            unknown = sorted(set(prices) - set(FEATURES[group]))
            if unknown:
                raise ValueError(
                    f"cost constants ({self.source}): {group} has no feature {unknown}; features: {FEATURES[group]}"
                )

    @classmethod
    def from_json(cls, path: str | Path) -> CostConstants:
        data = json.loads(Path(path).read_text())
        return cls(device=data["device"], seconds=data["seconds"], source=data.get("source", str(path)))


def load_constants(device: str) -> CostConstants:
    """The stored constants for ``device`` (``cpu`` or ``cuda``): ``configs/cost_model/<cpu|gpu>.json``."""
    name = "cpu.json" if device == "cpu" else "gpu.json"
    return CostConstants.from_json(COST_MODEL_DIR / name)


@dataclass
class StepCost:
    """A predicted step: seconds per phase and their sum (with what lies between the phases)."""

    phases: dict[str, float] = field(default_factory=dict)
    features: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.phases.values())


def _megatron(cfg: DictConfig, role: str) -> DictConfig:
    return roles_mod.megatron_section(cfg, role)


def _train_features(
    cfg: DictConfig, role: str, sequences: int, passes: int, trains: bool
) -> dict[str, float]:
    """One Megatron phase of ``role`` over ``sequences`` sequences in ``passes`` optimizer steps
    (1 for a log-prob pass): its features per rank."""
    arch = arch_for_role(cfg, role)[0] or arch_for_role(cfg, "actor")[0]
    params = count_parameters(arch)
    m = _megatron(cfg, role)
    world = roles_mod.world_size(cfg)
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    dp = max(1, world // (tp * pp * cp))
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    micro_key = {
        ("actor", True): "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        ("actor", False): "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        ("ref", False): "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        ("critic", True): "critic.ppo_micro_batch_size_per_gpu",
        ("critic", False): "critic.forward_micro_batch_size_per_gpu",
    }[(role, trains)]
    micro = OmegaConf.select(cfg, micro_key) or 1
    per_rank = math.ceil(sequences / passes / dp)  # sequences a DP rank holds per optimizer step
    n_micro = passes * math.ceil(per_rank / micro)
    micro_tokens = min(micro, per_rank) * seq / cp
    k = 3 if trains else 1  # backward costs twice the forward
    bubble = 1 + (pp - 1) / max(1, n_micro // passes)
    flops = k * 2 * params.active * sequences * seq / world * bubble
    layers = arch.num_layers / pp
    per_layer = (4 if m.sequence_parallel else 2) if tp > 1 else 0
    per_layer += 2 * (cp - 1)  # CP's ring: send and receive K/V per neighbour
    collectives = n_micro * (layers * per_layer * (2 if trains else 1) + (3 if tp > 1 else 0) + 2 * (pp - 1))
    act_bytes = micro_tokens * arch.hidden_size * 4
    coll_bytes = n_micro * layers * per_layer * (2 if trains else 1) * act_bytes / max(1, tp)
    sharded_bytes = optimizer_params = 0.0
    if trains:
        collectives += passes * _optimizer_syncs(m, tp, pp, cp, dp)
        # Adam steps the rank's shard of the model, and with the distributed optimizer 1/DP of it
        optimizer_params = passes * params.total / (tp * pp) / (dp if m.use_distributed_optimizer else 1)
    if trains and dp > 1:  # the gradient all-reduce (or reduce-scatter + all-gather) per optimizer step
        grad_bytes = params.total / (tp * pp) * 4 * 2 * (dp - 1) / dp
        if m.use_distributed_optimizer:
            sharded_bytes += passes * grad_bytes
        else:
            coll_bytes += passes * grad_bytes
    return {
        "flops": flops,
        "layer_passes": n_micro * layers * (2 if trains else 1),
        "collectives": collectives,
        "collective_bytes": coll_bytes,
        "sharded_bytes": sharded_bytes,
        "optimizer_params": optimizer_params,
        "fixed": 1.0,
    }


def _optimizer_syncs(m: DictConfig, tp: int, pp: int, cp: int, dp: int) -> int:
    """Collectives an optimizer step adds to its gradient reduction (``MegatronEngine.train_step``
    and megatron's optimizer): the gradient all-reduce (data-parallel), or with the distributed
    optimizer its reduce-scatter and the parameters' all-gather; the gradient norm's all-reduce
    wherever gradients are sharded (model parallelism or the distributed optimizer); and the
    non-finite check's flag all-reduce, except where every rank holds the same gradients."""
    sharded_model = tp * pp * cp > 1 or m.expert_model_parallel_size > 1
    distributed = m.use_distributed_optimizer and dp > 1
    count = (2 if distributed else 1) if dp > 1 else 0
    count += int(sharded_model or distributed)  # grad norm over the ranks holding shards
    count += int(sharded_model or m.use_distributed_optimizer)  # NaN/inf flags
    return count


def _gen_features(cfg: DictConfig) -> dict[str, float]:
    ro = cfg.actor_rollout_ref.rollout
    arch = arch_for_role(cfg, "actor")[0]
    params = count_parameters(arch)
    world = roles_mod.rollout_world_size(cfg)
    engines = max(1, world // ro.tensor_model_parallel_size)
    sequences = cfg.data.train_batch_size * ro.n
    per_engine = math.ceil(sequences / engines)
    prompt, response = cfg.data.max_prompt_length, cfg.data.max_response_length
    waves = math.ceil(per_engine / ro.max_num_seqs)
    prefill = math.ceil(per_engine * prompt / (ro.max_num_batched_tokens or 2048))
    steps = prefill + waves * response
    tokens = sequences * (prompt + response)
    return {
        "flops": 2 * params.active * tokens / world,
        "engine_steps": steps,
        "engine_collectives": steps * (2 * arch.num_layers + 1) if ro.tensor_model_parallel_size > 1 else 0,
        "fixed": 1.0,
    }


def _sync_features(cfg: DictConfig) -> dict[str, float]:
    arch = arch_for_role(cfg, "actor")[0]
    total = count_parameters(arch).total
    m = _megatron(cfg, "actor")
    rollout_tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    # Megatron's shards are gathered over TP/PP and re-split for vLLM unless the layouts agree.
    reshards = float(m.tensor_model_parallel_size != rollout_tp or m.pipeline_model_parallel_size > 1)
    return {"sync_bytes": total * 4 / rollout_tp, "reshards": reshards, "fixed": 1.0}


def phase_features(cfg: DictConfig) -> dict[str, dict[str, float]]:
    """Each phase this config runs -> its features (see the module doc); ``step`` for the rest."""
    data, ro = cfg.data, cfg.actor_rollout_ref.rollout
    actor = cfg.actor_rollout_ref.actor
    sequences = data.train_batch_size * ro.n
    updates = math.ceil(data.train_batch_size / actor.ppo_mini_batch_size) * actor.ppo_epochs
    out = {"gen": _gen_features(cfg)}
    if not OmegaConf.select(cfg, "algorithm.rollout_correction.bypass_mode", default=False):
        out["old_log_prob"] = _train_features(cfg, "actor", sequences, 1, trains=False)
    if "ref" in roles_mod.active_roles(cfg):
        out["ref"] = _train_features(cfg, "ref", sequences, 1, trains=False)
    if "critic" in roles_mod.active_roles(cfg):
        critic = cfg.critic
        critic_updates = math.ceil(data.train_batch_size / critic.ppo_mini_batch_size) * critic.ppo_epochs
        out["values"] = _train_features(cfg, "critic", sequences, 1, trains=False)
        out["update_critic"] = _train_features(cfg, "critic", sequences, critic_updates, trains=True)
    out["update_actor"] = _train_features(cfg, "actor", sequences, updates, trains=True)
    out["sync_weights"] = _sync_features(cfg)
    out["step"] = {"fixed": 1.0}
    return out


def predict_step(cfg: DictConfig, constants: CostConstants) -> StepCost:
    """Predicted seconds per phase of one RL step of ``cfg`` (normalised: per-GPU micro-batches set)."""
    cost = StepCost()
    for phase, feats in phase_features(cfg).items():
        prices = constants.seconds.get(_group(phase), {})
        cost.features[phase] = feats
        cost.phases[phase] = sum(prices.get(name, 0.0) * value for name, value in feats.items())
    return cost
