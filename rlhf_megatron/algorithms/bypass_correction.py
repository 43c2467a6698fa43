"""Rollout correction at loss time, for verl's bypass mode (``rollout_correction.bypass_mode``).

Role: in bypass mode the actor's old-log-prob pass is skipped and ``old_log_probs`` are the
rollout engine's: the policy that generated is the anchor. What the decoupled mode computes once
on the driver (``rollout_correction``: weights ``pi_old / pi_rollout``, rejection masks) is then
computed inside the loss, per micro-batch, from the current policy against the rollout's,
``r = pi_theta / pi_rollout``, detached:

- ``loss_type=ppo_clip``: PPO's ratio already is ``r``; only ``rollout_rs`` applies, narrowing
  the policy loss's mask (``compute_bypass_correction``).
- ``loss_type=reinforce``: no ratio, no clip; per token ``-sg(w) * A * log pi_theta`` with ``w`` the
  ``rollout_is`` weight of ``r`` (1 without ``rollout_is``), over the narrowed mask
  (``compute_policy_loss_reinforce``). Its gradient is ``-w * A * grad log pi_theta``.

Boundaries: pure tensor math on one micro-batch; no torch.distributed. The metrics are this
micro-batch's; the actor averages them over micro-batches as its other loss metrics.
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms.losses import agg_loss
from rlhf_megatron.algorithms.rollout_correction import RolloutCorrectionSettings, compute_rollout_correction
from rlhf_megatron.algorithms.utils import check_values_and_mask, masked_mean

__all__ = ["compute_bypass_correction", "compute_policy_loss_reinforce", "corrects_at_loss_time"]


def corrects_at_loss_time(cfg: RolloutCorrectionSettings) -> bool:
    """Whether the loss must compute weights or masks: bypass mode with ``rollout_rs`` set or
    ``loss_type=reinforce`` (which reports the weights' statistics even without ``rollout_is``)."""
    return bool(cfg.bypass_mode) and (cfg.rollout_rs is not None or cfg.loss_type == "reinforce")


def compute_bypass_correction(
    log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RolloutCorrectionSettings,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """The loss-time weights and mask of bypass mode, from ``r = pi_theta / pi_rollout``.

    Args:
        log_prob: (B, R) the current policy's log-probs (may require grad; only its value is read).
        rollout_log_probs: (B, R) the rollout engine's (bypass mode's ``old_log_probs``).
        response_mask: (B, R).
        cfg: ``algorithm.rollout_correction``.

    Returns:
        weights: (B, R) detached, the ``rollout_is`` weights of ``r`` (0 off the mask), or None
            when ``rollout_is`` is null.
        mask: (B, R) ``response_mask`` narrowed by ``rollout_rs`` (unchanged without it).
        metrics: under ``rollout_corr/``, those of ``compute_rollout_is_weights`` and
            ``compute_rollout_rejection_mask``, and the off-policy diagnostics with pi_theta in
            the actor's place.
    """
    check_values_and_mask(
        "compute_bypass_correction",
        {"log_prob": log_prob, "rollout_log_probs": rollout_log_probs},
        "response_mask",
        response_mask,
    )
    return compute_rollout_correction(log_prob.detach(), rollout_log_probs, response_mask, cfg)


def compute_policy_loss_reinforce(
    log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance-weighted policy gradient: ``agg(-sg(w) * A * log pi_theta)``.

    Args:
        log_prob: (B, R) the current policy's log-probs, differentiable.
        rollout_log_probs: (B, R) the rollout engine's (only for ``ppo_kl``).
        advantages: (B, R).
        response_mask: (B, R) the tokens the loss covers (after rejection).
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        rollout_is_weights: (B, R) or None (``w = 1``); detached here.

    Returns:
        pg_loss: 0-dim; its gradient is ``agg(-w * A * grad log pi_theta)``.
        ppo_kl: 0-dim detached, masked mean of ``log pi_rollout - log pi_theta``.
    """
    values = {"log_prob": log_prob, "rollout_log_probs": rollout_log_probs, "advantages": advantages}
    if rollout_is_weights is not None:
        values["rollout_is_weights"] = rollout_is_weights
    check_values_and_mask("compute_policy_loss_reinforce", values, "response_mask", response_mask)
    valid = response_mask != 0
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    # Select rather than multiply: padding may hold NaN or -inf, and 0 * inf would leak.
    pg_losses = torch.where(valid, -advantages * log_prob, zero)  # (B, R)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * torch.where(valid, rollout_is_weights.detach(), zero)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    with torch.no_grad():
        ppo_kl = masked_mean(torch.where(valid, rollout_log_probs - log_prob, zero), response_mask)
    return pg_loss, ppo_kl
