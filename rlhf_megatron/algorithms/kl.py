"""KL between the policy and the reference: per-token estimators, coefficient controllers,
and the in-reward penalty.

Role: PPO keeps the policy near the reference model either by subtracting ``beta * KL``
from the reward (``apply_kl_penalty``, with ``beta`` from a fixed or adaptive controller)
or by adding a KL loss term; both use ``kl_penalty`` for the per-token estimate. The
estimators are Schulman's k1/k2/k3 (http://joschu.net/blog/kl-approx.html) plus the exact
KL from full-vocabulary log-probs.

Boundaries: pure tensor math. The controllers are tiny stateful objects owned by the
driver; their state is a plain dict so the checkpoint manager can save it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlhf_megatron.algorithms.utils import (
    check_floating,
    check_mask,
    check_ndim,
    check_same_dtype,
    check_same_shape,
    masked_mean,
)

__all__ = [
    "KL_PENALTY_NAMES",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "get_kl_controller",
    "kl_penalty",
]

_BASE_KL_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
# ``<name>+``: the estimator's value with k2's gradient (straight through); not for ``full``.
KL_PENALTY_NAMES: tuple[str, ...] = (*_BASE_KL_NAMES, *(f"{n}+" for n in _BASE_KL_NAMES if n != "full"))


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference).

    ``kl``/``k1``: ``lp - ref`` (unbiased, high variance, can be negative).
    ``abs``: ``|lp - ref|``.
    ``mse``/``k2``: ``0.5 * (lp - ref)^2``.
    ``low_var_kl``/``k3``: ``exp(ref - lp) - (ref - lp) - 1``, clamped to [-10, 10]
    (non-negative, low variance).
    ``full``: exact ``sum_v p_v (lp_v - ref_v)`` from full-vocabulary log-probs.
    ``<name>+`` (e.g. ``low_var_kl+``): the value of ``<name>`` with the gradient of k2,
    ``value + k2 - sg(k2)`` (k1 and k3 are unbiased for the KL's value but not for its gradient;
    k2's gradient ``lp - ref`` is). ``k2+``/``mse+`` are k2 itself.

    Args:
        logprob: (B, T) log-prob of the sampled token under the policy; for ``full``,
            (B, T, V) log-probs over the whole vocabulary.
        ref_logprob: same shape and dtype, under the reference model.
        kl_penalty: one of ``KL_PENALTY_NAMES``.

    Returns:
        (B, T) per-token KL estimate (keeps the graph: usable as a loss term).
    """
    where = "kl_penalty"
    if kl_penalty not in KL_PENALTY_NAMES:
        raise ValueError(
            f"{where}: unknown kl_penalty {kl_penalty!r}; choose one of {', '.join(KL_PENALTY_NAMES)}"
        )
    check_floating(where, "logprob", logprob)
    check_floating(where, "ref_logprob", ref_logprob)
    check_same_shape(where, "logprob", logprob, "ref_logprob", ref_logprob)
    check_same_dtype(where, "logprob", logprob, "ref_logprob", ref_logprob)
    if kl_penalty.endswith("+"):
        value = _kl_estimate(logprob, ref_logprob, kl_penalty[:-1])  # (B, T)
        k2 = 0.5 * (logprob - ref_logprob).square()
        return value.detach() + (k2 - k2.detach())
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


def _kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """``kl_penalty`` for a name without ``+`` (inputs already checked): value and gradient of
    the estimator itself. Shapes as ``kl_penalty``."""
    if kl_penalty == "full":
        check_ndim("kl_penalty", "logprob", logprob, 3, "(B, T, V) for kl_penalty='full'")
        # KL(p || ref) = sum_v p_v * (log p_v - log ref_v); exp of a log-softmax is p.
        return (logprob.exp() * (logprob - ref_logprob)).sum(-1)
    diff = logprob - ref_logprob
    if kl_penalty in ("kl", "k1"):
        return diff
    if kl_penalty == "abs":
        return diff.abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * diff.square()
    # k3. Clamping the exponent first keeps exp() finite and its gradient non-NaN; it does
    # not change any output, since |exponent| > 20 lands beyond the [-10, 10] clamp anyway.
    log_ratio = torch.clamp(-diff, min=-20.0, max=20.0)
    return torch.clamp(log_ratio.exp() - log_ratio - 1.0, min=-10.0, max=10.0)


