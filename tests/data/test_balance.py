"""Karmarkar-Karp partitioning: equal counts, every row once, and a far smaller token spread."""

import random

import pytest
import torch

from rlhf_megatron.data.balance import balance_batch, balance_partitions, partition_sums
from rlhf_megatron.data.batch import Batch


def spread(sums):
    return max(sums) / min(sums)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_partitions_beat_contiguous_split(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(16, 4096) for _ in range(512)]
    k = 8
    parts = balance_partitions(lengths, k)
    assert sorted(i for p in parts for i in p) == list(range(512))
    assert all(len(p) == 64 for p in parts)
    naive = [range(r * 64, (r + 1) * 64) for r in range(k)]
    balanced, contiguous = spread(partition_sums(lengths, parts)), spread(partition_sums(lengths, naive))
    assert balanced <= 1.001
    assert contiguous >= 1.05 and contiguous - 1 > 50 * (balanced - 1)


def test_sorted_lengths_worst_case_for_contiguous():
    lengths = list(range(1, 65))
    parts = balance_partitions(lengths, 4)
    assert spread(partition_sums(lengths, parts)) <= 1.05
    assert spread(partition_sums(lengths, [range(i * 16, (i + 1) * 16) for i in range(4)])) > 3


def test_unequal_sizes_allowed():
    lengths = [100, 1, 1, 1, 1, 96]
    parts = balance_partitions(lengths, 2, equal_size=False)
    assert sorted(partition_sums(lengths, parts)) == [100, 100]
    assert sorted(i for p in parts for i in p) == list(range(6))


def test_errors():
    with pytest.raises(ValueError, match=r"10 sequences cannot be split into 4 equal-size partitions"):
        balance_partitions([1] * 10, 4)
    with pytest.raises(ValueError, match="fewer than k=4"):
        balance_partitions([1, 2], 4, equal_size=False)


def test_balance_batch_reorders_rows_for_chunking():
    rng = random.Random(0)
    lengths = [rng.randint(1, 32) for _ in range(16)]
    mask = torch.zeros(16, 32, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    batch = Batch.from_dict({"attention_mask": mask}, {"uid": [f"u{i}" for i in range(16)]})
    balanced, metrics = balance_batch(batch, dp_size=4)
    assert sorted(balanced["uid"].tolist()) == sorted(batch["uid"].tolist())
    sums = [int(c["attention_mask"].sum()) for c in balanced.chunk(4)]
    assert max(sums) == metrics["balance/max_partition_tokens"]
    assert metrics["balance/max_over_min"] <= metrics["balance/max_over_min_contiguous"]
    assert metrics["balance/max_over_min"] == pytest.approx(max(sums) / min(sums))


def _grouped_batch(group_size=4, groups=8, prompt_width=6, response_width=10):
    """Rollout-shaped rows: ``groups`` prompts with ``group_size`` responses each (one uid per prompt)."""
    rng = random.Random(1)
    rows = groups * group_size
    mask = torch.zeros(rows, prompt_width + response_width, dtype=torch.long)
    for g in range(groups):
        prompt = rng.randint(1, prompt_width)
        for k in range(group_size):
            mask[
                g * group_size + k, prompt_width - prompt : prompt_width + rng.randint(1, response_width)
            ] = 1
    return Batch.from_dict(
        {"attention_mask": mask, "prompts": torch.zeros(rows, prompt_width, dtype=torch.long)},
        {"uid": [f"p{i // group_size}" for i in range(rows)], "row": list(range(rows))},
    )


def test_balance_batch_by_group_keeps_each_prompts_rows_together_and_contiguous():
    batch = _grouped_batch()
    balanced, metrics = balance_batch(batch, dp_size=2, group_by="uid")
    assert sorted(balanced["row"].tolist()) == list(range(len(batch)))
    uids = balanced["uid"].tolist()
    runs = [uids[i : i + 4] for i in range(0, len(uids), 4)]
    assert all(len(set(run)) == 1 for run in runs), "a group's rows stay contiguous"
    for chunk in balanced.chunk(2):  # every group on exactly one rank
        assert len(set(chunk["uid"].tolist())) == 4
    # a group costs its prompt once plus its responses (what packing computes)
    mask, prompt_width = batch["attention_mask"], 6
    costs = {}
    for row, uid in enumerate(batch["uid"].tolist()):
        prompt = int(mask[row, :prompt_width].sum())
        costs[uid] = costs.get(uid, prompt) + int(mask[row, prompt_width:].sum())
    sums = [sum(costs[u] for u in set(c["uid"].tolist())) for c in balanced.chunk(2)]
    assert max(sums) == metrics["balance/max_partition_tokens"]
    assert min(sums) == metrics["balance/min_partition_tokens"]


def test_balance_batch_by_group_falls_back_to_rows_when_groups_cannot_be_dealt_evenly():
    batch = _grouped_batch(groups=3)  # 3 groups over 2 ranks
    balanced, _ = balance_batch(batch, dp_size=2, group_by="uid")
    rows, _ = balance_batch(batch, dp_size=2)
    assert balanced["row"].tolist() == rows["row"].tolist()
    no_column, _ = balance_batch(batch, dp_size=2, group_by="missing")
    assert no_column["row"].tolist() == rows["row"].tolist()
