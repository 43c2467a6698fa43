"""What every cross-section validation rule sees: ``ValidationContext``.

Role: the typed config, the world size, the roles the run builds and each active role's
architecture, built once by ``planning.validate_config`` (which reads the architectures) and
handed to every rule (``validate.py``, ``validate_batch.py``, ``planning/validate_layout.py``,
``planning/validate_lora.py``).

Boundaries: config only; an architecture is whatever ``planning`` put in ``archs`` (the rules of
``config/`` do not read it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.config.roles import ROLE_SECTIONS, at, data_parallel_size
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
    archs: dict[str, tuple[Any, str]] = field(default_factory=dict)
    """Role -> (its ``planning.model_arch.ModelArch``, or None when unknown; where it came from)."""
    arch_errors: list[str] = field(default_factory=list)
    """Model descriptions that name something this project cannot build (reported as errors)."""

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
