"""Rollout correction: truncated importance weights from the rollout engine's policy to the actor's.

Role: the rollout engine (vLLM or transformers) samples the responses and reports each sampled
token's log-prob (``rollout_log_probs``); the actor recomputes them (``old_log_probs``). The two
policies differ by numerics (bf16 kernels, another MoE routing) and, once the rollout runs
asynchronously, by weight version, so the PPO update is off-policy. Multiplying each token's
policy-gradient loss by ``w = pi_old / pi_rollout``, capped at a threshold (truncated IS, verl's
``algorithm.rollout_correction.rollout_is``), corrects that with bounded variance.

A threshold ``"lo_hi"`` turns truncation into IcePop: weights outside [lo, hi] become 0 (those
tokens stop learning) and the others keep their value. Rejection sampling (``rollout_rs``,
``rollout_rejection``) instead removes tokens from ``response_mask``.

``compute_rollout_is_weights`` is the math on tensors; ``apply_rollout_correction`` is the
driver's one call after the old-log-prob pass: it reads the batch's log-probs and writes
``rollout_is_weights`` [B, R], which the policy losses multiply in (``policy_losses``), and, with
``rollout_rs``, a narrowed ``response_mask``.

Boundaries: pure tensor math, no torch.distributed. The driver holds the whole step's batch, so
the batch normalisation and the metrics cover every DP rank's rows without a reduction. In
bypass mode the correction happens at loss time instead (``bypass_correction``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from rlhf_megatron.algorithms.rollout_rejection import (
    compute_offpolicy_metrics,
    compute_rollout_rejection_mask,
    parse_rollout_is_threshold,
)
from rlhf_megatron.algorithms.utils import check_ndim, check_values_and_mask
from rlhf_megatron.choices import RolloutIsLevel


class RolloutCorrectionSettings(Protocol):
    """What ``apply_rollout_correction`` reads of ``algorithm.rollout_correction`` (the config's
    ``RolloutCorrectionConfig``; config sits above algorithms, so it is described, not imported)."""

    rollout_is: str | None
    rollout_is_threshold: float | str
    rollout_is_batch_normalize: bool
    rollout_rs: str | None
    rollout_rs_threshold: float | str | None
    bypass_mode: bool
    loss_type: str


class Columns(Protocol):
    """The batch's tensor columns by name (``data.batch.Batch``, or a dict of tensors)."""

    def __contains__(self, key: object) -> bool: ...
    def __getitem__(self, key: str) -> torch.Tensor: ...
    def __setitem__(self, key: str, value: torch.Tensor) -> None: ...
    def keys(self) -> Iterable[str]: ...


__all__ = [
    "ROLLOUT_IS_LEVELS",
    "apply_rollout_correction",
    "compute_rollout_is_weights",
]

ROLLOUT_IS_LEVELS = RolloutIsLevel.values()  # algorithm.rollout_correction.rollout_is, null aside
# Log-ratios are clamped before exp, as verl does: exp(20) ~ 4.9e8 stays finite in fp32 and is
# far past any useful cap, so only the metrics of raw weights ever see the bound.
LOG_RATIO_BOUND = 20.0
METRIC_PREFIX = "rollout_corr/"
BATCH_KEYS = ("old_log_probs", "rollout_log_probs", "response_mask")


def _weight_metrics(
    raw: torch.Tensor, truncated: torch.Tensor, threshold: float, lower: float | None = None
) -> dict[str, float]:
    """Statistics of one weight per unit (token or sequence). ``raw``, ``truncated``: (N,)."""
    n = raw.numel()
    if n == 0:
        return {}
    w = truncated.double()
    sum_sq = (w * w).sum()
    ess = float(w.sum() ** 2 / (n * sum_sq)) if sum_sq > 0 else 0.0
    outside = raw > threshold if lower is None else (raw > threshold) | (raw < lower)
    metrics = {
        f"{METRIC_PREFIX}rollout_is_mean": float(w.mean()),
        f"{METRIC_PREFIX}rollout_is_std": float(w.std(correction=0)),
        f"{METRIC_PREFIX}rollout_is_min": float(w.min()),
        f"{METRIC_PREFIX}rollout_is_max": float(w.max()),
        f"{METRIC_PREFIX}rollout_is_max_raw": float(raw.double().max()),
        f"{METRIC_PREFIX}rollout_is_clipped_frac": float(outside.double().mean()),
        f"{METRIC_PREFIX}rollout_is_eff_sample_size": ess,
    }
    if lower is not None:
        metrics[f"{METRIC_PREFIX}rollout_is_oob_ratio"] = float(outside.double().mean())
    return metrics


