"""Building blocks of the sections' ``validate`` methods: counts, registry names, the strategy.

Role: each schema section checks its own values in a ``validate(key, ...)`` method that returns
one message per problem, each naming the full dotted key (``key`` is where the section sits, so
``MegatronConfig`` reports ``critic.megatron.*`` or ``actor_rollout_ref.actor.megatron.*``).
The checks several sections share live here so their messages read the same everywhere.

Boundaries: pure functions of values; ``validate.py`` runs the sections and the cross-section
rules.
"""

from __future__ import annotations

from collections.abc import Mapping

from rlhf_megatron.config.names import registry_names

__all__ = ["SizeProblem", "count_problems", "name_problem", "strategy_problem"]


class SizeProblem(str):
    """A message about a count below 1 (a batch, a parallel size, a node count). When any section
    reports one, ``planning.validate_config`` skips the cross-section size rules, whose arithmetic divides
    by those counts, so one mistake is not reported again in three other forms."""


def count_problems(
    key: str, required: Mapping[str, int], optional: Mapping[str, int | None] | None = None
) -> list[str]:
    """``<key>.<name>`` of each ``required`` count must be >= 1, and of each ``optional`` one
    too unless it is null."""
    out = [SizeProblem(f"{key}.{name}={v} must be >= 1") for name, v in required.items() if v < 1]
    out += [
        SizeProblem(f"{key}.{name}={v} must be >= 1 (or null)")
        for name, v in (optional or {}).items()
        if v is not None and v < 1
    ]
    return out


def name_problem(key: str, value: str, kind: str, what: str, sort: bool = False) -> list[str]:
    """``value`` of ``key`` names an entry of the ``kind`` registry (``names.registry_names``);
    ``what`` says what such a name is (e.g. "a KL estimator")."""
    known = registry_names(kind)
    if value in known:
        return []
    shown = sorted(known) if sort else known
    return [f"{key}={value!r} is not {what}; known: {', '.join(shown)}"]


def strategy_problem(key: str, strategy: str) -> list[str]:
    """A role's ``strategy`` must be megatron (verl's fsdp backend does not exist here)."""
    if strategy == "megatron":
        return []
    return [f"{key}.strategy={strategy!r}: this project trains with Megatron only; set it to megatron"]
