"""verl's further policy losses, under verl's names: CISPO, SAPO, GPG, DRO, GMPO (``geo_mean``),
Clip-Cov, DPPO-Binary-TV and DPPO-Binary-KL.

Role: the same contract as ``policy_losses`` (same signature, same four returned values,
importance weights multiplied in detached before aggregation), registered in the same registry,
so ``actor.policy_loss.loss_mode=<name>`` picks one with no change to the actor. The options each
variant reads arrive as keywords from ``actor.policy_loss.*`` (``clip_cov_*``, ``dro_beta``) and
``actor.tau_pos``/``actor.tau_neg``, with verl's defaults; the rest are ignored.

Where verl reports no clip fraction for a loss the value is 0, as for ``kl_cov``.

Boundaries: pure tensor math on one micro-batch; aggregation through ``losses.agg_loss``.
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms.losses import agg_loss
from rlhf_megatron.algorithms.policy_losses import (
    _check,
    _clip_bounds,
    _clip_offsets,
    _log_ratio,
    _weighted,
    register_policy_loss,
)
from rlhf_megatron.algorithms.utils import masked_mean

__all__ = [
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_sapo",
]

LossOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _frac(flags: torch.Tensor, response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """() masked share of ``flags`` (bool, (B, T)) in ``like``'s dtype, detached."""
    return masked_mean(flags.to(like.dtype), response_mask).detach()


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs,
) -> LossOut:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update.

    Per token ``-sg(clip(r, 1 - low, 1 + high)) * A * lp`` with ``r = exp(lp - old)``: every
    token keeps a gradient (``-clip(r) * A``), only its weight is bounded, so rare tokens that
    PPO would clip out still learn.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T) each.
        cliprange, cliprange_low, cliprange_high: bounds of the clipped weight.
        loss_agg_mode: see ``agg_loss``.
        rollout_is_weights: (B, T) optional per-token loss weights (rollout correction).
        **kwargs: options of other variants; ignored.

    Returns:
        pg_loss: ()
        pg_clipfrac: () masked share of tokens whose weight was clipped (either side).
        ppo_kl: () masked mean of ``old - lp``.
        pg_clipfrac_lower: () 0.
    """
    del kwargs
    _check("compute_policy_loss_cispo", old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = _log_ratio(log_prob, old_log_prob)  # (B, T)
    ratio = torch.exp(log_ratio)
    lo, hi = _clip_bounds(cliprange, cliprange_low, cliprange_high)
    clipped = torch.clamp(ratio, lo, hi).detach()  # (B, T) the weight carries no gradient
    pg_losses = -clipped * advantages * log_prob
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    with torch.no_grad():
        clipfrac = _frac(ratio != clipped, response_mask, log_prob)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, clipfrac, ppo_kl, _zero(log_prob)


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **kwargs,
) -> LossOut:
    """SAPO (arXiv:2511.20347): a smooth sigmoid gate in place of the hard clip.

    Per token ``-A * (4 / tau) * sigmoid(tau * (r - 1))``, ``tau = tau_pos`` where ``A > 0``
    and ``tau_neg`` elsewhere. At ``r = 1`` the gradient equals the unclipped surrogate's; far
    from it the gate flattens, so off-policy tokens fade instead of being cut off. As in verl,
    aggregation is always ``seq-mean-token-mean`` (``loss_agg_mode`` is accepted and unused).

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T) each.
        loss_agg_mode: unused (see above).
        rollout_is_weights: (B, T) optional per-token loss weights (rollout correction).
        tau_pos, tau_neg: gate temperatures (``actor.tau_pos``/``actor.tau_neg``), > 0.
        **kwargs: options of other variants; ignored.

    Returns:
        pg_loss: (); pg_clipfrac: () 0; ppo_kl: () masked mean of ``old - lp``;
        pg_clipfrac_lower: () 0.
    """
    del loss_agg_mode, kwargs
    where = "compute_policy_loss_sapo"
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"{where}: tau_pos and tau_neg must be > 0, got {tau_pos} and {tau_neg}")
    _check(where, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = _log_ratio(log_prob, old_log_prob)  # (B, T)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0, torch.full_like(advantages, tau_pos), torch.full_like(advantages, tau_neg)
    )  # (B, T)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gate * advantages
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, "seq-mean-token-mean")
    with torch.no_grad():
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, _zero(log_prob), ppo_kl, _zero(log_prob)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs,
) -> LossOut:
    """GPG (arXiv:2504.02546): plain policy gradient, ``-A * lp`` per token, no ratio, no clip.

    Pair it with ``algorithm.adv_estimator=gpg``. ``old_log_prob`` only feeds the ``ppo_kl``
    metric (verl reports none for this loss).

    Returns:
        pg_loss: (); pg_clipfrac: () 0; ppo_kl: () masked mean of ``old - lp``;
        pg_clipfrac_lower: () 0.
    """
    del kwargs
    _check("compute_policy_loss_gpg", old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    pg_losses = -advantages * log_prob  # (B, T)
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    with torch.no_grad():
        ppo_kl = masked_mean(old_log_prob - log_prob, response_mask)
    return pg_loss, _zero(log_prob), ppo_kl, _zero(log_prob)


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    dro_beta: float | None = None,
    **kwargs,
) -> LossOut:
    """Direct Reward Optimization: policy gradient with a quadratic log-ratio penalty.

    Per token ``-(A * lp - 0.5 * beta * (lp - old)^2)``, ``beta = dro_beta`` (required, > 0):
    the penalty replaces PPO's clip as the trust region.

    Returns:
        pg_loss: (); pg_clipfrac: () 0; ppo_kl: () masked mean of ``old - lp``;
        pg_clipfrac_lower: () 0.
    """
    del kwargs
    where = "compute_policy_loss_dro"
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(
            f"{where}: actor_rollout_ref.actor.policy_loss.dro_beta must be > 0 for loss_mode=dro, got {dro_beta}"
        )
    _check(where, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = log_prob - old_log_prob  # (B, T)
    pg_losses = -(advantages * log_prob - 0.5 * dro_beta * log_ratio.square())
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    with torch.no_grad():
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, _zero(log_prob), ppo_kl, _zero(log_prob)


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    **kwargs,
) -> LossOut:
    """GMPO (arXiv:2507.20673): one ratio per sequence, the geometric mean of clipped token ratios.

    Each token's log-ratio ``d = lp - old`` is clipped in log space to ``[-low, high]`` on the
    side that matters for the advantage's sign (``sgn(A) * min(sgn(A) d, sgn(A) clip(d))``);
    the sequence ratio is ``exp(masked mean of that)`` and the loss ``-mean_A * ratio`` per
    sequence (``mean_A`` the masked mean advantage: outcome advantages are constant per row),
    averaged over every row of the micro-batch. ``loss_agg_mode`` is unused, as in verl.
    Importance weights enter as their per-sequence geometric mean.

    Returns:
        pg_loss: ()
        pg_clipfrac: () masked share of tokens with ``A > 0`` whose log-ratio was clipped.
        ppo_kl: () masked mean of ``old - lp``.
        pg_clipfrac_lower: () the same for ``A < 0``.
    """
    del loss_agg_mode, kwargs
    _check(
        "compute_policy_loss_geo_mean", old_log_prob, log_prob, advantages, response_mask, rollout_is_weights
    )
    low, high = _clip_offsets(cliprange, cliprange_low, cliprange_high)
    log_ratio = log_prob - old_log_prob  # (B, T)
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -low, high)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * clamped)  # (B, T)
    lengths = response_mask.sum(dim=-1)  # (B,)
    seq_ratio = torch.exp((log_ratio_min * response_mask).sum(dim=-1) / (lengths + 1e-8))  # (B,)
    seq_adv = (advantages * response_mask).sum(dim=-1) / (lengths + 1e-8)  # (B,)
    pg_losses = -seq_adv * seq_ratio  # (B,)
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach() + 1e-10)
        pg_losses = pg_losses * torch.exp((log_w * response_mask).sum(dim=-1) / (lengths + 1e-8))
    pg_loss = pg_losses.mean()
    with torch.no_grad():
        was_clipped = log_ratio != clamped
        clipfrac = _frac(was_clipped & (advantages > 0), response_mask, log_prob)
        clipfrac_lower = _frac(was_clipped & (advantages < 0), response_mask, log_prob)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, clipfrac, ppo_kl, clipfrac_lower


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    **kwargs,
) -> LossOut:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").

    The PPO clipped surrogate (no dual clip), with the gradient cut on a few tokens whose
    covariance ``(A - mean A) * (lp - mean lp)`` lies in ``(clip_cov_lb, clip_cov_ub)``: at
    most ``max(1, int(clip_cov_ratio * valid tokens))`` of them, drawn at random among the
    candidates not already clipped by PPO. Those tokens' loss is multiplied by 0. Drawing the
    count reads the valid-token count back to the host: one sync per call.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T) each.
        cliprange, cliprange_low, cliprange_high: PPO clip.
        loss_agg_mode: see ``agg_loss``.
        rollout_is_weights: (B, T) optional per-token loss weights (rollout correction).
        clip_cov_ratio: share of valid tokens to cut, > 0.
        clip_cov_lb, clip_cov_ub: the covariance window of the candidates.
        generator: random source of the draw (default: torch's global one).
        **kwargs: options of other variants; ignored.

    Returns:
        pg_loss: ()
        pg_clipfrac: () masked share of tokens whose gradient was cut.
        ppo_kl: () masked mean of ``old - lp``.
        pg_clipfrac_lower: () 0.
    """
    del kwargs
    where = "compute_policy_loss_clip_cov"
    if not clip_cov_ratio > 0:
        raise ValueError(f"{where}: clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    _check(where, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = _log_ratio(log_prob, old_log_prob)  # (B, T)
    ratio = torch.exp(log_ratio)
    lo, hi = _clip_bounds(cliprange, cliprange_low, cliprange_high)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, lo, hi)

    with torch.no_grad():
        valid = response_mask != 0
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob.detach(), response_mask)
        )  # (B, T)
        candidates = valid & ~(loss_clipped > loss_unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        flat = torch.nonzero(candidates.flatten()).squeeze(-1)  # (n_candidates,)
        n_cut = max(1, int(clip_cov_ratio * int(valid.sum())))  # sync: a host count
        if flat.numel() > n_cut:
            flat = flat[
                torch.randperm(flat.numel(), generator=generator, device="cpu")[:n_cut].to(flat.device)
            ]
        keep = torch.ones(candidates.numel(), dtype=log_prob.dtype, device=log_prob.device)
        keep[flat] = 0.0
        keep = keep.view_as(candidates)  # (B, T) 0 on the cut tokens

    pg_losses = torch.maximum(loss_unclipped, loss_clipped) * keep
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    with torch.no_grad():
        clipfrac = _frac(keep == 0, response_mask, log_prob)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, clipfrac, ppo_kl, _zero(log_prob)


def _dppo_loss(
    where: str,
    valid_mask: torch.Tensor,
    log_ratio: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_c: float,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
) -> LossOut:
    """DPPO's shared tail: ``-A * sg(min(r, c)) * lp`` on the tokens inside the divergence bound."""
    if not clip_ratio_c > 0:
        raise ValueError(
            f"{where}: clip_ratio_c (the truncation of the ratio) must be > 0, got {clip_ratio_c}"
        )
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()  # (B, T)
    inside = valid_mask.detach().to(log_prob.dtype)
    pg_losses = -advantages * truncated * log_prob * inside
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    with torch.no_grad():
        clipfrac = _frac(inside == 0, response_mask, log_prob)
        clipfrac_lower = _frac((ratio > clip_ratio_c) & (inside != 0), response_mask, log_prob)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, clipfrac, ppo_kl, clipfrac_lower


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
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
) -> LossOut:
    """DPPO-Binary-TV (arXiv:2602.04879): a trust region on the sampled token's probability.

    A token learns (``-A * sg(min(r, clip_ratio_c)) * lp``) while ``p - p_old <= high`` for
    ``A > 0``, or ``p - p_old >= -low`` otherwise; outside, its loss is 0. ``cliprange*`` are
    here bounds on the probability difference (the binary total variation), not on the ratio;
    ``clip_ratio_c`` truncates the ratio (the paper advises a large value, e.g. 20).

    Returns:
        pg_loss: ()
        pg_clipfrac: () masked share of tokens outside the trust region.
        ppo_kl: () masked mean of ``old - lp``.
        pg_clipfrac_lower: () masked share of tokens inside it whose ratio was truncated.
    """
    del kwargs
    where = "compute_policy_loss_dppo_tv"
    _check(where, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = _clip_offsets(cliprange, cliprange_low, cliprange_high)  # bounds on p - p_old here
    log_ratio = _log_ratio(log_prob, old_log_prob)
    with torch.no_grad():
        diff = log_prob.exp() - old_log_prob.exp()  # (B, T)
        valid_mask = torch.where(advantages > 0, diff <= high, diff >= -low)
    return _dppo_loss(
        where,
        valid_mask,
        log_ratio,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_c,
        loss_agg_mode,
        rollout_is_weights,
    )


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
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
) -> LossOut:
    """DPPO-Binary-KL (arXiv:2602.04879): as ``dppo_tv`` with the binary KL as the divergence.

    ``KL = p_old * (old - lp) + (1 - p_old) * log((1 - p_old + 1e-8) / (1 - p + 1e-8))``; a
    token with ``A > 0`` learns while ``KL <= high`` or ``p <= p_old`` (its update moves away
    from the bound), one with ``A <= 0`` while ``KL <= low`` or ``p >= p_old``.

    Returns:
        pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower: () each, as for ``dppo_tv``.
    """
    del kwargs
    where = "compute_policy_loss_dppo_kl"
    _check(where, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = _clip_offsets(cliprange, cliprange_low, cliprange_high)  # bounds on the binary KL here
    log_ratio = _log_ratio(log_prob, old_log_prob)
    with torch.no_grad():
        p, p_old = log_prob.exp(), old_log_prob.exp()  # (B, T)
        binary_kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log(
            (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
        )
        valid_mask = torch.where(
            advantages > 0, (binary_kl <= high) | (p <= p_old), (binary_kl <= low) | (p >= p_old)
        )
    return _dppo_loss(
        where,
        valid_mask,
        log_ratio,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_c,
        loss_agg_mode,
        rollout_is_weights,
    )
