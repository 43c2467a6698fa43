"""Group-relative outcome estimators: GRPO, Dr. GRPO, Pass@k GRPO, RLOO, REINFORCE++-baseline,
OPO and GPG (``grpo_vectorized``/``rloo_vectorized``: verl's names for the same GRPO/RLOO math).

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
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_opo_outcome_advantage",
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


@register_adv_estimator("grpo_vectorized")  # verl's name for its vectorised GRPO: same math
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


@register_adv_estimator("rloo_vectorized")  # verl's name for its vectorised RLOO: same math
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


@register_adv_estimator("opo")
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, arXiv:2505.23585): the optimal baseline for on-policy sequences.

    ``score - b`` with ``b = sum_j len_j * score_j / sum_j len_j`` over the prompt's group
    (``len`` the response's valid-token count): the length-weighted mean score, which minimises
    the gradient's variance when every token carries the sequence's advantage. A group of one
    gets ``b = 0``. No std normalisation.

    Args:
        token_level_rewards: (B, T) floating.
        response_mask: (B, T).
        index: (B,) prompt id per response.
        epsilon: unused; kept so every group estimator shares verl's signature.

    Returns:
        advantages: (B, T)
        returns: (B, T) same tensor as advantages.
    """
    where = "compute_opo_outcome_advantage"
    del epsilon
    with torch.no_grad():
        scores = _scores(where, token_level_rewards, response_mask).to(torch.float64)  # (B,)
        inverse, counts = group_ids(index, token_level_rewards.shape, where)
        inv = inverse.to(scores.device)
        lengths = (response_mask != 0).sum(-1).to(torch.float64)  # (B,)
        groups = torch.zeros(len(counts), dtype=torch.float64, device=scores.device)
        weighted = groups.index_add(0, inv, lengths * scores)[inv]  # (B,) group's sum of len * score
        total_len = groups.index_add(0, inv, lengths)[inv]  # (B,)
        size = groups.index_add(0, inv, torch.ones_like(scores))[inv]
        baseline = torch.where(size > 1, weighted / total_len.clamp(min=1), torch.zeros_like(scores))
        advantages = _broadcast(scores - baseline, response_mask, token_level_rewards)
    return advantages, advantages


@register_adv_estimator("gpg")
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, arXiv:2504.02546): group-centred score, rescaled for empty groups.

    ``alpha * (score - group_mean) / f_norm`` with ``alpha = B / max(1, #responses whose score
    is non-zero)`` over the whole batch: the gradient a batch with many zero-reward responses
    would lose is scaled back up. A group of one keeps its raw score (times ``alpha``). Pair it
    with ``actor.policy_loss.loss_mode=gpg``.

    Args:
        token_level_rewards: (B, T) floating.
        response_mask: (B, T).
        index: (B,) prompt id per response.
        epsilon: unused; kept so every group estimator shares verl's signature.
        f_norm: divisor of the advantage (verl's default 1).

    Returns:
        advantages: (B, T)
        returns: (B, T) same tensor as advantages.
    """
    where = "compute_gpg_outcome_advantage"
    del epsilon
    with torch.no_grad():
        scores = _scores(where, token_level_rewards, response_mask)  # (B,)
        inverse, counts = group_ids(index, token_level_rewards.shape, where)
        stats = group_stats(scores, inverse, len(counts))
        alpha = scores.numel() / max(1, int(torch.count_nonzero(scores)))
        adv = alpha * (scores.to(torch.float64) - stats.mean) / f_norm  # (B,)
        advantages = _broadcast(adv, response_mask, token_level_rewards)
    return advantages, advantages
