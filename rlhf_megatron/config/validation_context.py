"""What every cross-section validation rule sees: ``ValidationContext``.

Role: the typed config, the world size, the roles the run builds and each active role's
architecture, built once by ``validate_config`` (``validate.py``) and handed to every rule there
and in ``validate_batch.py``, ``validate_layout.py`` and ``validate_lora.py``.

Boundaries: config only; the rules live in the ``validate*`` modules, which all import this one
(and it imports none of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config.arch import arch_for_role
from rlhf_megatron.config.model_arch import ModelArch, UnsupportedModelError
from rlhf_megatron.config.roles import ROLE_SECTIONS, active_roles, at, data_parallel_size, world_size
from rlhf_megatron.config.schema import RunConfig
from rlhf_megatron.config.schema_model import MegatronConfig

__all__ = ["ValidationContext"]


@dataclass
class ValidationContext:
    """What every cross-section rule sees: the typed config, the world size, the roles the run
    builds, and each active role's architecture."""

    run: RunConfig
    world: int
    roles: list[str]
    archs: dict[str, tuple[ModelArch | None, str]] = field(default_factory=dict)
    arch_errors: list[str] = field(default_factory=list)
    """Model descriptions that name something this project cannot build (reported as errors)."""

    @classmethod
    def build(cls, cfg: DictConfig | RunConfig, world_size_override: int | None = None) -> ValidationContext:
        """The context of a resolved config (the loader's DictConfig, or already typed)."""
        run = cfg if isinstance(cfg, RunConfig) else OmegaConf.to_object(cfg)
        roles = active_roles(run)
        archs, errors = {}, []
        for role in roles:
            try:
                archs[role] = arch_for_role(run, role)
            except UnsupportedModelError as e:
                archs[role] = (None, f"{role}: unsupported model")
                errors.append(str(e))  # names its source (model_arch or a config.json)
        return cls(run, world_size(run, world_size_override), roles, archs, list(dict.fromkeys(errors)))

    def dp(self, role: str) -> int | None:
        """The role's data-parallel size, or None when its TP x PP x CP does not divide the world."""
        return data_parallel_size(self.run, role, self.world)

    def megatron(self, role: str) -> MegatronConfig:
        """The role's ``megatron`` section."""
        return at(self.run, ROLE_SECTIONS[role]).megatron

    def trained_roles(self) -> list[tuple[str, str, Any]]:
        """``(role, dotted key, section)`` of each role the run trains: the actor, and the critic
        when the advantage estimator needs one."""
        out = [("actor", ROLE_SECTIONS["actor"], self.run.actor_rollout_ref.actor)]
        if "critic" in self.roles:
            out.append(("critic", ROLE_SECTIONS["critic"], self.run.critic))
        return out
