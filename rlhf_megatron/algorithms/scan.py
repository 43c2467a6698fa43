"""A reverse first-order linear recurrence, computed without a Python loop over every step.

Role: GAE, REINFORCE++ returns and the "next valid value" lookup in GAE are all the same
recurrence run backwards over the response::

    y[:, t] = inc[:, t] + decay[:, t] * y[:, t + 1],    y[:, T] = 0

This module solves it for a whole ``[B, T]`` batch. Boundaries: pure tensor code, no
knowledge of RL.

How: a two-level (chunked) scan. The time axis is cut into ``n`` chunks of ``k`` steps
with ``k ≈ n ≈ sqrt(T)``.

1. Inside every chunk at once, run the recurrence as if the chunk ended in 0, and keep
   the running product of ``decay`` (how much of the value entering from the right
   survives to each position). That is ``k`` steps, each over ``B * n`` elements.
2. Run the recurrence over chunk boundaries only: ``n`` steps over ``B`` elements.
3. Add each chunk's incoming value times the running product: one vectorised op.

So about ``2 * sqrt(T)`` small ops replace ``T`` steps of several ops each (~130 instead
of ~40,000 kernel launches for T=4096), and the work stays O(B * T). Unlike the closed
form ``sum_s prod(decay) * inc`` evaluated with cumulative products, nothing is divided
by a product of decays, so nothing overflows when those products underflow.
"""

from __future__ import annotations

import math

import torch

__all__ = ["reverse_linear_scan"]


def _chunk_sweep(inc: torch.Tensor, decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential sweep over dim 0 of time-major tensors.

    Args:
        inc, decay: (L, N) contiguous, time first so each step touches contiguous memory.

    Returns:
        y: (L, N) the recurrence with zero entering at the end.
        carry: (L, N) prod(decay[t:]), the weight of a value entering at the end.
    """
    y = torch.empty_like(inc)
    carry = torch.empty_like(decay)
    y[-1] = inc[-1]
    carry[-1] = decay[-1]
    for t in range(inc.shape[0] - 2, -1, -1):
        torch.addcmul(inc[t], decay[t], y[t + 1], out=y[t])
        torch.mul(decay[t], carry[t + 1], out=carry[t])
    return y, carry


def reverse_linear_scan(inc: torch.Tensor, decay: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Solve ``y[:, t] = inc[:, t] + decay[:, t] * y[:, t + 1]`` with ``y[:, T] = 0``.

    Args:
        inc: (B, T) floating.
        decay: (B, T) same dtype as ``inc``.
        chunk: steps per chunk; default ``ceil(sqrt(T))``. Exposed for tests.

    Returns:
        y: (B, T), same dtype as ``inc``.
    """
    if inc.shape != decay.shape or inc.dim() != 2:
        raise ValueError(
            f"reverse_linear_scan: inc has shape {tuple(inc.shape)} and decay has shape "
            f"{tuple(decay.shape)}; both must be the same 2-D shape (B, T)"
        )
    batch, steps = inc.shape
    if steps == 0 or batch == 0:
        return torch.zeros_like(inc)
    k = chunk or max(1, math.isqrt(steps - 1) + 1)  # ceil(sqrt(T))
    n = -(-steps // k)  # number of chunks, ceil(T / k)
    pad = n * k - steps
    if pad:
        # Padded steps contribute nothing (inc = 0) so y at real steps is unchanged.
        inc = torch.nn.functional.pad(inc, (0, pad), value=0.0)
        decay = torch.nn.functional.pad(decay, (0, pad), value=0.0)

    # (B, n*k) -> (k, B*n): chunk-local time first, then every (row, chunk) pair.
    inc_tm = inc.reshape(batch, n, k).permute(2, 0, 1).reshape(k, batch * n).contiguous()
    dec_tm = decay.reshape(batch, n, k).permute(2, 0, 1).reshape(k, batch * n).contiguous()
    local, carry = _chunk_sweep(inc_tm, dec_tm)  # (k, B*n) each

    # Level 2: the value entering each chunk from its right neighbour.
    chunk_inc = local[0].reshape(batch, n).t().contiguous()  # (n, B): y at chunk start, zero entering
    chunk_dec = carry[0].reshape(batch, n).t().contiguous()  # (n, B)
    entering = torch.zeros(n, batch, dtype=inc.dtype, device=inc.device)  # (n, B)
    for c in range(n - 2, -1, -1):
        # y at the start of chunk c+1 is what enters chunk c.
        torch.addcmul(chunk_inc[c + 1], chunk_dec[c + 1], entering[c + 1], out=entering[c])

    # Level 3: y = local + carry * entering, broadcast over the chunk's steps.
    entering_tm = entering.t().reshape(1, batch * n)  # (1, B*n)
    y_tm = torch.addcmul(local, carry, entering_tm)  # (k, B*n)
    y = y_tm.reshape(k, batch, n).permute(1, 2, 0).reshape(batch, n * k)
    return y[:, :steps]