def compute_rollout_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``min(pi_old / pi_rollout, threshold)``, one per token.

    ``token``: ``w_t = exp(old_t - rollout_t)``. ``sequence``: one weight per response,
    ``exp(sum_t (old_t - rollout_t))`` over its valid tokens, repeated on each of them (unbiased
    for the whole trajectory, but its variance grows with length). Log-ratios are clamped to
    [-20, 20] before exp. With ``rollout_is_batch_normalize`` the truncated weights are divided
    by their mean over the batch's valid tokens, so token-mean aggregation keeps its scale.

    Args:
        old_log_probs: (B, R) the actor's log-probs of the sampled tokens.
        rollout_log_probs: (B, R) the rollout engine's log-probs of the same tokens.
        response_mask: (B, R) 1 on response tokens; entries elsewhere may hold anything.
        rollout_is: ``token`` or ``sequence``.
        rollout_is_threshold: the cap, > 0; or ``"lo_hi"`` (IcePop): weights outside [lo, hi]
            become 0, the rest keep their value.
        rollout_is_batch_normalize: rescale to mean 1 over valid tokens.

    Returns:
        weights: (B, R) detached, 0 where ``response_mask`` is 0; dtype of ``old_log_probs``.
        metrics: under ``rollout_corr/``, over the units (tokens, or sequences with at least one
            valid token), of the truncated weights before batch normalisation:
            ``rollout_is_mean``/``_std``/``_min``/``_max``, ``rollout_is_max_raw`` (before the
            cap), ``rollout_is_clipped_frac`` (share of units capped) and
            ``rollout_is_eff_sample_size`` (``(sum w)^2 / (n * sum w^2)``, in (0, 1]); with
            normalisation also ``rollout_is_batch_norm_factor`` (the mean divided out); with IcePop
            ``rollout_is_oob_ratio`` (share of units outside [lo, hi], counted in
            ``rollout_is_clipped_frac`` too). Empty when no token is valid.
    """
    where = "compute_rollout_is_weights"
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"{where}: rollout_is={rollout_is!r} is not one of: {', '.join(ROLLOUT_IS_LEVELS)}")
    lower, upper = parse_rollout_is_threshold(rollout_is_threshold, f"{where}: rollout_is_threshold")
    check_values_and_mask(
        where,
        {"old_log_probs": old_log_probs, "rollout_log_probs": rollout_log_probs},
        "response_mask",
        response_mask,
    )
    check_ndim(where, "old_log_probs", old_log_probs, 2, "(B, R)")

    with torch.no_grad():
        valid = response_mask != 0  # (B, R)
        zero = torch.zeros((), dtype=old_log_probs.dtype, device=old_log_probs.device)
        # Select rather than multiply: padding may hold anything, NaN or -inf included.
        log_ratio = torch.where(valid, old_log_probs - rollout_log_probs, zero)  # (B, R)
        if rollout_is == "token":
            unit_log_ratio, unit_valid = log_ratio, valid  # (B, R)
        else:
            unit_log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # (B, 1)
            unit_valid = valid.any(dim=-1, keepdim=True)  # (B, 1)
        raw = torch.exp(unit_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        if lower is None:
            truncated = raw.clamp(max=upper)
        else:  # IcePop: out-of-band units are masked, in-band ones kept as they are
            out_of_band = (raw < lower) | (raw > upper)
            truncated = torch.where(out_of_band, torch.zeros_like(raw), raw)
        metrics = _weight_metrics(raw[unit_valid], truncated[unit_valid], upper, lower)
        weights = torch.where(valid, truncated.expand_as(log_ratio), zero)  # (B, R)
        if rollout_is_batch_normalize and valid.any():
            # Truncated weights are >= exp(-20) > 0; only IcePop can zero them all.
            factor = weights.sum() / valid.sum()
            if factor > 0:
                weights = weights / factor
            metrics[f"{METRIC_PREFIX}rollout_is_batch_norm_factor"] = float(factor)
    return weights, metrics


def apply_rollout_correction(batch: Columns, cfg: RolloutCorrectionSettings) -> dict[str, float]:
    """With ``cfg.rollout_is`` set, write ``batch["rollout_is_weights"]`` (B, R); with
    ``cfg.rollout_rs`` set, narrow ``batch["response_mask"]`` to the tokens every rejection option
    keeps. Return the ``rollout_corr/`` metrics, the off-policy diagnostics (``training_ppl``,
    ``chi2_token``, ...) included; ``{}`` and no change when both are null.

    Call after the actor's old-log-prob pass: both need ``old_log_probs`` next to the engine's
    ``rollout_log_probs``. The weights are computed on the mask before rejection (a rejected
    token's weight is never used). In bypass mode ``old_log_probs`` are the engine's, so there is
    nothing to compute here: the loss does it against the current policy (``bypass_correction``).
    """
    if cfg.bypass_mode or (cfg.rollout_is is None and cfg.rollout_rs is None):
        return {}
    missing = [key for key in BATCH_KEYS if key not in batch]
    if missing:
        which = (
            f"rollout_is={cfg.rollout_is}" if cfg.rollout_is is not None else f"rollout_rs={cfg.rollout_rs}"
        )
        raise ValueError(
            f"algorithm.rollout_correction.{which} needs {', '.join(missing)} in the batch "
            f"(rollout_log_probs comes from the rollout engine, old_log_probs from the actor's compute_log_prob; "
            f"apply the correction after that pass), but the batch has: {', '.join(sorted(batch.keys()))}. "
            "Set algorithm.rollout_correction.rollout_is=null and rollout_rs=null to train without it"
        )
    weights, mask, metrics = compute_rollout_correction(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], cfg
    )
    if weights is not None:
        batch["rollout_is_weights"] = weights
    batch["response_mask"] = mask
    return metrics


def compute_rollout_correction(
    policy_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RolloutCorrectionSettings,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """The correction of rollout -> policy: the ``rollout_is`` weights (None when it is null),
    ``response_mask`` narrowed by ``rollout_rs`` (unchanged without it), and the ``rollout_corr/``
    metrics with the off-policy diagnostics. The driver's policy is the old one
    (``apply_rollout_correction``), bypass mode's the current one at loss time
    (``bypass_correction``). All (B, R); the weights are computed on the mask before rejection."""
    metrics = {
        f"{METRIC_PREFIX}{name}": value
        for name, value in compute_offpolicy_metrics(
            policy_log_probs, rollout_log_probs, response_mask
        ).items()
    }
    weights = None
    if cfg.rollout_is is not None:
        weights, is_metrics = compute_rollout_is_weights(
            policy_log_probs,
            rollout_log_probs,
            response_mask,
            rollout_is=cfg.rollout_is,
            rollout_is_threshold=cfg.rollout_is_threshold,
            rollout_is_batch_normalize=cfg.rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    mask = response_mask
    if cfg.rollout_rs is not None:
        mask, rs_metrics = compute_rollout_rejection_mask(
            policy_log_probs, rollout_log_probs, response_mask, cfg.rollout_rs, cfg.rollout_rs_threshold
        )
        metrics.update({f"{METRIC_PREFIX}{name}": value for name, value in rs_metrics.items()})
    return weights, mask, metrics
