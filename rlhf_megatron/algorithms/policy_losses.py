"""Policy-gradient losses, found by name (``actor.policy_loss.loss_mode`` in verl configs).

Role: the actor's objective given old/new log-probs and advantages. Every variant has
the same signature and returns the same four values, so the actor code never branches on
the algorithm::

    fn(old_log_prob, log_prob, advantages, response_mask, *, cliprange, cliprange_low,
       cliprange_high, clip_ratio_c, loss_agg_mode, rollout_is_weights, **variant_options)
    -> (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)

``pg_loss`` carries the gradient; the three metrics are detached 0-dim tensors.
``rollout_is_weights`` (B, T), optional: rollout-correction importance weights
(``rollout_correction``); each token's loss is multiplied by its (detached) weight before
aggregation, so the metrics are unweighted.

Variants: ``vanilla`` (PPO clip + dual clip), ``gspo`` (sequence-level ratio) and
``kl_cov`` (KL penalty on the highest-covariance tokens).

Boundaries: pure tensor math on one micro-batch; aggregation through ``losses.agg_loss``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhf_megatron.algorithms.losses import agg_loss
from rlhf_megatron.algorithms.utils import check_ndim, check_values_and_mask, masked_mean

__all__ = [
    "POLICY_LOSS_REGISTRY",
    "compute_policy_loss",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "get_policy_loss_fn",
    "register_policy_loss",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]

POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under ``name``; a taken name is an error."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"policy loss {name!r} is already registered to {existing.__module__}.{existing.__qualname__}; "
                f"register yours under another name"
            )
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """Return the policy loss registered as ``name``; ValueError listing known names otherwise."""
    try:
        return POLICY_LOSS_REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(POLICY_LOSS_REGISTRY))
        raise ValueError(f"unknown policy loss {name!r}; known policy losses: {known}") from None


def _check(where, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights) -> None:
    named = {"log_prob": log_prob, "old_log_prob": old_log_prob, "advantages": advantages}
    if rollout_is_weights is not None:
        named["rollout_is_weights"] = rollout_is_weights
    check_values_and_mask(where, named, "response_mask", response_mask)
    check_ndim(where, "log_prob", log_prob, 2, "(B, T)")


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token losses times the importance weights; the weights change the sampling measure,
    not the objective, so no gradient flows into them."""
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights.detach()


def _clip_offsets(cliprange, cliprange_low, cliprange_high) -> tuple[float, float]:
    """(low, high) clip offsets; each side defaults to ``cliprange``."""
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    return low, high


