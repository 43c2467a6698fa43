"""The rules across a config's sections that the config alone can decide, and the pass that
runs a rule set.

Role: ``run_rules(ctx, always, sizes)`` runs each section's own rules (``RunConfig.validate``:
the ``validate`` methods beside the fields in ``schema*.py``) and then the rules that relate
sections, and returns one message per violation; each names the dotted keys and their values
and says what to change. The run-mode rules are below, batch sizes in ``validate_batch.py``;
the rules against the model architecture (heads, layers, position limit, experts, LoRA) are in
``planning/``, whose ``validate_config`` assembles the whole set in order and raises one
``ConfigError``. Closed-choice values were already checked as the config was loaded (their
fields are Enums).

Boundaries: reads the config, never changes it (``normalize.py`` does that afterwards); knows
nothing of architectures beyond what the ``ValidationContext`` it is handed holds.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

from rlhf_megatron.choices import RolloutName
from rlhf_megatron.config.checks import SizeProblem
from rlhf_megatron.config.names import GROUP_ADV_ESTIMATORS
from rlhf_megatron.config.validation_context import ValidationContext

__all__ = [
    "ENGINES_WITH_LOG_PROBS",
    "ArchUnknownWarning",
    "Rule",
    "ValidationContext",
    "check_dapo",
    "check_group_estimator_n",
    "check_multi_turn",
    "check_openai_proxy",
    "check_rollout_correction_engine",
    "check_rollout_placement",
    "run_rules",
]

ROLLOUT = "actor_rollout_ref.rollout"
# Engines whose batches carry ``rollout_log_probs`` (rollout/base.py ``assemble_rollout``).
ENGINES_WITH_LOG_PROBS: tuple[str, ...] = (RolloutName.vllm, RolloutName.hf)


class ArchUnknownWarning(UserWarning):
    """The model architecture is unknown, so architecture-dependent rules were skipped."""


Rule = Callable[[ValidationContext], list[str]]


def check_rollout_correction_engine(ctx: ValidationContext) -> list[str]:
    """Rollout correction (its weights, or bypass mode's old policy) needs the rollout engine's
    log-probs, and bypass mode skips the pass that routing replay R2 records routes in."""
    key = "algorithm.rollout_correction"
    corr, engine = ctx.run.algorithm.rollout_correction, ctx.run.actor_rollout_ref.rollout.name
    out = []
    if corr.bypass_mode:
        if engine not in ENGINES_WITH_LOG_PROBS:
            out.append(
                f"{key}.bypass_mode=true needs the rollout engine's log-probs, which {ROLLOUT}.name={engine!r} "
                f"does not return; use one of: {', '.join(ENGINES_WITH_LOG_PROBS)}"
            )
        if ctx.run.actor_rollout_ref.actor.router_replay.mode == "R2":
            out.append(
                f"{key}.bypass_mode=true skips the old-log-prob pass, where router_replay.mode=R2 records "
                "the routes its updates replay; use mode=R3 (GPU) or bypass_mode=false"
            )
    if corr.rollout_rs is not None and engine not in ENGINES_WITH_LOG_PROBS:
        out.append(
            f"{key}.rollout_rs={corr.rollout_rs} measures the rollout engine's log-probs, which "
            f"{ROLLOUT}.name={engine!r} does not return; use one of: {', '.join(ENGINES_WITH_LOG_PROBS)}, "
            f"or set {key}.rollout_rs=null"
        )
    if corr.rollout_is is not None and engine not in ENGINES_WITH_LOG_PROBS:
        out.append(
            f"{key}.rollout_is={corr.rollout_is} weights tokens by the rollout engine's log-probs, which "
            f"{ROLLOUT}.name={engine!r} does not return; use one of: {', '.join(ENGINES_WITH_LOG_PROBS)}, "
            f"or set {key}.rollout_is=null"
        )
    return out


def check_rollout_placement(ctx: ValidationContext) -> list[str]:
    """An overlapping ``trainer.rollout_mode`` needs the rollout on its own pool, and partial
    rollout a vLLM engine and routes it can keep."""
    trainer, arr = ctx.run.trainer, ctx.run.actor_rollout_ref
    mode = trainer.rollout_mode
    out = []
    if mode in ("one_step_off", "async") and arr.hybrid_engine:
        out.append(
            f"trainer.rollout_mode={mode} overlaps generation with training, which one set of processes "
            "cannot do: set actor_rollout_ref.hybrid_engine=false and give the rollout its own pool "
            f"({ROLLOUT}.nnodes, {ROLLOUT}.n_gpus_per_node), or use trainer.rollout_mode=sync"
        )
    if not trainer.partial_rollout:
        return out
    if arr.rollout.name != "vllm":
        out.append(
            f"trainer.partial_rollout=true needs {ROLLOUT}.name=vllm (the engine is stepped and "
            f"interrupted between steps); {ROLLOUT}.name={arr.rollout.name} cannot be"
        )
    if arr.actor.router_replay.mode == "R3":
        out.append(
            "trainer.partial_rollout=true drops the routes vLLM chose for tokens sampled before an "
            "interruption, which actor_rollout_ref.actor.router_replay.mode=R3 replays; use R2 or turn "
            "partial rollout off"
        )
    return out


def check_multi_turn(ctx: ValidationContext) -> list[str]:
    """Multi-turn rollouts run on vLLM, from the prompts' chat messages, whole (no partial rollout,
    no replayed routes: both follow one response per sample)."""
    run = ctx.run
    arr = run.actor_rollout_ref
    if not arr.rollout.multi_turn.enable:
        return []
    key, out = f"{ROLLOUT}.multi_turn.enable=true", []
    if arr.rollout.name != "vllm":
        out.append(
            f"{key} needs {ROLLOUT}.name=vllm (it generates turn by turn); {ROLLOUT}.name={arr.rollout.name}"
        )
    if not run.data.return_raw_chat:
        out.append(
            f"{key} needs data.return_raw_chat=true: each prompt's chat messages are rendered again with the "
            "tools' schemas (verl's multi-turn scripts set it too)"
        )
    if run.trainer.partial_rollout:
        out.append(f"{key} cannot be combined with trainer.partial_rollout=true; turn one of them off")
    if arr.actor.router_replay.mode == "R3":
        out.append(
            f"{key} cannot replay vLLM's routes (actor_rollout_ref.actor.router_replay.mode=R3): tool turns "
            "have none; use R2"
        )
    return out + _tool_config_problems(arr.rollout.multi_turn)


def check_openai_proxy(ctx: ValidationContext) -> list[str]:
    """Agent programs through the endpoint run on vLLM from each row's chat messages, whole, with
    the agents' own rewards; whatever needs one response per sample (partial rollout, replayed
    routes, DAPO's group filter, ReMax's greedy baseline) or another reward is refused."""
    run = ctx.run
    arr = run.actor_rollout_ref
    proxy = arr.rollout.agent.openai_proxy
    if not proxy.enabled:
        return []
    key, out = f"{ROLLOUT}.agent.openai_proxy", []
    if arr.rollout.name != "vllm":
        out.append(
            f"{key} needs {ROLLOUT}.name=vllm (calls are generated token-in); {ROLLOUT}.name={arr.rollout.name}"
        )
    if not run.data.return_raw_chat:
        out.append(
            f"{key} needs data.return_raw_chat=true: each agent gets its row's chat messages as `prompt`"
        )
    for on, why in (
        (run.trainer.partial_rollout, "trainer.partial_rollout=true"),
        (arr.actor.router_replay.mode == "R3", "actor_rollout_ref.actor.router_replay.mode=R3"),
        (run.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=true"),
        (run.algorithm.adv_estimator == "remax", "algorithm.adv_estimator=remax"),
    ):
        if on:
            out.append(
                f"{key} cannot be combined with {why} (each needs one response per sample); turn it off"
            )
    return out


def _tool_config_problems(multi_turn) -> list[str]:
    """Build the tools and interactions once here, on the driver: a missing class, a schema that is
    not an OpenAI function schema or a duplicate name is refused before any worker starts (the
    ``ToolConfigError`` names the file and the entry)."""
    from rlhf_megatron.agent.config import ToolConfigError, load_interactions, load_tools
    from rlhf_megatron.agent.tools.code_interpreter import CodeInterpreterTool, describe_layers

    out = []
    for name, load in (("tool_config_path", load_tools), ("interaction_config_path", load_interactions)):
        path = getattr(multi_turn, name)
        if path is None or not os.path.isfile(os.path.expanduser(path)):
            continue  # MultiTurnConfig.validate reports a missing file
        try:
            loaded = load(os.path.expanduser(path))
        except ToolConfigError as exc:
            out.append(f"{ROLLOUT}.multi_turn.{name}: {exc}")
            continue
        for tool in loaded if name == "tool_config_path" else ():
            if isinstance(tool, CodeInterpreterTool):  # the run says once, at start, what holds
                print(f"{tool.name}: {describe_layers(tool.layers)}", file=sys.stderr, flush=True)
    return out


def check_group_estimator_n(ctx: ValidationContext) -> list[str]:
    """Group-baseline estimators need at least two responses per prompt."""
    estimator, n = ctx.run.algorithm.adv_estimator, ctx.run.actor_rollout_ref.rollout.n
    if estimator in GROUP_ADV_ESTIMATORS and n < 2:
        return [
            f"algorithm.adv_estimator={estimator} compares responses to the same prompt, but "
            f"{ROLLOUT}.n={n}; set {ROLLOUT}.n to 2 or more (e.g. 5)"
        ]
    return []


def check_dapo(ctx: ValidationContext) -> list[str]:
    """Dynamic sampling needs groups (``rollout.n`` >= 2); the overlong buffer needs verl's dapo
    reward manager and fits inside ``data.max_response_length``."""
    run, out = ctx.run, []
    n = run.actor_rollout_ref.rollout.n
    if run.algorithm.filter_groups.enable and n < 2:
        out.append(
            f"algorithm.filter_groups.enable=true drops prompts whose responses all score alike, but "
            f"{ROLLOUT}.n={n} gives every prompt one response (every group would be dropped); set {ROLLOUT}.n >= 2"
        )
    gen = run.data.gen_batch_size
    if gen is not None and gen != run.data.train_batch_size and not run.algorithm.filter_groups.enable:
        out.append(
            f"data.gen_batch_size={gen} sets the prompts of each dynamic-sampling round, but "
            "algorithm.filter_groups.enable=false: nothing would use it; remove it (or set it to "
            "data.train_batch_size) or enable algorithm.filter_groups"
        )
    rm = run.reward_model
    buffer = rm.overlong_buffer
    if buffer.enable and rm.reward_manager != "dapo":
        out.append(
            f"reward_model.overlong_buffer.enable=true is applied by the dapo reward manager, but "
            f"reward_model.reward_manager={rm.reward_manager}; set reward_model.reward_manager=dapo (as verl's "
            "DAPO recipe does)"
        )
    if buffer.enable and buffer.len > run.data.max_response_length:
        out.append(
            f"reward_model.overlong_buffer.len={buffer.len} is longer than data.max_response_length="
            f"{run.data.max_response_length}: the buffer is the last len tokens of the response limit; lower it"
        )
    return out


def run_rules(ctx: ValidationContext, always: tuple[Rule, ...], sizes: tuple[Rule, ...]) -> list[str]:
    """Every section's own rules, then ``always``, then ``sizes`` (rules whose arithmetic divides
    by or compares sizes: they run only when no section reported a ``SizeProblem``, so one mistake
    is not reported three times); one message per violation, duplicates once, in that order."""
    unknown = sorted({source for arch, source in ctx.archs.values() if arch is None})
    if unknown and not ctx.arch_errors:
        warnings.warn(
            "model architecture unknown ("
            + "; ".join(unknown)
            + "): head, layer and position checks skipped. "
            "Add a model_arch section or point model.path at a directory with config.json.",
            ArchUnknownWarning,
            stacklevel=3,
        )
    sections = ctx.run.validate(ctx.roles)
    errors: list[str] = [*ctx.arch_errors, *sections]
    sizes_ok = not any(isinstance(message, SizeProblem) for message in sections)
    for rule in always + (sizes if sizes_ok else ()):
        errors += rule(ctx)
    return [str(e) for e in dict.fromkeys(errors)]
