"""Names the config accepts for algorithm choices, and where they come from.

Role: ``algorithm.adv_estimator``, ``algorithm.kl_penalty``, ``actor.kl_loss_type``,
``actor.loss_agg_mode`` and ``actor.policy_loss.loss_mode`` name entries of registries in
``rlhf_megatron.algorithms``. Validation asks ``registry_names`` for the live registry, so
an estimator registered there is accepted here without a config change. The ``KNOWN_*``
tuples are the fallback used when ``rlhf_megatron.algorithms`` cannot be imported (it
needs torch, and the config must stay usable without it); a test keeps them equal to the
registries. Closed sets that no registry extends (``algorithm.kl_ctrl.type``, ...) are Enums in
``rlhf_megatron.choices``.

Boundaries: ``config`` sits left of ``algorithms`` in the layer order, so the import is lazy
and optional; nothing here depends on it being present.
"""

from __future__ import annotations

__all__ = [
    "GROUP_ADV_ESTIMATORS",
    "KNOWN_ADV_ESTIMATORS",
    "KNOWN_KL_PENALTIES",
    "KNOWN_LOSS_AGG_MODES",
    "KNOWN_POLICY_LOSS_MODES",
    "registry_names",
]

KNOWN_ADV_ESTIMATORS: tuple[str, ...] = (
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "grpo_passk",
    "grpo_vectorized",
    "rloo_vectorized",
    "opo",
    "gpg",
)
KNOWN_KL_PENALTIES: tuple[str, ...] = (
    *("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"),
    *("kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"),
)
KNOWN_POLICY_LOSS_MODES: tuple[str, ...] = (
    "vanilla",
    "gspo",
    "kl_cov",
    "cispo",
    "sapo",
    "gpg",
    "dro",
    "geo_mean",
    "clip_cov",
    "dppo_tv",
    "dppo_kl",
)
KNOWN_LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# Estimators whose baseline comes from the other responses to the same prompt: with one
# response per prompt (rollout.n = 1) every advantage is zero and nothing is learned.
GROUP_ADV_ESTIMATORS: frozenset[str] = frozenset(
    {
        "grpo",
        "rloo",
        "grpo_passk",
        "reinforce_plus_plus_baseline",
        "grpo_vectorized",
        "rloo_vectorized",
        "opo",
        "gpg",
    }
)

# kind -> (attribute of rlhf_megatron.algorithms, fallback)
_REGISTRIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "adv_estimator": ("ADV_ESTIMATOR_REGISTRY", KNOWN_ADV_ESTIMATORS),
    "kl_penalty": ("KL_PENALTY_NAMES", KNOWN_KL_PENALTIES),
    "policy_loss": ("POLICY_LOSS_REGISTRY", KNOWN_POLICY_LOSS_MODES),
    "loss_agg_mode": ("LOSS_AGG_MODES", KNOWN_LOSS_AGG_MODES),
}


def registry_names(kind: str) -> tuple[str, ...]:
    """Accepted names for ``kind`` (adv_estimator, kl_penalty, policy_loss, loss_agg_mode):
    the algorithms registry when importable, else the ``KNOWN_*`` fallback."""
    attr, fallback = _REGISTRIES[kind]
    try:
        import rlhf_megatron.algorithms as algorithms
    except ImportError:
        return fallback
    names = getattr(algorithms, attr, None)
    if not names:
        return fallback
    return tuple(names)
