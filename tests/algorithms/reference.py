"""Plain-Python reference implementations, written independently of the package.

Each one loops over rows and time steps with Python floats, states the semantics as
directly as possible, and returns nested lists; tests compare the vectorised package
against them. They share no code with ``rlhf_megatron.algorithms``.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import torch


def ragged_mask(batch: int, steps: int, generator: torch.Generator, min_len: int = 0) -> torch.Tensor:
    """(B, T) float mask: each row has a random number of valid tokens, then padding."""
    lengths = torch.randint(min_len, steps + 1, (batch,), generator=generator)
    return (torch.arange(steps).unsqueeze(0) < lengths.unsqueeze(1)).float()


def holey_mask(batch: int, steps: int, generator: torch.Generator) -> torch.Tensor:
    """(B, T) mask with masked spans inside responses (multi-turn observation tokens)."""
    return (torch.rand(batch, steps, generator=generator) < 0.7).float()


def _whiten_valid(rows: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    """Whiten over valid entries (unbiased variance, +1e-8), 0 at masked entries."""
    valid = [x for row, mrow in zip(rows, mask) for x, m in zip(row, mrow) if m]
    mean = sum(valid) / len(valid)
    var = statistics.variance(valid) if len(valid) > 1 else 0.0
    scale = 1.0 / math.sqrt(var + 1e-8)
    return [[(x - mean) * scale if m else 0.0 for x, m in zip(row, mrow)] for row, mrow in zip(rows, mask)]


def gae(rewards, values, mask, gamma: float, lam: float):
    """verl's loop, one scalar at a time: masked steps carry nextvalue and lastgaelam."""
    raw, returns = [], []
    for r_row, v_row, m_row in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        next_value, last_gae = 0.0, 0.0
        adv_row = [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t]:
                delta = r_row[t] + gamma * next_value - v_row[t]
                last_gae = delta + gamma * lam * last_gae
                next_value = v_row[t]
            adv_row[t] = last_gae
        raw.append(adv_row)
        returns.append([a + v for a, v in zip(adv_row, v_row)])
    return _whiten_valid(raw, mask.tolist()), returns


def reinforce_pp(rewards, mask, gamma: float):
    """Return-to-go that restarts at masked positions (0 there), whitened over valid tokens."""
    returns = []
    for r_row, m_row in zip(rewards.tolist(), mask.tolist()):
        running, row = 0.0, [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            running = r_row[t] + gamma * running if m_row[t] else 0.0
            row[t] = running
        returns.append(row)
    return _whiten_valid(returns, mask.tolist()), returns


def remax(rewards, baselines, mask):
    advantages, returns = [], []
    for r_row, b, m_row in zip(rewards.tolist(), baselines.tolist(), mask.tolist()):
        row = [sum(r * m for r, m in zip(r_row[t:], m_row[t:])) for t in range(len(r_row))]
        returns.append(row)
        advantages.append([(g - b) if m else 0.0 for g, m in zip(row, m_row)])
    return advantages, returns


def _scores_by_group(rewards, mask, index):
    scores = [sum(r * m for r, m in zip(rr, mm)) for rr, mm in zip(rewards.tolist(), mask.tolist())]
    groups = defaultdict(list)
    for i, g in enumerate(index):
        groups[g].append(scores[i])
    return scores, groups


def _broadcast(per_sample, mask):
    return [[a if m else 0.0 for m in m_row] for a, m_row in zip(per_sample, mask.tolist())]


def grpo(rewards, mask, index, epsilon=1e-6, norm=True):
    scores, groups = _scores_by_group(rewards, mask, index)
    adv = []
    for i, g in enumerate(index):
        members = groups[g]
        mean, std = (statistics.mean(members), statistics.stdev(members)) if len(members) > 1 else (0.0, 1.0)
        adv.append((scores[i] - mean) / (std + epsilon) if norm else scores[i] - mean)
    return _broadcast(adv, mask)


def rloo(rewards, mask, index):
    scores, groups = _scores_by_group(rewards, mask, index)
    adv = []
    for i, g in enumerate(index):
        members = groups[g]
        n = len(members)
        adv.append(scores[i] - (sum(members) - scores[i]) / (n - 1) if n > 1 else scores[i])
    return _broadcast(adv, mask)


def reinforce_pp_baseline(rewards, mask, index):
    scores, groups = _scores_by_group(rewards, mask, index)
    centred = [
        scores[i] - (statistics.mean(groups[g]) if len(groups[g]) > 1 else 0.0) for i, g in enumerate(index)
    ]
    return _whiten_valid(_broadcast(centred, mask), mask.tolist())


def grpo_passk(rewards, mask, index, epsilon=1e-6, norm=True):
    scores, groups = _scores_by_group(rewards, mask, index)
    adv = [0.0] * len(scores)
    for g, members in groups.items():
        rows = [i for i, gi in enumerate(index) if gi == g]
        ranked = sorted(rows, key=lambda i: -scores[i])  # stable: first best in batch order
        gap = scores[ranked[0]] - scores[ranked[1]]
        adv[ranked[0]] = gap / (statistics.stdev(members) + epsilon) if norm else gap
    return _broadcast(adv, mask)


def agg(loss, mask, mode):
    rows, masks = loss.tolist(), mask.tolist()
    seq_sums = [sum(x for x, m in zip(r, mm) if m) for r, mm in zip(rows, masks)]
    seq_counts = [sum(1 for m in mm if m) for mm in masks]
    if mode == "token-mean":
        return sum(seq_sums) / max(sum(seq_counts), 1)
    if mode == "seq-mean-token-sum":
        return sum(seq_sums) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(s / c if c else 0.0 for s, c in zip(seq_sums, seq_counts)) / len(rows)
    if mode == "seq-mean-token-sum-norm":
        return sum(seq_sums) / len(rows) / len(masks[0])
    raise AssertionError(mode)


def ppo_token_losses(old, new, adv, clip_low, clip_high, clip_c):
    """Per-token vanilla PPO loss and flags, scalar by scalar."""
    losses, clipped, lower = [], [], []
    for o_row, n_row, a_row in zip(old.tolist(), new.tolist(), adv.tolist()):
        l_row, c_row, d_row = [], [], []
        for o, n, a in zip(o_row, n_row, a_row):
            ratio = math.exp(min(max(n - o, -20.0), 20.0))
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
            loss = max(l1, l2)
            dual = a < 0 and loss > -a * clip_c
            if dual:
                loss = -a * clip_c
            l_row.append(loss)
            c_row.append(1.0 if l2 > l1 else 0.0)
            d_row.append(1.0 if dual else 0.0)
        losses.append(l_row)
        clipped.append(c_row)
        lower.append(d_row)
    return losses, clipped, lower


def entropy(logits):
    out = []
    for row in logits.tolist():
        out_row = []
        for z in row:
            top = max(z)
            exps = [math.exp(x - top) for x in z]
            total = sum(exps)
            out_row.append(-sum(e / total * math.log(e / total) for e in exps if e > 0))
        out.append(out_row)
    return out
