"""Return-based advantage estimators: GAE, REINFORCE++ and ReMax.

Role: turn per-token rewards ``(B, T)`` into ``(advantages, returns)``, both ``(B, T)``.
These estimators look along each response (discounting, bootstrapping from the critic);
the ones that compare responses within a prompt group live in ``group_advantages.py``.

Conventions shared by every estimator in this package:

* ``response_mask`` marks response tokens. Positions where it is 0 (padding after the
  end, or observation tokens inside a multi-turn response) never influence a valid
  position, and the returned advantages are 0 there so a loss that forgets the mask
  still sees no garbage.
* Advantages carry no gradient (computed under ``torch.no_grad``).
* Half-precision inputs are computed in float32 and cast back.

Boundaries: pure tensor math; registration by name happens through
``adv_registry.register_adv_estimator``.
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms.adv_registry import register_adv_estimator
from rlhf_megatron.algorithms.scan import reverse_linear_scan
from rlhf_megatron.algorithms.utils import (
    check_floating,
    check_ndim,
    check_same_dtype,
    check_values_and_mask,
    masked_whiten,
)

__all__ = [
    "compute_gae_advantage_return",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16 discounted sums over thousands of steps lose most of their digits.
    return torch.promote_types(dtype, torch.float32)


@register_adv_estimator("gae")
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) over the response tokens.

    Same semantics as verl's loop, with its handling of masked steps: a masked step neither
    contributes a TD error nor cuts the chain. Going backwards, it carries ``nextvalues``
    (the value of the next valid token) and ``lastgaelam`` through unchanged, so padding
    after the end and observation tokens inside a response change no valid position::

        delta_t     = r_t + gamma * V(next valid token after t, or 0) - V_t
        A_t         = delta_t + gamma * lam * A_(next valid token)      (valid t)
        returns     = A (raw) + values
        advantages  = masked_whiten(A) * response_mask

    Computed with a chunked scan over time (see ``scan.py``), not a per-step loop.

    Args:
        token_level_rewards: (B, T) floating.
        values: (B, T) critic values, same dtype.
        response_mask: (B, T) 1 on response tokens.
        gamma: discount.
        lam: GAE lambda.

    Returns:
        advantages: (B, T) whitened over valid tokens, 0 at masked positions.
        returns: (B, T) raw GAE advantages + values (the critic's regression target).
    """
    where = "compute_gae_advantage_return"
    check_values_and_mask(
        where, {"token_level_rewards": token_level_rewards, "values": values}, "response_mask", response_mask
    )
    check_ndim(where, "token_level_rewards", token_level_rewards, 2, "(B, T)")
    gamma, lam = float(gamma), float(lam)
    with torch.no_grad():
        out_dtype = token_level_rewards.dtype
        work = _work_dtype(out_dtype)
        rewards = token_level_rewards.to(work)  # (B, T)
        vals = values.to(work)  # (B, T)
        valid = response_mask != 0  # (B, T)
        m = valid.to(work)
        zero = torch.zeros((), dtype=work, device=rewards.device)

        # Value of the first valid token at or after t: valid steps reset it to their own
        # value (decay 0), masked steps pass it through (decay 1).
        first_valid_value = reverse_linear_scan(torch.where(valid, vals, zero), 1.0 - m)  # (B, T)
        next_values = torch.nn.functional.pad(first_valid_value[:, 1:], (0, 1))  # (B, T), 0 past the end
        delta = rewards + gamma * next_values - vals  # (B, T)
        # Valid steps: A_t = delta_t + gamma*lam*A_(t+1); masked steps: A_t = A_(t+1).
        raw_adv = reverse_linear_scan(torch.where(valid, delta, zero), 1.0 - m * (1.0 - gamma * lam))

        returns = raw_adv + vals
        advantages = torch.where(valid, masked_whiten(raw_adv, response_mask), zero)
    return advantages.to(out_dtype), returns.to(out_dtype)


def _discounted_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Discounted return-to-go that restarts at every masked position.

    ``G_t = r_t + gamma * G_(t+1)`` on valid tokens and ``G_t = 0`` on masked ones, so a
    reward never flows backwards across padding or an observation span (verl's
    "reset after EOS"). Rewards on masked positions are ignored.

    Args:
        token_level_rewards: (B, T) floating.
        response_mask: (B, T).
        gamma: discount.

    Returns:
        (B, T) in the work dtype (float32 or wider).
    """
    work = _work_dtype(token_level_rewards.dtype)
    valid = response_mask != 0
    zero = torch.zeros((), dtype=work, device=token_level_rewards.device)
    rewards = torch.where(valid, token_level_rewards.to(work), zero)
    return reverse_linear_scan(rewards, valid.to(work) * float(gamma))


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the batch's valid tokens.

    Args:
        token_level_rewards: (B, T) floating.
        response_mask: (B, T).
        gamma: discount.

    Returns:
        advantages: (B, T) ``masked_whiten(G) * mask``.
        returns: (B, T) the return-to-go ``G`` (0 at masked positions; verl leaves a
            partial sum there, which no loss reads).
    """
    where = "compute_reinforce_plus_plus_outcome_advantage"
    check_values_and_mask(where, {"token_level_rewards": token_level_rewards}, "response_mask", response_mask)
    check_ndim(where, "token_level_rewards", token_level_rewards, 2, "(B, T)")
    with torch.no_grad():
        returns = _discounted_returns(token_level_rewards, response_mask, gamma)  # (B, T)
        valid = response_mask != 0
        advantages = torch.where(valid, masked_whiten(returns, response_mask), torch.zeros_like(returns))
    out_dtype = token_level_rewards.dtype
    return advantages.to(out_dtype), returns.to(out_dtype)


@register_adv_estimator("remax")
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): return-to-go minus the reward of the greedy response.

    The caller generates one greedy response per prompt, scores it, and passes that score
    as ``reward_baselines``; it is subtracted at every response token.

    Args:
        token_level_rewards: (B, T) floating.
        reward_baselines: (B,) same dtype.
        response_mask: (B, T).

    Returns:
        advantages: (B, T) ``(G_t - baseline) * mask``.
        returns: (B, T) undiscounted return-to-go ``G_t`` (reverse cumsum of masked rewards).
    """
    where = "compute_remax_outcome_advantage"
    check_values_and_mask(where, {"token_level_rewards": token_level_rewards}, "response_mask", response_mask)
    check_ndim(where, "token_level_rewards", token_level_rewards, 2, "(B, T)")
    check_floating(where, "reward_baselines", reward_baselines)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"{where}: reward_baselines has shape {tuple(reward_baselines.shape)} but token_level_rewards "
            f"has shape {tuple(token_level_rewards.shape)}; reward_baselines must be "
            f"({token_level_rewards.shape[0]},), one greedy-response reward per row"
        )
    check_same_dtype(where, "reward_baselines", reward_baselines, "token_level_rewards", token_level_rewards)
    with torch.no_grad():
        valid = response_mask != 0
        rewards = torch.where(valid, token_level_rewards, torch.zeros_like(token_level_rewards))
        returns = rewards.flip(-1).cumsum(-1).flip(-1)  # (B, T)
        advantages = torch.where(valid, returns - reward_baselines.unsqueeze(-1), torch.zeros_like(returns))
    return advantages, returns
