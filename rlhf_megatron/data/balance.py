"""Sequence-length balancing across data-parallel ranks (Karmarkar–Karp largest differencing).

After rollout, responses have very different lengths. Splitting a batch contiguously over DP
ranks then gives some ranks far more tokens than others, and every step waits for the
slowest rank. `balance_partitions` assigns rows to ``k`` partitions so the token sums are
nearly equal; `balance_batch` reorders a `Batch` so that ``batch.chunk(dp_size)`` hands rank
``r`` partition ``r``.

Algorithm (largest differencing method, generalised to k-way partitions): every "state" is a
set of ``k`` partial partitions. Repeatedly take the two states with the largest spread
(max sum − min sum) and merge them, pairing the heaviest partition of one with the lightest
of the other, which cancels most of both spreads. With ``equal_size`` each initial state
holds ``k`` consecutive items of the length-sorted list, one per partition, so every
partition ends with exactly ``n / k`` items.

A row's cost is its token count, ``attention_mask.sum(-1)`` (`sequence_costs`). For a
vision-language row that already counts its images: the dataset expands each image's pad
into one ``<|image_pad|>`` per merged patch, so an image of ``t x h x w`` vision patches adds
``t * h * w / spatial_merge_size**2`` tokens to the mask (4 patches per token for
Qwen2.5-VL). The vision encoder's own work is proportional to the same patch count, so it is
weighted through those tokens rather than added separately.

Boundaries: pure functions of lengths and a `Batch`; no process groups.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from rlhf_megatron.data.batch import Batch

__all__ = ["balance_batch", "balance_partitions", "partition_sums", "sequence_costs"]

# A partial partition: [token sum, row indices].
_Part = list


def _spread(parts: list[_Part]) -> int:
    return parts[0][0] - parts[-1][0]  # parts are kept sorted by sum, heaviest first


def _merge(a: list[_Part], b: list[_Part]) -> list[_Part]:
    """Pair a's heaviest with b's lightest, and so on; both inputs are consumed."""
    merged = []
    for pa, pb in zip(a, reversed(b)):
        big, small = (pa[1], pb[1]) if len(pa[1]) >= len(pb[1]) else (pb[1], pa[1])
        big.extend(small)  # extend the longer list: keeps total copying O(n log n)
        merged.append([pa[0] + pb[0], big])
    merged.sort(key=lambda p: p[0], reverse=True)
    return merged


def balance_partitions(seqlens: Sequence[int], k: int, equal_size: bool = True) -> list[list[int]]:
    """Split row indices ``0..n-1`` into ``k`` partitions with nearly equal sums of ``seqlens``.

    With ``equal_size`` every partition gets ``n / k`` rows (``n`` must divide by ``k``).
    Returns ``k`` lists of indices, each sorted ascending, ordered by their first index.
    """
    n = len(seqlens)
    if k <= 0:
        raise ValueError(f"balance_partitions: k must be positive, got {k}.")
    if equal_size and n % k:
        raise ValueError(
            f"balance_partitions: {n} sequences cannot be split into {k} equal-size partitions "
            f"({n} % {k} = {n % k}); pad the batch to a multiple of {k} or pass equal_size=False."
        )
    if n < k:
        raise ValueError(f"balance_partitions: {n} sequences are fewer than k={k} partitions.")
    lengths = [int(s) for s in seqlens]
    order = sorted(range(n), key=lambda i: (lengths[i], i))

    heap: list[tuple[int, int, list[_Part]]] = []
    if equal_size:
        groups = [order[start : start + k] for start in range(0, n, k)]
        initial = [[[lengths[i], [i]] for i in group] for group in groups]
    else:
        initial = [[[lengths[i], [i]]] + [[0, []] for _ in range(k - 1)] for i in order]
    for counter, parts in enumerate(initial):
        parts.sort(key=lambda p: p[0], reverse=True)
        # heapq is a min-heap: negate the spread; the counter breaks ties deterministically.
        heapq.heappush(heap, (-_spread(parts), counter, parts))
    counter = len(initial)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = _merge(a, b)
        heapq.heappush(heap, (-_spread(merged), counter, merged))
        counter += 1
    partitions = [sorted(p[1]) for p in heap[0][2]]
    partitions.sort(key=lambda p: p[0] if p else n)
    return partitions


def partition_sums(seqlens: Sequence[int], partitions: Sequence[Sequence[int]]) -> list[int]:
    """Token sum of each partition."""
    return [int(sum(int(seqlens[i]) for i in part)) for part in partitions]


def _ratio(sums: Sequence[int]) -> float:
    return float(max(sums)) / min(sums) if min(sums) > 0 else float("inf")


def sequence_costs(batch: Batch) -> list[int]:
    """``[B]`` cost of each row: its prompt + response tokens, image tokens included (see the module docstring)."""
    if "attention_mask" not in batch.tensor_keys:
        raise KeyError(f"balance_batch: the batch has no 'attention_mask'; tensors are {batch.tensor_keys}.")
    return batch["attention_mask"].sum(-1).tolist()


def _group_rows(batch: Batch, key: str, dp_size: int) -> list[list[int]] | None:
    """Rows sharing a value of column ``key``, in order of their first row; None when there is no such
    column or the groups cannot be dealt out evenly (unequal sizes, or a count ``dp_size`` does not divide)."""
    if key not in batch.non_tensor_keys:
        return None
    groups: dict[object, list[int]] = {}
    for row, value in enumerate(batch[key].tolist()):
        groups.setdefault(value, []).append(row)
    rows = list(groups.values())
    if len({len(g) for g in rows}) != 1 or len(rows) % dp_size:
        return None
    return rows


def balance_batch(batch: Batch, dp_size: int, group_by: str | None = None) -> tuple[Batch, dict[str, float]]:
    """Reorder ``batch`` so that ``chunk(dp_size)`` gives each rank a near-equal token count.

    Costs are `sequence_costs` (prompt + response tokens, image tokens included). With
    ``group_by`` (a non-tensor column, e.g. the prompt ``uid``), the rows sharing a value move
    together and stay contiguous: whole groups are balanced, each costing its prompt once plus its
    responses, what shared-prompt packing (``data.packing``) computes. Groups of unequal size or
    a group count ``dp_size`` does not divide fall back to balancing rows. Returns the reordered
    batch and metrics comparing the token spread with a contiguous split of the input order.
    """
    seqlens = sequence_costs(batch)
    groups = _group_rows(batch, group_by, dp_size) if group_by else None
    if groups is None:
        groups = [[row] for row in range(len(batch))]
        costs = seqlens
    else:
        prompt = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1).tolist()
        costs = [prompt[g[0]] + sum(seqlens[r] - prompt[r] for r in g) for g in groups]
    partitions = balance_partitions(costs, dp_size, equal_size=True)
    per_rank = len(groups) // dp_size
    naive = [range(r * per_rank, (r + 1) * per_rank) for r in range(dp_size)]
    naive_sums, sums = partition_sums(costs, naive), partition_sums(costs, partitions)
    order = np.asarray([row for part in partitions for g in part for row in groups[g]], dtype=np.int64)
    metrics = {
        "balance/min_partition_tokens": float(min(sums)),
        "balance/max_partition_tokens": float(max(sums)),
        "balance/max_over_min": _ratio(sums),
        "balance/max_over_min_contiguous": _ratio(naive_sums),
    }
    return batch[order], metrics
