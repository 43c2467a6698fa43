"""DAPO's dynamic sampling (``algorithm.filter_groups``): train only on prompts whose responses disagree.

A group-relative estimator (GRPO and its family) gives a prompt whose ``rollout.n`` responses all
score alike a zero advantage: the prompt costs a generation and an update and teaches nothing.
``DynamicSampler`` scores each generation round, keeps the groups whose ``metric`` has a spread
(std > 0 over the group, verl's rule), and asks for another round while fewer than
``data.train_batch_size`` prompts are kept. The step then trains on the first
``train_batch_size`` kept groups in generation order (the surplus of the last round is dropped),
so the batch has the usual size and every mini-batch rule still holds.

Metrics: ``train/num_gen_batches`` (verl's name: the rounds this step), and under
``dynamic_sampling/``: ``kept_groups`` / ``dropped_groups`` (groups with and without a spread,
over all rounds), ``surplus_groups`` (kept but over the batch), ``generated_samples`` (responses
generated this step: what the step cost) and ``kept_ratio``. The reward function's own metrics
describe every response scored this step (counts summed, means weighted by rows, extremes kept).

Boundaries: pure logic over ``Batch`` and tensors; the trainer supplies the scoring and the rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from rlhf_megatron.data.batch import Batch

__all__ = [
    "DynamicSampler",
    "DynamicSamplingError",
    "filter_values",
    "groups_with_signal",
    "merge_round_metrics",
]

SUMMED_SUFFIXES = ("errors", "timeouts", "invalid", "retries", "too_long", "time_s")
"""Reward metrics that count events or time (the LLM judge's among them): summed over the rounds
of a step."""


class DynamicSamplingError(RuntimeError):
    """``max_num_gen_batches`` rounds did not yield ``train_batch_size`` prompts with a spread."""


def filter_values(
    metric: str, token_scores: torch.Tensor, extra: Mapping[str, Sequence[Any]], rows: int
) -> np.ndarray:
    """The per-response value whose spread decides (``algorithm.filter_groups.metric``).

    ``acc``/``score``: the reward function's own value of that name (a dict-returning scorer),
    else its score, which is what a plain-number scorer returns (verl's DAPO reward manager
    records a number score as ``acc`` the same way). ``seq_reward``/``seq_final_reward``: the
    row's summed token scores (``seq_final_reward`` is only allowed without the in-reward KL
    penalty, which makes the two equal; see ``FilterGroupsConfig``)."""
    summed = token_scores.sum(-1).double().numpy()
    if metric in ("acc", "score") and metric in extra:
        values = extra[metric]
        if all(v is not None for v in values):
            return np.asarray([float(v) for v in values], dtype=np.float64)
    if len(summed) != rows:
        raise ValueError(f"dynamic sampling: {len(summed)} scores for {rows} responses")
    return summed


def groups_with_signal(uids: Sequence[str], values: np.ndarray) -> tuple[list[str], list[str]]:
    """(kept, dropped) group uids in order of first appearance: kept where the group's values have
    a spread (population std > 0) or the group has one response (verl keeps those too)."""
    members: dict[str, list[float]] = {}
    for uid, value in zip(uids, values):
        members.setdefault(str(uid), []).append(float(value))
    kept, dropped = [], []
    for uid, vals in members.items():
        (kept if len(vals) == 1 or np.std(vals) > 0 else dropped).append(uid)
    return kept, dropped


def merge_round_metrics(rounds: Sequence[tuple[int, Mapping[str, float]]]) -> dict[str, float]:
    """One step's reward metrics from its rounds' ``(responses, metrics)``: counts and
    times (``SUMMED_SUFFIXES``) summed, ``*/max`` and ``*/min`` the extremes, the rest row-weighted means."""
    out: dict[str, float] = {}
    keys = dict.fromkeys(k for _, metrics in rounds for k in metrics)
    for key in keys:
        present = [(rows, float(m[key])) for rows, m in rounds if key in m]
        values = [v for _, v in present]
        if key.endswith(SUMMED_SUFFIXES):
            out[key] = float(sum(values))
        elif key.endswith("/max"):
            out[key] = max(values)
        elif key.endswith("/min"):
            out[key] = min(values)
        else:
            weight = sum(rows for rows, _ in present)
            out[key] = sum(rows * v for rows, v in present) / max(weight, 1)
    return out


class DynamicSampler:
    """Collects one step's kept groups over its generation rounds.

    ``score(batch) -> (token_level_scores [B, R], metrics, extra)``; ``more(round) -> Batch``
    generates round ``round`` (1, 2, ...)."""

    def __init__(self, metric: str, prompts_needed: int, max_rounds: int) -> None:
        self.metric, self.prompts_needed, self.max_rounds = str(metric), prompts_needed, max_rounds

    def collect(
        self,
        step: int,
        first: Batch,
        score: Callable[[Batch], tuple[torch.Tensor, dict[str, float], Mapping[str, Sequence[Any]]]],
        more: Callable[[int], Batch],
    ) -> tuple[Batch, dict[str, float]]:
        """The step's training batch (``token_level_scores`` set) and its metrics."""
        kept_parts: list[Batch] = []
        reward_rounds: list[tuple[int, dict[str, float]]] = []
        n_kept = n_dropped = generated = 0
        batch, rounds = first, 1
        while True:
            scores, metrics, extra = score(batch)
            batch["token_level_scores"] = scores
            reward_rounds.append((len(batch), metrics))
            generated += len(batch)
            uids = np.asarray(batch["uid"])
            kept, dropped = groups_with_signal(uids, filter_values(self.metric, scores, extra, len(batch)))
            n_kept, n_dropped = n_kept + len(kept), n_dropped + len(dropped)
            if kept:
                rows = np.flatnonzero(np.isin(uids, kept))
                kept_parts.append(batch[torch.as_tensor(rows)])
            if n_kept >= self.prompts_needed:
                break
            if self.max_rounds and rounds >= self.max_rounds:
                raise DynamicSamplingError(
                    f"step {step}: {rounds} generation rounds (algorithm.filter_groups.max_num_gen_batches="
                    f"{self.max_rounds}) kept {n_kept} prompts whose responses differ in "
                    f"{self.metric}, fewer than data.train_batch_size={self.prompts_needed} ({n_dropped} "
                    "groups scored alike). The data are too easy or too hard for the policy: raise "
                    "max_num_gen_batches (0: no limit), data.gen_batch_size or rollout.n, or change the data"
                )
            batch = more(rounds)
            rounds += 1
        joined = Batch.concat(kept_parts)
        group_order = list(dict.fromkeys(str(u) for u in joined["uid"]))
        chosen = set(group_order[: self.prompts_needed])
        rows = [i for i, u in enumerate(joined["uid"]) if str(u) in chosen]
        out = joined[torch.as_tensor(rows)] if len(rows) < len(joined) else joined
        metrics = merge_round_metrics(reward_rounds)
        metrics.update(
            {
                "train/num_gen_batches": float(rounds),
                "dynamic_sampling/kept_groups": float(n_kept),
                "dynamic_sampling/dropped_groups": float(n_dropped),
                "dynamic_sampling/surplus_groups": float(n_kept - len(chosen)),
                "dynamic_sampling/generated_samples": float(generated),
                "dynamic_sampling/kept_ratio": n_kept / max(n_kept + n_dropped, 1),
            }
        )
        return out, metrics
