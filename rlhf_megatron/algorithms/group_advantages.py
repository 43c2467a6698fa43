"""Group-relative outcome estimators: GRPO, Dr. GRPO, Pass@k GRPO, RLOO, REINFORCE++-baseline.

Role: each response gets one score (the sum of its token rewards over the response
mask). Its advantage compares that score with the other responses to the same prompt
(same id in ``index``) and is broadcast to every valid token. Returns equal advantages:
these estimators have no critic to regress.

Semantics follow verl, including its convention that a group of one response uses mean
0 and std 1 (its score passes through). Group statistics are vectorised through
``grouping.py``; no Python loop runs per sample.

Boundaries: pure tensor math on one batch; advantages carry no gradient.
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms.adv_registry import register_adv_estimator
from rlhf_megatron.algorithms.grouping import group_ids, group_stats
from rlhf_megatron.algorithms.utils import check_ndim, check_values_and_mask, masked_whiten

__all__ = [
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_rloo_outcome_advantage",
]


def _scores(where: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Validate inputs and return the per-response score, (B,) in the rewards' dtype."""
    check_values_and_mask(where, {"token_level_rewards": token_level_rewards}, "response_mask", response_mask)
    check_ndim(where, "token_level_rewards", token_level_rewards, 2, "(B, T)")
    valid = response_mask != 0
    # Summing only valid tokens: a reward written onto padding must not count.
    return torch.where(valid, token_level_rewards, torch.zeros_like(token_level_rewards)).sum(-1)


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) float64 -> (B, T) in ``like``'s dtype, 0 at masked positions."""
    out = per_sample.to(like.dtype).unsqueeze(-1).expand_as(like)
    return torch.where(response_mask != 0, out, torch.zeros_like(like))


@register_adv_estimator("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): score standardised within its prompt group.

    ``(score - group_mean) / (group_std + epsilon)`` with the unbiased std, or
    ``score - group_mean`` when ``norm_adv_by_std_in_grpo`` is False (Dr. GRPO, Liu et
    al. 2025). A group where every score is equal gets exactly 0.

    Args:
        token_level_rewards: (B, T) floating.
        response_mask: (B, T).
        index: (B,) prompt id per response (numpy array, list or tensor; str or int ids).
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the group std.

    Returns:
        advantages: (B, T) the per-response advantage on every valid token.
        returns: (B, T) same tensor as advantages.
    """
    where = "compute_grpo_outcome_advantage"
    with torch.no_grad():
        scores = _scores(where, token_level_rewards, response_mask)  # (B,)
        inverse, counts = group_ids(index, token_level_rewards.shape, where)
        stats = group_stats(scores, inverse, len(counts))
        adv = scores.to(torch.float64) - stats.mean  # (B,)
        if norm_adv_by_std_in_grpo:
            adv = adv / (stats.std + epsilon)
        advantages = _broadcast(adv, response_mask, token_level_rewards)
    return advantages, advantages


@register_adv_estimator("grpo_passk")
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (Chen et al. 2025): only each group's best response is credited.

    The best response gets ``max - second_max`` (divided by ``group_std + epsilon`` when
    ``norm_adv_by_std_in_grpo``); every other response gets 0. Among tied best scores the
    first in batch order is credited (its advantage is 0 anyway). Every group needs at
    least two responses.

    Args:
        token_level_rewards: (B, T) floating.
        response_mask: (B, T).
        index: (B,) prompt id per response.
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the group std.

    Returns:
        advantages: (B, T)
        returns: (B, T) same tensor as advantages.
    """
    where = "compute_grpo_passk_outcome_advantage"
    with torch.no_grad():
        scores = _scores(where, token_level_rewards, response_mask)  # (B,)
        inverse, counts = group_ids(index, token_level_rewards.shape, where)
        if (counts < 2).any():
            raise ValueError(
                f"{where}: Pass@k needs at least 2 responses per group, but {int((counts < 2).sum())} "
                f"group(s) have 1; sample n >= 2 responses per prompt (actor_rollout_ref.rollout.n)"
            )
        stats = group_stats(scores, inverse, len(counts))
        s64 = scores.to(torch.float64).cpu()
        # Sort by score (descending, stable), then stably by group: each group's rows end up
        # contiguous with its best first, ties in batch order.
        by_score = torch.sort(-s64, stable=True).indices
        order = by_score[torch.sort(inverse[by_score], stable=True).indices]  # (B,)
        starts = torch.from_numpy(counts).cumsum(0) - torch.from_numpy(counts)  # (G,)
        best, second = order[starts], order[starts + 1]  # (G,) row numbers
        gap = s64[best] - s64[second]  # (G,)
        if norm_adv_by_std_in_grpo:
            gap = gap / (stats.std.cpu()[best] + epsilon)
        adv = torch.zeros_like(s64).index_put_((best,), gap)  # (B,)
        advantages = _broadcast(adv.to(scores.device), response_mask, token_level_rewards)
    return advantages, advantages


@register_adv_estimator("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): score minus the mean of the *other* responses in its group.

    For a group of n > 1: ``score * n/(n-1) - mean * n/(n-1)``, which equals
    ``score - mean(others)``. A group of one keeps its raw score.

    Args:
        token_level_rewards: (B, T) floating.
        response_mask: (B, T).
        index: (B,) prompt id per response.
        epsilon: unused; kept so every group estimator shares verl's signature.

    Returns:
        advantages: (B, T)
        returns: (B, T) same tensor as advantages.
    """
    where = "compute_rloo_outcome_advantage"
    del epsilon
    with torch.no_grad():
        scores = _scores(where, token_level_rewards, response_mask)  # (B,)
        inverse, counts = group_ids(index, token_level_rewards.shape, where)
        stats = group_stats(scores, inverse, len(counts))
        s64 = scores.to(torch.float64)
        n = stats.count
        scale = n / (n - 1).clamp(min=1)
        adv = torch.where(n > 1, s64 * scale - stats.mean * scale, s64)  # (B,)
        advantages = _broadcast(adv, response_mask, token_level_rewards)
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: subtract the group mean score, then whiten over the batch.

    ``score - group_mean`` (group of one: the raw score) is broadcast to every valid token
    and whitened with the batch's masked token statistics, as verl does; long responses
    therefore weigh more in the batch statistics.

    Args:
        token_level_rewards: (B, T) floating.
        response_mask: (B, T).
        index: (B,) prompt id per response.
        epsilon: unused; whitening uses a fixed 1e-8 under the square root, as in verl.

    Returns:
        advantages: (B, T)
        returns: (B, T) same tensor as advantages.
    """
    where = "compute_reinforce_plus_plus_baseline_outcome_advantage"
    del epsilon
    with torch.no_grad():
        scores = _scores(where, token_level_rewards, response_mask)  # (B,)
        inverse, counts = group_ids(index, token_level_rewards.shape, where)
        stats = group_stats(scores, inverse, len(counts))
        valid = response_mask != 0
        centred = (scores.to(torch.float64) - stats.mean).unsqueeze(-1).expand(valid.shape)  # (B, T)
        whitened = masked_whiten(centred, response_mask)  # float64: exact-ish batch statistics
        advantages = torch.where(valid, whitened, torch.zeros_like(whitened)).to(token_level_rewards.dtype)
    return advantages, advantages
