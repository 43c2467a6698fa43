"""Rollout rejection sampling (verl's ``algorithm.rollout_correction.rollout_rs``), the threshold
grammar it and IcePop share, and the off-policy diagnostics.

Role: where importance weights re-weight tokens the rollout engine sampled off the actor's policy,
rejection drops them: a divergence between the two policies (``log_ratio = old - rollout``) is
measured per token or per sequence and every token over its threshold leaves ``response_mask``.
Options, comma-separated, must all pass:

    token_k1/k2/k3        per token: k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = e^log_ratio - 1 - log_ratio
    seq_sum_k1/k2/k3      the sum of the token values over the response
    seq_mean_k1/k2/k3     their mean
    seq_max_k2/k3         their maximum

k1 options keep ``log(lo) <= value <= log(hi)`` from a ``"lo_hi"`` threshold (a single ``u`` means
``1/u`` to ``u``); the others keep ``value <= threshold``. ``rollout_rs_threshold`` is one value for
every option or one per option, comma-separated.

The parsers are plain Python (no tensors), so config validation refuses a bad spec before any
process starts, with the same words the math would raise.

Boundaries: pure tensor math on the driver's whole batch; no torch.distributed.
"""

from __future__ import annotations

import math

import torch

from rlhf_megatron.algorithms.utils import masked_mean

__all__ = [
    "ROLLOUT_RS_OPTIONS",
    "compute_offpolicy_metrics",
    "compute_rollout_rejection_mask",
    "parse_rollout_is_threshold",
    "parse_rollout_rs",
]

ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    *("token_k1", "token_k2", "token_k3"),
    *("seq_sum_k1", "seq_sum_k2", "seq_sum_k3"),
    *("seq_mean_k1", "seq_mean_k2", "seq_mean_k3"),
    *("seq_max_k2", "seq_max_k3"),
)
LOG_RATIO_BOUND = 20.0  # as rollout_correction: exp stays finite in fp32
Bounds = tuple[float | None, float]  # (lower or None, upper)