# ``apply_kl_penalty`` has a parameter named like this function (verl's public signature).
kl_penalty_fn = kl_penalty


class FixedKLController:
    """A constant KL coefficient (``algorithm.kl_ctrl.type=fixed``)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so both controllers are interchangeable."""
        del current_kl, n_steps

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from ``state_dict()`` output."""
        _check_state_type(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    After each batch: ``error = clip(current_kl / target_kl - 1, -0.2, 0.2)`` and
    ``value *= 1 + error * n_steps / horizon``. The coefficient rises while the measured
    KL is above target and falls while below, by at most 20% per ``horizon`` samples.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController: target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards keeping ``current_kl`` at target; ``n_steps`` = samples seen."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the coefficient from ``state_dict()`` output.

        ``target`` and ``horizon`` stay as constructed: they are settings, and the config
        of the resumed run is their one source of truth.
        """
        _check_state_type(state, "adaptive")
        self.value = float(state["value"])


def _check_state_type(state: Mapping[str, Any], expected: str) -> None:
    got = state.get("type", expected)
    if got != expected:
        raise ValueError(
            f"cannot load a {got!r} KL controller state into a {expected!r} controller; "
            f"the checkpoint was written with algorithm.kl_ctrl.type={got}"
        )


def get_kl_controller(
    type: str = "fixed",
    kl_coef: float | None = None,
    target_kl: float | None = None,
    horizon: int | None = None,
) -> FixedKLController | AdaptiveKLController:
    """The controller described by ``algorithm.kl_ctrl``: ``fixed`` keeps ``kl_coef``; ``adaptive``
    (Ziegler et al., 2019) starts at ``kl_coef`` and steers the KL towards ``target_kl`` over
    ``horizon`` samples."""
    if kl_coef is None:
        raise ValueError("algorithm.kl_ctrl.kl_coef is required (the initial KL coefficient, e.g. 0.001)")
    if type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None or horizon <= 0 or target_kl <= 0:
            raise ValueError(
                f"algorithm.kl_ctrl.type=adaptive needs target_kl > 0 and horizon > 0, got "
                f"target_kl={target_kl}, horizon={horizon}"
            )
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"algorithm.kl_ctrl.type must be 'fixed' or 'adaptive', got {type!r}")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract the KL penalty from the reward: ``rewards = scores - beta * kl * mask``.

    ``beta`` is the controller's value *before* this batch; the controller is then updated
    with this batch's KL and size, as verl does. That update is the only side effect.
    Reading the KL back to a float is a device sync (once per step, on the driver).

    Args:
        token_level_scores: (B, T) reward-model / rule scores.
        old_log_probs: (B, T) policy log-probs of the sampled tokens ((B, T, V) for 'full').
        ref_log_probs: same shape, reference log-probs.
        response_mask: (B, T).
        kl_ctrl: a fixed or adaptive controller.
        kl_penalty: estimator name, see ``kl_penalty``.

    Returns:
        token_level_rewards: (B, T)
        metrics: ``actor/reward_kl_penalty`` (batch mean of each sequence's masked mean KL)
            and ``actor/reward_kl_penalty_coeff`` (the beta used).
    """
    where = "apply_kl_penalty"
    check_floating(where, "token_level_scores", token_level_scores)
    check_ndim(where, "token_level_scores", token_level_scores, 2, "(B, T)")
    check_mask(where, "response_mask", response_mask, "token_level_scores", token_level_scores)
    check_floating(where, "old_log_probs", old_log_probs)
    token_shape = old_log_probs.shape[:2] if kl_penalty == "full" else old_log_probs.shape
    if token_shape != token_level_scores.shape:
        raise ValueError(
            f"{where}: old_log_probs has shape {tuple(old_log_probs.shape)} but token_level_scores has "
            f"shape {tuple(token_level_scores.shape)}; the (B, T) dims must match"
        )
    check_same_dtype(where, "old_log_probs", old_log_probs, "token_level_scores", token_level_scores)
    kld = kl_penalty_fn(old_log_probs, ref_log_probs, kl_penalty)  # (B, T)
    kld = torch.where(response_mask != 0, kld, torch.zeros_like(kld))
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean().item()  # sync: one float per step
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
