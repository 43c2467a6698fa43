"""The reward model's pairwise loss (Bradley-Terry), as TRL's RewardTrainer and OpenRLHF compute it.

Role: a reward model scores a prompt + response at its last token; trained on preference pairs,
``P(chosen beats rejected) = sigmoid(r_chosen - r_rejected)`` and the loss is that probability's
negative log-likelihood. An optional per-pair ``margin`` (Llama 2's) asks the chosen score to lead
by at least that much before the loss flattens.

Boundaries: pure tensor math on one local micro-batch of scores. Reading the scores off the
model, and any rescaling for gradient accumulation or data parallelism, belong to the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_megatron.algorithms.utils import (
    check_floating,
    check_mask,
    check_ndim,
    check_same_dtype,
    check_same_shape,
)

__all__ = ["bradley_terry_loss"]


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean of ``-log sigmoid(chosen - rejected - margin)`` over the pairs, and its metrics.

    ``F.logsigmoid`` is the stable form: ``log(sigmoid(x))`` underflows to ``-inf`` for a very
    wrong pair (x << 0), where logsigmoid stays ``x``.

    Args:
        chosen: (B,) floating, the score of each pair's chosen sequence.
        rejected: (B,) same dtype, the score of its rejected sequence.
        margin: (B,) any real dtype (cast to chosen's), or None (0): how far chosen should lead
            rejected.

    Returns:
        loss: 0-dim, differentiable w.r.t. ``chosen`` and ``rejected``.
        metrics (detached 0-dim tensors):
            ``accuracy``: share of pairs with chosen > rejected (a tie counts as wrong);
            ``margin``: mean of chosen - rejected (the learned margin, not the one given).
    """
    where = "bradley_terry_loss"
    check_floating(where, "chosen", chosen)
    check_ndim(where, "chosen", chosen, 1, "(B,)")
    check_same_shape(where, "rejected", rejected, "chosen", chosen)
    check_same_dtype(where, "rejected", rejected, "chosen", chosen)
    if chosen.numel() == 0:
        raise ValueError(
            f"{where}: no pairs (chosen has shape {tuple(chosen.shape)}); a batch needs at least one"
        )
    if margin is not None:
        check_mask(where, "margin", margin, "chosen", chosen)  # any real dtype; cast below
    diff = chosen - rejected  # (B,)
    logits = diff if margin is None else diff - margin.to(diff.dtype)  # (B,)
    loss = -F.logsigmoid(logits).mean()  # ()
    detached = diff.detach()
    metrics = {
        "accuracy": (detached > 0).to(diff.dtype).mean(),
        "margin": detached.mean(),
    }
    return loss, metrics
