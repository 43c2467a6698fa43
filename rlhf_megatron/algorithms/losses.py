"""Loss aggregation, the clipped value loss, and the entropy bonus.

Role: ``agg_loss`` turns a per-token loss matrix into the scalar that is back-propagated,
in one of verl's four modes; the value and entropy losses are built on it. The policy
losses, which have a registry of their own, live in ``policy_losses.py``.

Boundaries: pure tensor math on the local micro-batch. Any rescaling for gradient
accumulation or data parallelism belongs to the caller; it does not leak in here.
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms.utils import (
    check_floating,
    check_mask,
    check_ndim,
    check_values_and_mask,
    masked_mean,
    masked_sum,
)

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "compute_entropy_loss",
    "compute_value_loss",
    "entropy_from_logits",
]

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar.

    ``token-mean``: masked mean over every token of the batch (long responses weigh more).
    ``seq-mean-token-sum``: each sequence's masked sum, averaged over sequences.
    ``seq-mean-token-mean``: each sequence's masked mean, averaged over sequences; an
    all-masked row contributes 0 but still counts in the average, as in verl.
    ``seq-mean-token-sum-norm``: each sequence's masked sum, averaged over sequences, then
    divided by ``loss_mask.shape[-1]``, the padded length, which is meant to be a constant
    (Dr. GRPO). verl sums over sequences here instead of averaging; see the package notes.

    Args:
        loss_mat: (B, T) floating (any leading dims work; the last is tokens).
        loss_mask: (B, T).
        loss_agg_mode: one of ``LOSS_AGG_MODES``.

    Returns:
        0-dim tensor, differentiable w.r.t. ``loss_mat``.
    """
    where = "agg_loss"
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"{where}: unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}"
        )
    check_floating(where, "loss_mat", loss_mat)
    check_mask(where, "loss_mask", loss_mask, "loss_mat", loss_mat)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, loss_mask, dim=-1).mean()
    seq_sums = masked_sum(loss_mat, loss_mask, dim=-1)  # (B,)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.mean()
    return seq_sums.mean() / loss_mask.shape[-1]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss for the PPO critic.

    ``0.5 * agg(max((v - R)^2, (clip(v, values - c, values + c) - R)^2))``: the new
    prediction may not profit from moving more than ``c`` away from the rollout-time value.

    Args:
        vpreds: (B, T) current critic predictions (requires grad).
        returns: (B, T) regression targets from the advantage estimator.
        values: (B, T) critic values at rollout time.
        response_mask: (B, T).
        cliprange_value: ``c``.
        loss_agg_mode: see ``agg_loss``.

    Returns:
        vf_loss: () scalar loss.
        vf_clipfrac: () detached, masked fraction of tokens where the clipped term is larger.
    """
    where = "compute_value_loss"
    check_values_and_mask(
        where, {"vpreds": vpreds, "returns": returns, "values": values}, "response_mask", response_mask
    )
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns).square()  # (B, T)
    clipped = (vpred_clipped - returns).square()  # (B, T)
    vf_loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(clipped, unclipped).to(vpreds.dtype), response_mask).detach()
    return vf_loss, vf_clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits``, per position.

    ``logsumexp(z) - sum(softmax(z) * z)``, which equals ``-sum(p log p)`` without forming
    ``log p``, so vanishing probabilities cannot produce ``0 * log 0``. Logits must be finite.

    Args:
        logits: (..., V) floating.

    Returns:
        (...) entropy in nats.
    """
    check_floating("entropy_from_logits", "logits", logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated token entropy (the actor subtracts ``entropy_coeff *`` this from its loss).

    Args:
        logits: (B, T, V) policy logits at the response positions.
        response_mask: (B, T).
        loss_agg_mode: see ``agg_loss``.

    Returns:
        () scalar, differentiable w.r.t. ``logits``.
    """
    where = "compute_entropy_loss"
    check_floating(where, "logits", logits)
    check_ndim(where, "logits", logits, 3, "(B, T, V)")
    if response_mask.shape != logits.shape[:2]:
        raise ValueError(
            f"{where}: logits has shape {tuple(logits.shape)} but response_mask has shape "
            f"{tuple(response_mask.shape)}; response_mask must be logits.shape[:2]"
        )
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
