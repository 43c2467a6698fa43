"""The advantage-estimator registry and the one entry point the trainer calls.

Role: estimators are found by the name in the config (``algorithm.adv_estimator``, as in
verl). ``register_adv_estimator`` adds one, ``get_adv_estimator`` looks one up, and
``compute_advantage`` calls it with the inputs it declares.

Estimators have different signatures (GAE needs critic values, GRPO needs group ids,
ReMax needs the greedy baseline), so ``compute_advantage`` takes every input by keyword
and passes an estimator only the parameters its signature names. A missing required
input is reported by name ("gae needs values (critic)") before any math runs.

Boundaries: no math here; the estimators live in ``advantages.py`` and
``group_advantages.py`` and register themselves when the package is imported.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import torch

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "compute_advantage",
    "estimator_needs_critic",
    "get_adv_estimator",
    "register_adv_estimator",
]

AdvEstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATOR_REGISTRY: dict[str, AdvEstimatorFn] = {}

# What to tell a user who left an input out, per parameter name.
_INPUT_HINTS = {
    "values": "values (critic): pass values=<critic values, shape [B, T]>, or choose an estimator "
    "without a critic (grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax)",
    "index": "index (group ids): pass index=<one prompt id per response, shape [B]> so responses to "
    "the same prompt form a group",
    "reward_baselines": "reward_baselines (greedy-rollout reward): pass reward_baselines=<reward of "
    "the greedy response per sample, shape [B]>",
}


def register_adv_estimator(name: str) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator: register an advantage estimator under ``name``.

    The function must return ``(advantages, returns)``, both ``(B, T)``. Registering a
    different function under a taken name is an error, so two plugins cannot silently
    shadow each other.
    """

    def decorator(fn: AdvEstimatorFn) -> AdvEstimatorFn:
        existing = ADV_ESTIMATOR_REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"advantage estimator {name!r} is already registered to "
                f"{existing.__module__}.{existing.__qualname__}; register yours under another name"
            )
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvEstimatorFn:
    """Return the estimator registered as ``name``; ValueError listing known names otherwise."""
    try:
        return ADV_ESTIMATOR_REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(ADV_ESTIMATOR_REGISTRY))
        raise ValueError(f"unknown advantage estimator {name!r}; known estimators: {known}") from None


def estimator_needs_critic(name: str) -> bool:
    """True when the estimator consumes critic values (of the built-ins, only ``gae``).

    Decided from the signature, so a registered estimator that takes ``values`` is
    reported correctly too. The trainer uses this to decide whether to build a critic.
    """
    return "values" in inspect.signature(get_adv_estimator(name)).parameters


def compute_advantage(
    name: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    index: np.ndarray | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``name`` on whichever inputs it takes.

    Args:
        name: registry key, e.g. ``"gae"`` or ``"grpo"``.
        token_level_rewards: (B, T) per-token rewards (scores minus any KL penalty).
        response_mask: (B, T) 1 on response tokens.
        values: (B, T) critic values; required by ``gae``.
        index: (B,) group id per sample; required by the group estimators.
        reward_baselines: (B,) greedy-rollout reward; required by ``remax``.
        gamma, lam: discount and GAE lambda, for estimators that take them.
        norm_adv_by_std_in_grpo, epsilon: GRPO-family options.

    Returns:
        advantages: (B, T)
        returns: (B, T)
    """
    fn = get_adv_estimator(name)
    available = {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask,
        "values": values,
        "index": index,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
        "epsilon": epsilon,
    }
    params = inspect.signature(fn).parameters
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {}
    for pname, param in params.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        required = param.default is inspect.Parameter.empty
        if pname not in available:
            if required:
                raise ValueError(
                    f"advantage estimator {name!r} requires argument {pname!r}, which compute_advantage "
                    f"does not supply; call get_adv_estimator({name!r}) and pass it directly"
                )
            continue
        if available[pname] is None:
            if required:
                hint = _INPUT_HINTS.get(pname, pname)
                raise ValueError(f"{name} needs {hint}")
            continue
        kwargs[pname] = available[pname]
    if takes_var_kw:
        # An estimator with **kwargs gets every input we have that is not None.
        kwargs.update({k: v for k, v in available.items() if v is not None and k not in kwargs})
    return fn(**kwargs)
