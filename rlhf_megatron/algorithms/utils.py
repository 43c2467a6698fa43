"""Masked reductions and input checks shared by every algorithm module.

Role: the small vocabulary the estimators and losses are written in (``masked_mean``,
``masked_var``, ``masked_whiten``) plus the validators that turn a shape, dtype or mask
mismatch into a ``ValueError`` that names both tensors and both shapes.

Boundaries: pure tensor code. No torch.distributed: every reduction here is over the
local tensor, so a caller that wants a global (DP-wide) statistic must reduce itself.

Masks are 0/1 tensors (bool, integer or floating). Masked positions may hold anything,
NaN included: reductions select with ``torch.where`` rather than multiplying, because
``NaN * 0`` is NaN and padding garbage must never leak into a valid result.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_floating",
    "check_mask",
    "check_ndim",
    "check_same_dtype",
    "check_same_shape",
    "check_values_and_mask",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_same_shape(where: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise ValueError unless ``a`` and ``b`` have the same shape; the message names both."""
    if a.shape != b.shape:
        raise ValueError(
            f"{where}: {name_a} has shape {_shape(a)} but {name_b} has shape {_shape(b)}; "
            f"they must match. Check that both come from the same batch and are padded to the "
            f"same response length."
        )


def check_floating(where: str, name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless ``t`` is a floating-point tensor."""
    if not torch.is_tensor(t):
        raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(
            f"{where}: {name} (shape {_shape(t)}) must be floating point, got {t.dtype}; "
            f"cast it with .float() first."
        )


def check_same_dtype(where: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise ValueError unless ``a`` and ``b`` share a dtype; silent promotion hides precision bugs."""
    if a.dtype != b.dtype:
        raise ValueError(
            f"{where}: {name_a} (shape {_shape(a)}, {a.dtype}) and {name_b} (shape {_shape(b)}, "
            f"{b.dtype}) must have the same dtype; cast one of them explicitly."
        )


def check_ndim(where: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    """Raise ValueError unless ``t`` has ``ndim`` dims; ``layout`` names them, e.g. ``"(B, T)"``."""
    if t.dim() != ndim:
        raise ValueError(f"{where}: {name} must have shape {layout}, got shape {_shape(t)}")


def check_mask(where: str, mask_name: str, mask: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """Raise ValueError unless ``mask`` is a tensor shaped like ``like``."""
    if not torch.is_tensor(mask):
        raise ValueError(f"{where}: {mask_name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise ValueError(f"{where}: {mask_name} must be bool, integer or real floating, got {mask.dtype}")
    check_same_shape(where, mask_name, mask, like_name, like)


def check_values_and_mask(
    where: str, named: dict[str, torch.Tensor], mask_name: str, mask: torch.Tensor
) -> None:
    """Check a family of same-shaped floating tensors and their mask in one call.

    Every tensor in ``named`` must be floating, share the first one's dtype and shape, and
    ``mask`` must have that shape too.
    """
    items = list(named.items())
    first_name, first = items[0]
    check_floating(where, first_name, first)
    for name, t in items[1:]:
        check_floating(where, name, t)
        check_same_shape(where, name, t, first_name, first)
        check_same_dtype(where, name, t, first_name, first)
    check_mask(where, mask_name, mask, first_name, first)


def _as_valid(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (x with masked entries set to 0, mask as x's dtype)."""
    m = mask.to(x.dtype)
    return torch.where(mask != 0, x * m, torch.zeros((), dtype=x.dtype, device=x.device)), m


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over entries where ``mask`` is non-zero.

    Args:
        x: any shape, floating.  # (...)
        mask: same shape as ``x``.  # (...)
        dim: reduce over this dim; ``None`` reduces everything to a scalar.
    """
    check_mask("masked_sum", "mask", mask, "x", x)
    xm, _ = _as_valid(x, mask)
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is non-zero.

    An empty selection (all masked, or an all-masked row when ``dim`` is given) yields 0,
    not NaN, so a padding-only row cannot poison a batch statistic.

    Args:
        x: any shape, floating.  # (...)
        mask: same shape as ``x``.  # (...)
        dim: reduce over this dim; ``None`` reduces everything to a scalar.

    Returns:
        scalar if ``dim`` is None, else ``x`` with ``dim`` removed.
    """
    check_mask("masked_mean", "mask", mask, "x", x)
    xm, m = _as_valid(x, mask)
    if dim is None:
        total, count = xm.sum(), m.sum()
    else:
        total, count = xm.sum(dim=dim), m.sum(dim=dim)
    # Divide by 1 where empty: the numerator is already 0 there.
    return total / torch.where(count != 0, count, torch.ones_like(count))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all entries where ``mask`` is non-zero, as a scalar.

    With ``unbiased`` the Bessel factor n/(n-1) is applied. Fewer than two valid entries
    give 0 (verl raises instead); a whitening caller then maps the lone entry to 0, which
    is the only sensible centred value, and a training step does not crash on a batch
    that happens to hold a single token.

    Args:
        x: any shape, floating.  # (...)
        mask: same shape as ``x``.  # (...)

    Returns:
        0-dim tensor.  # ()
    """
    check_mask("masked_var", "mask", mask, "x", x)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    if unbiased:
        count = mask.to(x.dtype).sum()
        bessel = count / torch.where(count > 1, count - 1, torch.ones_like(count))
        var = torch.where(count > 1, var * bessel, torch.zeros_like(var))
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance using statistics of the masked entries.

    ``(x - mean) * rsqrt(var + 1e-8)`` with the unbiased masked variance; with
    ``shift_mean=False`` the mean is added back (scale only). Masked entries are
    transformed too but carry no meaning: multiply by the mask if they must be 0.

    Args:
        x: any shape, floating.  # (...)
        mask: same shape as ``x``.  # (...)

    Returns:
        same shape as ``x``.  # (...)
    """
    check_mask("masked_whiten", "mask", mask, "x", x)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