def _number(text: str, key: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{key}: {what} {text!r} is not a number") from None


def parse_rollout_is_threshold(spec, key: str = "rollout_is_threshold") -> Bounds:
    """``2.0`` or ``"2.0"``: truncate weights at 2 (TIS), lower None. ``"0.5_2.0"``: IcePop, weights
    outside [0.5, 2.0] become 0. ValueError, naming ``key``, for anything else."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(
            f"{key}={spec!r} must be a number (TIS cap) or a 'lo_hi' string (IcePop), e.g. 2.0 or '0.5_2.0'"
        )
    text = str(spec).strip()
    lower = None
    if "_" in text:
        lo, hi = text.split("_", 1)
        lower, upper = _number(lo, key, "lower bound"), _number(hi, key, "upper bound")
    else:
        upper = _number(text, key, "threshold")
    if not upper > 0:
        raise ValueError(f"{key} must be > 0 (it caps each weight), got {spec!r}; e.g. 2.0 (verl's default)")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"{key}={spec!r}: IcePop's 'lo_hi' needs 0 < lo <= hi, e.g. '0.5_2.0'")
    return lower, upper


def parse_rollout_rs(
    rollout_rs: str, threshold_spec, key: str = "algorithm.rollout_correction"
) -> dict[str, Bounds]:
    """``rollout_rs`` ("token_k1,seq_mean_k3") and its ``rollout_rs_threshold`` -> {option: (lower,
    upper)} in option order, duplicates dropped; bounds in the option's own units (ratios for k1)."""
    options = list(dict.fromkeys(part.strip() for part in str(rollout_rs).split(",") if part.strip()))
    unknown = [opt for opt in options if opt not in ROLLOUT_RS_OPTIONS]
    if not options or unknown:
        raise ValueError(
            f"{key}.rollout_rs={rollout_rs!r}: unknown option(s) {', '.join(unknown) or '(none given)'}; "
            f"give a comma-separated list of: {', '.join(ROLLOUT_RS_OPTIONS)}"
        )
    tkey = f"{key}.rollout_rs_threshold"
    if threshold_spec is None or isinstance(threshold_spec, bool):
        raise ValueError(
            f"{tkey} is required with {key}.rollout_rs={rollout_rs!r} (e.g. '0.5_2.0' for a k1 option)"
        )
    specs = [part.strip() for part in str(threshold_spec).split(",") if part.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"{tkey}={threshold_spec!r} gives {len(specs)} thresholds for {len(options)} options "
            f"({', '.join(options)}); give one for all or one per option"
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    out: dict[str, Bounds] = {}
    for option, spec in zip(options, specs):
        where = f"{tkey} (for {option})"
        if option.endswith("k1"):
            if "_" in spec:
                lo, hi = spec.split("_", 1)
                lower, upper = _number(lo, where, "lower bound"), _number(hi, where, "upper bound")
            else:
                upper = _number(spec, where, "threshold")
                lower = 1.0 / upper if upper > 0 else -1.0
            if not (lower > 0 and upper > 0 and lower <= upper):
                raise ValueError(
                    f"{where}={spec!r}: k1 bounds are ratios, positive with lower <= upper (e.g. '0.5_2.0')"
                )
        else:
            if "_" in spec:
                raise ValueError(f"{where}={spec!r}: {option} takes one upper bound, not a 'lo_hi' pair")
            lower, upper = None, _number(spec, where, "threshold")
            if not upper > 0:
                raise ValueError(f"{where}={spec!r} must be > 0")
        out[option] = (lower, upper)
    return out


def _statistic(option: str, log_ratio: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The option's divergence, (B, T) for token options or (B, 1) for sequence ones."""
    kind = option.rsplit("_", 1)[1]
    if kind == "k1":
        token = -log_ratio
    elif kind == "k2":
        token = 0.5 * log_ratio.square()
    else:
        token = torch.exp(log_ratio) - 1.0 - log_ratio
    token = torch.where(valid, token, torch.zeros_like(token))  # (B, T)
    if option.startswith("token_"):
        return token
    if option.startswith("seq_sum_"):
        return token.sum(-1, keepdim=True)
    if option.startswith("seq_mean_"):
        return token.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
    # seq_max over valid tokens; a row without any gets 0
    filled = torch.where(valid, token, torch.full_like(token, float("-inf"))).amax(-1, keepdim=True)
    return torch.where(valid.any(-1, keepdim=True), filled, torch.zeros_like(filled))


def compute_rollout_rejection_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str,
    rollout_rs_threshold,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``response_mask`` with every token that fails one of the ``rollout_rs`` options set to 0.

    Args:
        old_log_probs, rollout_log_probs: (B, R) the actor's and the engine's log-probs.
        response_mask: (B, R).
        rollout_rs, rollout_rs_threshold: see the module docstring.

    Returns:
        mask: (B, R) in ``response_mask``'s dtype.
        metrics (unprefixed, as verl names them), per option ``rollout_rs_<opt>_mean``/``_max``/
        ``_min``/``_std`` (of the statistic over valid tokens, or over sequences for sequence options),
        ``_fraction_high``/``_fraction_low`` (share beyond each bound), ``_masked_fraction`` (share
        of valid tokens it rejects) and ``_seq_masked_fraction``; overall
        ``rollout_rs_masked_fraction`` and ``rollout_rs_seq_masked_fraction``.
    """
    bounds = parse_rollout_rs(rollout_rs, rollout_rs_threshold, key="compute_rollout_rejection_mask")
    with torch.no_grad():
        valid = response_mask != 0  # (B, R)
        seq_valid = valid.any(-1)  # (B,)
        zero = torch.zeros((), dtype=old_log_probs.dtype, device=old_log_probs.device)
        log_ratio = torch.where(valid, old_log_probs - rollout_log_probs, zero).clamp(
            -LOG_RATIO_BOUND, LOG_RATIO_BOUND
        )
        keep_all = valid.clone()
        metrics: dict[str, float] = {}
        for option, (lower, upper) in bounds.items():
            stat = _statistic(option, log_ratio, valid)  # (B, T) or (B, 1)
            lo, hi = (math.log(lower), math.log(upper)) if lower is not None else (None, upper)
            keep = stat <= hi if lo is None else (stat >= lo) & (stat <= hi)
            keep = keep.expand_as(valid)  # (B, R)
            keep_all &= keep
            unit = stat[valid] if option.startswith("token_") else stat.squeeze(-1)[seq_valid]
            name = f"rollout_rs_{option}"
            if unit.numel():
                metrics[f"{name}_mean"] = float(unit.double().mean())
                metrics[f"{name}_max"] = float(unit.max())
                metrics[f"{name}_min"] = float(unit.min())
                metrics[f"{name}_std"] = float(unit.double().std()) if unit.numel() > 1 else 0.0
                metrics[f"{name}_fraction_high"] = float((unit > hi).double().mean())
                metrics[f"{name}_fraction_low"] = (
                    float((unit < lo).double().mean()) if lo is not None else 0.0
                )
            rejected = valid & ~keep
            metrics[f"{name}_masked_fraction"] = _share(rejected, valid)
            metrics[f"{name}_seq_masked_fraction"] = _share(rejected.any(-1), seq_valid)
        rejected = valid & ~keep_all
        metrics["rollout_rs_masked_fraction"] = _share(rejected, valid)
        metrics["rollout_rs_seq_masked_fraction"] = _share(rejected.any(-1), seq_valid)
        mask = torch.where(keep_all, response_mask, torch.zeros_like(response_mask))
    return mask, metrics


def _share(flags: torch.Tensor, over: torch.Tensor) -> float:
    n = int(over.sum())
    return float((flags & over).sum()) / n if n else 0.0


def compute_offpolicy_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's policy is from the actor's, verl's names (unprefixed).

    Over responses with a valid token: ``training_ppl``/``rollout_ppl`` (batch mean of each
    response's ``exp(-mean log-prob)``), ``training_log_ppl``/``rollout_log_ppl``, ``log_ppl_diff``
    (mean of ``mean rollout lp - mean old lp``; > 0: the actor finds the samples less likely),
    ``log_ppl_abs_diff``, ``log_ppl_diff_max``/``_min``, ``ppl_ratio``; over valid tokens ``kl``
    (``rollout - old``, KL(rollout || actor)), ``k3_kl`` and ``chi2_token`` (``E[rho^2] - 1``, rho =
    pi_old / pi_rollout); per response ``chi2_seq`` (``E[(prod rho)^2] - 1``). ``{}`` with no valid token.
    """
    with torch.no_grad():
        valid = response_mask != 0
        rows = valid.any(-1)
        if not rows.any():
            return {}
        old = torch.where(valid, old_log_probs, torch.zeros_like(old_log_probs)).double()
        rollout = torch.where(valid, rollout_log_probs, torch.zeros_like(rollout_log_probs)).double()
        counts = valid.sum(-1).clamp(min=1)
        mean_old, mean_rollout = (old.sum(-1) / counts)[rows], (rollout.sum(-1) / counts)[rows]  # (B',)
        log_ratio = (old - rollout).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, R), 0 on padding
        diff = mean_rollout - mean_old
        seq_log_ratio = (old - rollout).sum(-1)[rows].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        mask = valid.double()
        return {
            "training_ppl": float(torch.exp(-mean_old).mean()),
            "training_log_ppl": float((-mean_old).mean()),
            "rollout_ppl": float(torch.exp(-mean_rollout).mean()),
            "rollout_log_ppl": float((-mean_rollout).mean()),
            "log_ppl_diff": float(diff.mean()),
            "log_ppl_abs_diff": float(diff.abs().mean()),
            "log_ppl_diff_max": float(diff.max()),
            "log_ppl_diff_min": float(diff.min()),
            "ppl_ratio": float(torch.exp(diff).mean()),
            "kl": float(masked_mean(rollout - old, mask)),
            "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
            "chi2_token": float(masked_mean(torch.exp(2 * log_ratio), mask) - 1),
            "chi2_seq": float(torch.exp(2 * seq_log_ratio).mean() - 1),
        }
