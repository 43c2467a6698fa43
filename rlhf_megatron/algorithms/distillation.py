"""On-policy distillation losses: the student's sampled tokens scored against a teacher's log-probs.

Role: the math behind ``distillation.distillation_loss`` (verl's keys). The student samples, a
teacher scores every sampled token, and the per-token divergence between the two becomes either

- a per-token reward through the PPO surrogate (``use_policy_gradient``, the Thinking Machines
  on-policy distillation recipe): advantage ``-clamp(d_t)``, detached, so the policy gradient
  carries it (with ``k1``, ``d_t = log p_student - log p_teacher``: the reverse KL's own
  per-sample estimate, whose policy-gradient is the reverse KL's gradient); or
- a loss backpropagated directly (``use_policy_gradient=false``, as in GKD, arXiv:2306.13649):
  the estimator's own gradient through the student's log-probs (``k3`` or the teacher's top-k
  forward KL; ``k1``'s direct gradient is ``grad log p_student``, which does not depend on the
  teacher, so that pairing is refused by the config).

Loss modes (``DISTILLATION_LOSS_MODES``): the KL estimators of ``algorithms.kl`` over the sampled
token (``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``) with the teacher as the
reference, and ``forward_kl_topk``: ``sum_k p_T(k) (log p_T(k) - log p_S(k))`` over the teacher's
top-k tokens at each position (negative parts, possible because neither side sums to 1 over the
top-k, are clamped to 0).

Boundaries: pure tensor math, as the rest of ``algorithms/``; the actor worker gathers the
student's log-probs (also at the teacher's top-k ids) and calls ``compute_distillation_loss``.
"""

from __future__ import annotations

import torch

from rlhf_megatron.algorithms.kl import kl_penalty
from rlhf_megatron.algorithms.losses import agg_loss
from rlhf_megatron.algorithms.policy_losses import compute_policy_loss
from rlhf_megatron.algorithms.utils import check_mask, check_same_shape, masked_mean

__all__ = [
    "DISTILLATION_ESTIMATORS",
    "DISTILLATION_LOSS_MODES",
    "compute_distillation_loss",
    "distillation_token_losses",
]

