"""Configuration of a training run: typed schema, presets, overrides, validation.

Role: the one place a run's settings are defined. ``build_config(file, overrides)`` layers the
schema defaults (``schema.py``, ``schema_roles.py``, ``schema_model.py``; closed choices are
Enums from ``rlhf_megatron.choices``), a YAML preset from ``configs/`` (``presets.py``) and
verl-style dotted overrides (``loader.py``); each section checks its own rules (its ``validate``
method), ``validate*.py`` hold the rules across sections that the config alone decides, and
``normalize.py`` fills in derived values. ``rlhf_megatron.planning.load_config`` is the whole way
in: it adds the ``auto`` layout search, the model architecture and the rules against it.

Boundaries: imports only the standard library, omegaconf, yaml and ``rlhf_megatron.choices``
(plus, lazily, the algorithm registries for valid names). Nothing here starts processes or touches devices.
"""

from rlhf_megatron.config.errors import ConfigError
from rlhf_megatron.config.keys import field_docs, schema_keys
from rlhf_megatron.config.loader import (
    IgnoredKeysWarning,
    build_config,
    parse_overrides,
    save_resolved_config,
)
from rlhf_megatron.config.normalize import normalize_config
from rlhf_megatron.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    CheckpointConfig,
    CriticConfig,
    CriticModelConfig,
    CustomClassConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    KLControlConfig,
    MegatronConfig,
    ModelConfig,
    OptimConfig,
    PolicyLossConfig,
    RayInitConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelModelConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    RunConfig,
    TrainerConfig,
    ValSamplingConfig,
)
from rlhf_megatron.config.validate import ArchUnknownWarning

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "ArchUnknownWarning",
    "CheckpointConfig",
    "ConfigError",
    "CriticConfig",
    "CriticModelConfig",
    "CustomClassConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "IgnoredKeysWarning",
    "KLControlConfig",
    "MegatronConfig",
    "ModelConfig",
    "OptimConfig",
    "PolicyLossConfig",
    "RayInitConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RewardModelModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "ValSamplingConfig",
    "TrainerConfig",
    "field_docs",
    "build_config",
    "normalize_config",
    "parse_overrides",
    "save_resolved_config",
    "schema_keys",
]
