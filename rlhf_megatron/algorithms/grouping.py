"""Group ids and per-group score statistics for the outcome-reward estimators.

Role: GRPO, RLOO, REINFORCE++-baseline and Pass@k all compare a response's score with the
other responses to the same prompt. The trainer tags every response with a prompt id
(``index``, one per row: str, int or any hashable). This module maps those ids to dense
group numbers and computes per-group mean / std with scatter-adds, so a batch of 65k
responses costs a handful of vectorised ops instead of a Python loop per sample.

Boundaries: pure numpy/torch; groups are local to the batch it is given (a group split
across DP ranks would need its statistics reduced by the caller; the driver computes
advantages on the full batch, so it never is).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["GroupStats", "group_ids", "group_stats"]


def group_ids(index, rewards_shape: tuple[int, ...], where: str) -> tuple[torch.Tensor, np.ndarray]:
    """Map per-sample group ids to dense group numbers.

    Args:
        index: (B,) ids; numpy array, list, tuple or tensor of any hashable type.
        rewards_shape: shape of the (B, T) rewards ``index`` labels, for the length check
            and its error message.
        where: caller name for error messages.

    Returns:
        inverse: (B,) int64 tensor, group number of each sample, in ``[0, G)``.
        counts: (G,) numpy int64, samples per group.
    """
    if torch.is_tensor(index):
        index = index.detach().cpu().numpy()
    arr = np.asarray(index)
    batch_size = rewards_shape[0]
    if arr.ndim != 1 or arr.shape[0] != batch_size:
        raise ValueError(
            f"{where}: index has shape {tuple(arr.shape)} but token_level_rewards has shape "
            f"{tuple(rewards_shape)}; index must be 1-D with one group id per row, shape ({batch_size},)"
        )
    try:
        # Sort-based and vectorised; works for numeric and uniform string ids.
        _, inverse, counts = np.unique(arr, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
    except TypeError:
        # Object arrays mixing unorderable types (e.g. str and int ids): fall back to a
        # dict over the ids, which only needs them hashable.
        lookup: dict = {}
        inverse = np.fromiter((lookup.setdefault(i, len(lookup)) for i in arr.tolist()), np.int64, len(arr))
        counts = np.bincount(inverse, minlength=len(lookup))
    return torch.from_numpy(inverse.astype(np.int64)), counts.astype(np.int64)


@dataclass
class GroupStats:
    """Per-sample view of its group's statistics, all float64 of shape (B,).

    ``mean``/``std`` follow verl's convention: a group of size 1 gets mean 0 and std 1, so
    its lone score passes through unchanged. ``std`` is the unbiased sample std.
    """

    count: torch.Tensor  # (B,) group size of each sample's group
    mean: torch.Tensor  # (B,)
    std: torch.Tensor  # (B,)


def group_stats(scores: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> GroupStats:
    """Mean and unbiased std of ``scores`` per group, gathered back to samples.

    Statistics are taken in float64: the group mean of identical float32 scores is then
    exact, so a zero-variance group yields an advantage of exactly 0 instead of
    rounding noise divided by epsilon.

    Args:
        scores: (B,) floating.
        inverse: (B,) int64 group number per sample.
        num_groups: G.
    """
    s = scores.detach().to(torch.float64)
    inv = inverse.to(s.device)
    counts = torch.zeros(num_groups, dtype=torch.float64, device=s.device).index_add_(
        0, inv, torch.ones_like(s)
    )
    sums = torch.zeros_like(counts).index_add_(0, inv, s)
    mean = sums / counts  # every group has >= 1 member by construction
    sq = torch.zeros_like(counts).index_add_(0, inv, (s - mean[inv]).square())  # two-pass: stable
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    count_i = counts[inv]
    single = count_i == 1
    return GroupStats(
        count=count_i,
        mean=torch.where(single, torch.zeros_like(s), mean[inv]),
        std=torch.where(single, torch.ones_like(s), std[inv]),
    )
