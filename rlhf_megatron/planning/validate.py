"""Every rule a config must satisfy before any process starts, run in one pass: ``validate_config``.

Role: reads the config once as the typed ``RunConfig`` (``OmegaConf.to_object``) with each active
role's architecture (``arch.arch_for_role``: the ``model_arch`` section or ``<model.path>/
config.json``; unknown ones skip their rules with an ``ArchUnknownWarning``), then runs each
section's own rules and every rule that relates sections, in this order: the run-mode rules and
batch sizes (``config/validate.py``, ``config/validate_batch.py``), the parallel layouts against
the architecture and the cluster (``validate_layout.py``) and LoRA (``validate_lora.py``). Raises
one ``ConfigError`` listing every violation, each naming the dotted keys and what to change.

Boundaries: reads the config, never changes it (``config/normalize.py`` does that afterwards).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config.errors import ConfigError
from rlhf_megatron.config.roles import active_roles, world_size
from rlhf_megatron.config.schema import RunConfig
from rlhf_megatron.config.validate import (
    Rule,
    check_dapo,
    check_group_estimator_n,
    check_multi_turn,
    check_openai_proxy,
    check_rollout_correction_engine,
    check_rollout_placement,
    run_rules,
)
from rlhf_megatron.config.validate_batch import (
    check_batch_divisible_by_dp,
    check_dynamic_bsz_token_budget,
    check_micro_batch_sizes,
    check_mini_batch_divides_train_batch,
    check_mini_batch_divisible_by_micro,
)
from rlhf_megatron.config.validation_context import ValidationContext
from rlhf_megatron.planning.arch import arch_for_role
from rlhf_megatron.planning.model_arch import UnsupportedModelError
from rlhf_megatron.planning.validate_layout import (
    check_context_parallel_backend,
    check_expert_bias_update,
    check_expert_parallel,
    check_layers_divisible_by_pp,
    check_model_arch_matches_checkpoint,
    check_moe_training_layout,
    check_rollout_tp,
    check_router_replay,
    check_sequence_fits_positions,
    check_tp_divides_heads,
    check_vision_language_options,
    check_vision_tp_divides_heads,
    check_world_divisible,
)
from rlhf_megatron.planning.validate_lora import check_lora

__all__ = ["RULES", "SIZE_RULES", "build_context", "validate_config"]

# Cross-section rules that hold whatever the sizes are.
ALWAYS_RULES: tuple[Rule, ...] = (
    check_dapo,
    check_rollout_correction_engine,
    check_rollout_placement,
    check_multi_turn,
    check_openai_proxy,
    check_group_estimator_n,
    check_model_arch_matches_checkpoint,
    check_expert_bias_update,
)
# Rules whose arithmetic divides by or compares sizes; they run only when every count is valid
# (no section reported a ``SizeProblem``), so one mistake is not reported three times.
SIZE_RULES: tuple[Rule, ...] = (
    check_tp_divides_heads,
    check_layers_divisible_by_pp,
    check_world_divisible,
    check_context_parallel_backend,
    check_mini_batch_divides_train_batch,
    check_batch_divisible_by_dp,
    check_micro_batch_sizes,
    check_mini_batch_divisible_by_micro,
    check_dynamic_bsz_token_budget,
    check_rollout_tp,
    check_sequence_fits_positions,
    check_vision_tp_divides_heads,
    check_vision_language_options,
    check_expert_parallel,
    check_moe_training_layout,
    check_router_replay,
    check_lora,
)
RULES: tuple[Rule, ...] = ALWAYS_RULES + SIZE_RULES


def build_context(cfg: DictConfig | RunConfig, world_size_override: int | None = None) -> ValidationContext:
    """The context of a resolved config (the loader's DictConfig, or already typed), with each
    active role's architecture read."""
    run = cfg if isinstance(cfg, RunConfig) else OmegaConf.to_object(cfg)
    roles = active_roles(run)
    archs, errors = {}, []
    for role in roles:
        try:
            archs[role] = arch_for_role(run, role)
        except UnsupportedModelError as e:
            archs[role] = (None, f"{role}: unsupported model")
            errors.append(str(e))  # names its source (model_arch or a config.json)
    return ValidationContext(
        run, world_size(run, world_size_override), roles, archs, list(dict.fromkeys(errors))
    )


def validate_config(cfg: DictConfig | RunConfig, world_size: int | None = None) -> None:
    """Run every section's rules and every rule in ``RULES``; raise ``ConfigError`` listing all
    violations.

    ``world_size`` overrides ``trainer.nnodes x trainer.n_gpus_per_node`` (a launcher that
    knows the real number of processes passes it).
    """
    errors = run_rules(build_context(cfg, world_size), ALWAYS_RULES, SIZE_RULES)
    if errors:
        raise ConfigError(errors)