DISTILLATION_ESTIMATORS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""Single-sample estimators over the sampled token (``algorithms.kl.kl_penalty``'s names)."""

DISTILLATION_LOSS_MODES: tuple[str, ...] = (*DISTILLATION_ESTIMATORS, "forward_kl_topk")


def _clamp_min(t: torch.Tensor, low: float | None) -> torch.Tensor:
    return t if low is None else t.clamp_min(low)


def distillation_token_losses(
    loss_mode: str,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    *,
    log_prob_min_clamp: float | None = -10.0,
    student_topk_log_probs: torch.Tensor | None = None,
    teacher_topk_log_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token distillation loss ``d_t``, before ``loss_max_clamp``.

    Both sides' log-probs are first clamped from below at ``log_prob_min_clamp`` (a token either
    model finds nearly impossible would otherwise dominate; a clamped student log-prob passes no
    gradient). Estimators: ``kl_penalty(student, teacher, loss_mode)``, e.g. ``k1 = s - t`` and
    ``k3 = exp(t - s) - (t - s) - 1``. ``forward_kl_topk``:
    ``max(0, sum_k exp(t_k) (t_k - s_k))`` over the teacher's top-k ids.

    Args:
        loss_mode: one of ``DISTILLATION_LOSS_MODES``.
        student_log_probs: (B, T) the student's log-prob of each sampled token (with grad).
        teacher_log_probs: (B, T) the teacher's log-prob of the same tokens.
        log_prob_min_clamp: lower bound of every log-prob; None: no clamp.
        student_topk_log_probs: (B, T, K) the student's log-probs at the teacher's top-k ids
            (``forward_kl_topk`` only).
        teacher_topk_log_probs: (B, T, K) the teacher's top-k log-probs (``forward_kl_topk`` only).

    Returns:
        (B, T) per-token losses (keeps the graph through the student's log-probs).
    """
    where = "distillation_token_losses"
    if loss_mode not in DISTILLATION_LOSS_MODES:
        raise ValueError(
            f"{where}: unknown distillation.distillation_loss.loss_mode {loss_mode!r}; "
            f"choose one of {', '.join(DISTILLATION_LOSS_MODES)}"
        )
    check_same_shape(where, "student_log_probs", student_log_probs, "teacher_log_probs", teacher_log_probs)
    if loss_mode != "forward_kl_topk":
        s = _clamp_min(student_log_probs, log_prob_min_clamp)
        t = _clamp_min(teacher_log_probs.to(s.dtype), log_prob_min_clamp)
        return kl_penalty(s, t, loss_mode)
    if student_topk_log_probs is None or teacher_topk_log_probs is None:
        raise ValueError(
            f"{where}: loss_mode=forward_kl_topk needs the (B, T, K) student_topk_log_probs and "
            "teacher_topk_log_probs (the teacher scored without top-k: set distillation.distillation_loss.topk)"
        )
    check_same_shape(
        where,
        "student_topk_log_probs",
        student_topk_log_probs,
        "teacher_topk_log_probs",
        teacher_topk_log_probs,
    )
    if student_topk_log_probs.shape[:2] != student_log_probs.shape:
        raise ValueError(
            f"{where}: top-k log-probs have shape {tuple(student_topk_log_probs.shape)}; their (B, T) "
            f"must be the sampled tokens' {tuple(student_log_probs.shape)}"
        )
    s_k = _clamp_min(student_topk_log_probs, log_prob_min_clamp)  # (B, T, K)
    t_k = _clamp_min(teacher_topk_log_probs.to(s_k.dtype), log_prob_min_clamp)  # (B, T, K)
    return (t_k.exp() * (t_k - s_k)).sum(-1).clamp_min(0.0)  # (B, T)


def compute_distillation_loss(
    loss_mode: str,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    use_policy_gradient: bool = True,
    loss_max_clamp: float | None = 10.0,
    log_prob_min_clamp: float | None = -10.0,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    student_topk_log_probs: torch.Tensor | None = None,
    teacher_topk_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The distillation loss of a micro-batch and its metrics.

    ``d = clamp(distillation_token_losses(...), -loss_max_clamp, loss_max_clamp)``. With
    ``use_policy_gradient``: vanilla PPO's clipped surrogate with advantages ``-d`` (detached)
    against ``old_log_prob``, clipped by ``clip_ratio*``; otherwise ``agg_loss(d)``.

    Args:
        loss_mode: see ``distillation_token_losses``.
        log_prob: (B, T) the student's current log-probs of the sampled tokens (with grad).
        old_log_prob: (B, T) the student's log-probs when the tokens were sampled.
        teacher_log_prob: (B, T) the teacher's log-probs of the same tokens.
        response_mask: (B, T) 1 on response tokens that count.
        loss_agg_mode: see ``agg_loss``.
        use_policy_gradient, loss_max_clamp, log_prob_min_clamp, clip_ratio*: verl's
            ``distillation.distillation_loss`` keys; None disables a clamp.
        student_topk_log_probs, teacher_topk_log_probs: (B, T, K), ``forward_kl_topk`` only.
        rollout_is_weights: (B, T) optional per-token weights of the surrogate (rollout correction).

    Returns:
        loss: () scalar.
        metrics: () tensors, named without a prefix: ``loss``, ``reverse_kl`` (masked mean of
        ``log p_student - log p_teacher``, unclamped), ``student_log_prob_mean``,
        ``teacher_log_prob_mean``, ``clamped_frac`` (share of tokens ``loss_max_clamp`` cut),
        ``log_prob_clamped_frac`` (share of tokens whose student or teacher log-prob
        ``log_prob_min_clamp`` raised) and, with the policy gradient, ``pg_clipfrac``.
    """
    where = "compute_distillation_loss"
    check_mask(where, "response_mask", response_mask, "log_prob", log_prob)
    check_same_shape(where, "log_prob", log_prob, "old_log_prob", old_log_prob)
    losses = distillation_token_losses(
        loss_mode,
        log_prob,
        teacher_log_prob,
        log_prob_min_clamp=log_prob_min_clamp,
        student_topk_log_probs=student_topk_log_probs,
        teacher_topk_log_probs=teacher_topk_log_probs,
    )  # (B, T)
    mask = response_mask.to(log_prob.dtype)
    with torch.no_grad():
        teacher = teacher_log_prob.to(log_prob.dtype)
        metrics = {
            "reverse_kl": masked_mean(log_prob.detach() - teacher, mask),
            "student_log_prob_mean": masked_mean(log_prob.detach(), mask),
            "teacher_log_prob_mean": masked_mean(teacher, mask),
        }
        if loss_max_clamp is not None:
            metrics["clamped_frac"] = masked_mean((losses.abs() > loss_max_clamp).to(mask.dtype), mask)
        else:
            metrics["clamped_frac"] = torch.zeros((), dtype=mask.dtype)
        if log_prob_min_clamp is not None:
            low = (log_prob.detach() < log_prob_min_clamp) | (teacher < log_prob_min_clamp)
            metrics["log_prob_clamped_frac"] = masked_mean(low.to(mask.dtype), mask)
    if loss_max_clamp is not None:
        # Both sides: k1 is negative where the student is less sure than the teacher.
        losses = losses.clamp(-loss_max_clamp, loss_max_clamp)
    if use_policy_gradient:
        loss, clipfrac, _, _ = compute_policy_loss(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=-losses.detach(),
            response_mask=response_mask,
            cliprange=clip_ratio,
            cliprange_low=clip_ratio_low,
            cliprange_high=clip_ratio_high,
            loss_agg_mode=loss_agg_mode,
            rollout_is_weights=rollout_is_weights,
        )
        metrics["pg_clipfrac"] = clipfrac.detach()
    else:
        loss = agg_loss(losses, response_mask, loss_agg_mode)
    metrics["loss"] = loss.detach()
    return loss, metrics