def _clip_bounds(cliprange, cliprange_low, cliprange_high) -> tuple[float, float]:
    low, high = _clip_offsets(cliprange, cliprange_low, cliprange_high)
    return 1.0 - low, 1.0 + high


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """(B, T) ``lp - old`` clamped to [-20, 20], so exp cannot overflow on a stale token."""
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate (Schulman et al. 2017) with dual clip (Ye et al. 2020).

    ``ratio = exp(clamp(lp - old, -20, 20))``; per token the loss is
    ``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``, and for ``A < 0`` it is further
    capped at ``-A * clip_ratio_c`` so one very unlikely old token cannot dominate.
    ``cliprange_low``/``cliprange_high`` default to ``cliprange`` (DAPO's clip-higher sets
    them apart).

    Args:
        old_log_prob: (B, T) log-probs at rollout time.
        log_prob: (B, T) current log-probs (requires grad).
        advantages: (B, T)
        response_mask: (B, T)
        cliprange, cliprange_low, cliprange_high: PPO clip.
        clip_ratio_c: dual-clip bound, must be > 1.
        loss_agg_mode: see ``agg_loss``.
        rollout_is_weights: (B, T) optional per-token loss weights (rollout correction).
        **kwargs: options of other variants; ignored.

    Returns:
        pg_loss: () loss.
        pg_clipfrac: () masked fraction of tokens where the clipped term is the larger.
        ppo_kl: () masked mean of ``old - new`` log-prob (approximate KL(old || new)).
        pg_clipfrac_lower: () masked fraction where the dual-clip cap applied (A < 0).
    """
    where = "compute_policy_loss"
    del kwargs
    if not clip_ratio_c > 1.0:
        raise ValueError(
            f"{where}: clip_ratio_c must be > 1 (the dual-clip cap is clip_ratio_c * |A|), got {clip_ratio_c}"
        )
    _check(where, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    # Clamped before exp so a stale or masked token cannot overflow the ratio.
    log_ratio = _log_ratio(log_prob, old_log_prob)  # (B, T)
    ratio = torch.exp(log_ratio)
    lo, hi = _clip_bounds(cliprange, cliprange_low, cliprange_high)

    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * torch.clamp(ratio, lo, hi)  # (B, T)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_cap = -advantages * clip_ratio_c  # (B, T) dual-clip bound, binding only for A < 0
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(loss_ppo, loss_cap), loss_ppo)
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)

    with torch.no_grad():
        dtype = log_prob.dtype
        pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(dtype), response_mask)
        pg_clipfrac_lower = masked_mean((negative & (loss_ppo > loss_cap)).to(dtype), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, the geometric mean.

    ``s_i = exp(mean_t(lp - old))`` over the sequence's valid tokens. The per-token ratio
    is ``sg(s_i) * exp(lp - sg(lp))``: numerically ``s_i`` everywhere, while the gradient
    reaches each token's log-prob as ``s_i * A * grad(lp)`` (the paper's GSPO-token). The
    log-ratio is capped at 10 before exp, as in verl. No dual clip (``clip_ratio_c`` is
    accepted and unused; ``pg_clipfrac_lower`` is 0). Typical clip ranges are ~3e-4 /
    4e-4, far tighter than PPO's.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T) each.
        cliprange, cliprange_low, cliprange_high: clip range on the sequence ratio.
        clip_ratio_c: unused.
        loss_agg_mode: default ``seq-mean-token-mean`` (the paper's sequence average); an
            explicitly passed mode is honoured.
        rollout_is_weights: (B, T) optional per-token loss weights (rollout correction).
        **kwargs: options of other variants; ignored.

    Returns:
        pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower: () each, as for ``vanilla``.
    """
    where = "compute_policy_loss_gspo"
    del clip_ratio_c, kwargs
    _check(where, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = log_prob - old_log_prob  # (B, T)
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # (B,)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()  # (B, T)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    lo, hi = _clip_bounds(cliprange, cliprange_low, cliprange_high)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, lo, hi)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)

    with torch.no_grad():
        pg_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(log_prob.dtype), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
        pg_clipfrac_lower = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").

    Unclipped surrogate ``-A * ratio`` everywhere, plus ``ppo_kl_coef * |lp - old|`` on the
    top ``kl_cov_ratio`` fraction of valid tokens ranked by the covariance
    ``(A - mean A) * (lp - mean lp)``: the tokens that drive entropy collapse. No ratio
    clipping (the clip arguments are accepted and unused). Choosing k reads the valid-token
    count back to the host: one sync per call.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T) each.
        cliprange, cliprange_low, cliprange_high, clip_ratio_c: unused.
        loss_agg_mode: see ``agg_loss``.
        rollout_is_weights: (B, T) optional per-token loss weights (rollout correction); they
            weight the penalised tokens' whole loss, penalty included.
        kl_cov_ratio: fraction of valid tokens to penalise (at least one), > 0.
        ppo_kl_coef: weight of the |log-ratio| penalty.
        **kwargs: options of other variants; ignored.

    Returns:
        pg_loss: ()
        pg_clipfrac: () always 0 (nothing is clipped).
        ppo_kl: () masked mean of ``|lp - old|`` (verl reports the absolute value here).
        pg_clipfrac_lower: () always 0.
    """
    where = "compute_policy_loss_kl_cov"
    del cliprange, cliprange_low, cliprange_high, clip_ratio_c, kwargs
    if not kl_cov_ratio > 0:
        raise ValueError(f"{where}: kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    _check(where, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = _log_ratio(log_prob, old_log_prob)  # (B, T)
    abs_kl = log_ratio.abs()
    pg_losses = -advantages * torch.exp(log_ratio)  # (B, T)

    with torch.no_grad():
        valid = response_mask != 0
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob.detach() - masked_mean(log_prob.detach(), response_mask)
        )
        cov = torch.where(valid, cov, torch.full_like(cov, float("-inf"))).flatten()  # (B*T,)
        n_valid = int(valid.sum())  # sync: k must be a host integer
        selected = torch.zeros_like(cov, dtype=torch.bool)
        if n_valid > 0:
            k = min(n_valid, max(1, int(n_valid * kl_cov_ratio)))
            selected[torch.topk(cov, k).indices] = True
        selected = selected.view_as(valid)

    pg_losses = torch.where(selected, pg_losses + ppo_kl_coef * abs_kl, pg_losses)
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    with torch.no_grad():
        zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
        ppo_kl = masked_mean(abs_kl, response_mask)
    return pg_loss, zero, ppo_kl, zero.clone()
