"""Benchmark the vectorised advantage estimators against verl-style reference loops.

    python tools/bench_algorithms.py [--batch 512 --steps 4096 --grpo-batch 65536 --group-size 16]

Prints one JSON object to stdout: seconds per call (best of ``--repeats``) for each
implementation, the speedup, and the largest difference between their outputs so a fast
but wrong result cannot pass unnoticed. Runs on CPU in well under two minutes.

The references are the straightforward implementations the package replaces:
* GAE: a loop over time with per-step tensor ops over the batch (verl's loop, including
  its carry-through of masked steps), then masked whitening.
* GRPO: a Python loop per sample building per-group lists, then per-group mean/std.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from rlhf_megatron.algorithms import compute_gae_advantage_return, compute_grpo_outcome_advantage


def reference_gae(rewards, values, mask, gamma, lam):
    """verl-style GAE: one iteration per time step, whole-batch tensor ops inside."""
    next_values = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    reversed_adv = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        candidate = delta + gamma * lam * last_gae
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last_gae = candidate * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    adv = torch.stack(reversed_adv[::-1], dim=1)
    returns = adv + values
    count = mask.sum()
    mean = (adv * mask).sum() / count
    var = (((adv - mean) ** 2) * mask).sum() / count * count / (count - 1)
    return (adv - mean) * torch.rsqrt(var + 1e-8) * mask, returns


def reference_grpo(rewards, mask, index, epsilon=1e-6):
    """verl-style GRPO: Python loop per sample to build groups and write results."""
    scores = (rewards * mask).sum(-1)
    groups = defaultdict(list)
    for i in range(scores.shape[0]):
        groups[index[i]].append(scores[i])
    mean, std = {}, {}
    for gid, members in groups.items():
        if len(members) == 1:
            mean[gid], std[gid] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(members)
            mean[gid], std[gid] = stacked.mean(), stacked.std()
    out = scores.clone()
    for i in range(scores.shape[0]):
        out[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + epsilon)
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def best_time(fn, repeats):
    """Best wall time of ``repeats`` calls after one warm-up call, and the last output."""
    out = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), out


def ragged_mask(batch, steps, generator, min_len=1):
    lengths = torch.randint(min_len, steps + 1, (batch,), generator=generator)
    return (torch.arange(steps).unsqueeze(0) < lengths.unsqueeze(1)).float()


def bench_gae(batch, steps, repeats, generator):
    rewards = torch.randn(batch, steps, generator=generator)
    values = torch.randn(batch, steps, generator=generator)
    mask = ragged_mask(batch, steps, generator)
    gamma, lam = 0.99, 0.95
    ref_best, ref_median, (ref_adv, ref_ret) = best_time(
        lambda: reference_gae(rewards, values, mask, gamma, lam), repeats
    )
    vec_best, vec_median, (adv, ret) = best_time(
        lambda: compute_gae_advantage_return(rewards, values, mask, gamma, lam), repeats
    )
    valid = mask.bool()
    return {
        "shape": [batch, steps],
        "reference_loop_s": round(ref_best, 4),
        "reference_loop_median_s": round(ref_median, 4),
        "vectorised_s": round(vec_best, 4),
        "vectorised_median_s": round(vec_median, 4),
        "speedup": round(ref_best / vec_best, 2),
        "max_abs_diff_advantages": float((adv - ref_adv)[valid].abs().max()),
        "max_abs_diff_returns": float((ret - ref_ret)[valid].abs().max()),
    }


def bench_grpo(batch, group_size, steps, repeats, generator):
    rewards = torch.zeros(batch, steps)
    mask = ragged_mask(batch, steps, generator)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(batch), last] = (torch.rand(batch, generator=generator) < 0.4).float()
    index = np.repeat(np.arange(batch // group_size), group_size).astype(str)  # uids are strings in verl
    start = time.perf_counter()
    ref_adv, _ = reference_grpo(rewards, mask, index)  # one run: it is the slow side
    ref_s = time.perf_counter() - start
    vec_best, vec_median, (adv, _) = best_time(
        lambda: compute_grpo_outcome_advantage(rewards, mask, index), repeats
    )
    return {
        "batch": batch,
        "group_size": group_size,
        "response_len": steps,
        "reference_loop_s": round(ref_s, 4),
        "vectorised_s": round(vec_best, 4),
        "vectorised_median_s": round(vec_median, 4),
        "speedup": round(ref_s / vec_best, 1),
        "max_abs_diff_advantages": float((adv - ref_adv).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=512, help="GAE batch size")
    parser.add_argument("--steps", type=int, default=4096, help="GAE response length")
    parser.add_argument("--grpo-batch", type=int, default=65536, help="GRPO number of responses")
    parser.add_argument("--group-size", type=int, default=16, help="GRPO responses per prompt")
    parser.add_argument("--grpo-steps", type=int, default=128, help="GRPO response length")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per implementation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(args.seed)
    total = time.perf_counter()
    with torch.no_grad():
        gae = bench_gae(args.batch, args.steps, args.repeats, generator)
        grpo = bench_grpo(args.grpo_batch, args.group_size, args.grpo_steps, args.repeats, generator)
    result = {
        "device": "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gae": gae,
        "grpo": grpo,
        "total_wall_s": round(time.perf_counter() - total, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
