"""Cross-section rules on batch sizes: the rollout batch, mini-batches and micro-batches against
the data-parallel size of the role that runs them, and token budgets against the sequence length.

Role: rules of ``validate.RULES`` that relate ``data``, ``actor_rollout_ref.*``, ``critic`` and
the world size. Each reads the typed config (``ctx.run``) and returns one message per problem,
naming the dotted keys to change. They run only when every count is at least 1 (the sections'
own rules report the others).

Boundaries: reads the config, never changes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf_megatron.config.roles import (
    ACTOR_TRAIN_MICRO,
    CRITIC_TRAIN_MICRO,
    MICRO_BATCH_SPECS,
    at,
    per_gpu_micro_batch,
)

if TYPE_CHECKING:
    from rlhf_megatron.config.validation_context import ValidationContext

__all__ = [
    "check_batch_divisible_by_dp",
    "check_dynamic_bsz_token_budget",
    "check_micro_batch_sizes",
    "check_mini_batch_divides_train_batch",
    "check_mini_batch_divisible_by_micro",
]

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"


def check_mini_batch_divides_train_batch(ctx: ValidationContext) -> list[str]:
    """``train_batch_size x n`` splits into whole mini-batches of ``ppo_mini_batch_size x n``."""
    train, n = ctx.run.data.train_batch_size, ctx.run.actor_rollout_ref.rollout.n
    out = []
    for _, key, section in ctx.trained_roles():
        mini = section.ppo_mini_batch_size
        if mini > train or (train * n) % (mini * n):
            out.append(
                f"data.train_batch_size x rollout.n = {train} x {n} is not a multiple of "
                f"{key}.ppo_mini_batch_size x rollout.n = {mini} x {n}; pick a mini-batch size dividing {train}"
            )
    return out


def check_batch_divisible_by_dp(ctx: ValidationContext) -> list[str]:
    """The rollout batch and every mini-batch (in responses) split evenly over DP ranks."""
    train, n = ctx.run.data.train_batch_size, ctx.run.actor_rollout_ref.rollout.n
    out = []
    for role, key, section in ctx.trained_roles():
        dp = ctx.dp(role)
        if dp is None:
            continue
        mini = section.ppo_mini_batch_size
        for what, size in (("data.train_batch_size", train), (f"{key}.ppo_mini_batch_size", mini)):
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
        per_gpu, problem = per_gpu_micro_batch(ctx.run, spec, dp)
        if problem:
            out.append(problem)
        elif per_gpu is None and not at(ctx.run, spec.dynamic_key):
            missing.add(spec)
            # critic.forward_* defaults to critic.ppo_*: one message covers both.
            if spec.role == "critic" and CRITIC_TRAIN_MICRO in missing and spec is not CRITIC_TRAIN_MICRO:
                continue
            out.append(f"set {spec.per_gpu_key} (or {spec.global_key}), or turn on {spec.dynamic_key}")
    return out


def check_mini_batch_divisible_by_micro(ctx: ValidationContext) -> list[str]:
    """A DP rank's share of a mini-batch is a whole number of micro-batches."""
    n = ctx.run.actor_rollout_ref.rollout.n
    specs = {"actor": ACTOR_TRAIN_MICRO, "critic": CRITIC_TRAIN_MICRO}
    out = []
    for role, key, section in ctx.trained_roles():
        spec, dp = specs[role], ctx.dp(role)
        if dp is None or section.use_dynamic_bsz:
            continue
        mini = section.ppo_mini_batch_size
        micro, problem = per_gpu_micro_batch(ctx.run, spec, dp)
        if problem or micro is None or (mini * n) % dp:
            continue  # reported by the rules above
        share = mini * n // dp
        if share % micro:
            out.append(
                f"{key}.ppo_mini_batch_size x rollout.n / DP = {mini} x {n} / {dp} = {share} responses per rank "
                f"is not a multiple of the micro-batch {spec.per_gpu_key}={micro}; choose a micro-batch dividing {share}"
            )
    return out


def check_dynamic_bsz_token_budget(ctx: ValidationContext) -> list[str]:
    """With dynamic batching, one micro-batch's token budget holds at least one full sequence."""
    data, arr, critic = ctx.run.data, ctx.run.actor_rollout_ref, ctx.run.critic
    seq = data.max_prompt_length + data.max_response_length
    # (budget key, dynamic batching on, budget)
    budgets = [
        (
            f"{ACTOR}.ppo_max_token_len_per_gpu",
            arr.actor.use_dynamic_bsz,
            arr.actor.ppo_max_token_len_per_gpu,
        ),
        (
            f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
            arr.rollout.log_prob_use_dynamic_bsz,
            arr.rollout.log_prob_max_token_len_per_gpu,
        ),
    ]
    if "ref" in ctx.roles:
        budgets.append(
            (
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                arr.ref.log_prob_use_dynamic_bsz,
                arr.ref.log_prob_max_token_len_per_gpu,
            )
        )
    if "critic" in ctx.roles:
        budgets += [
            ("critic.ppo_max_token_len_per_gpu", critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu),
            (
                "critic.forward_max_token_len_per_gpu",
                critic.use_dynamic_bsz,
                critic.forward_max_token_len_per_gpu,
            ),
        ]
    return [
        f"{key}={budget} is shorter than one sequence (max_prompt_length + max_response_length = "
        f"{seq}); raise it to at least {seq}"
        for key, dynamic, budget in budgets
        if dynamic and budget < seq
    ]
