"""Reductions over the response tokens selected by a 0/1 mask.

Positions outside the mask are replaced by zero with ``torch.where`` rather than multiplied by
zero, so garbage there (NaN or inf in padding) neither leaks into the result nor into the
gradient.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is nonzero; over all dims when ``dim`` is None."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over masked positions; an empty selection gives 0 rather than NaN."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of ``x`` over masked positions (over all dims), as verl's ``masked_var``.

    The population variance over the ``n`` masked positions is scaled by Bessel's ``n / (n - 1)``.
    verl raises when ``n < 2``; here fewer than two positions give a variance of 0, so a batch
    with a single response token whitens to zeros instead of crashing a training step.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    n = mask.bool().sum()
    return torch.where(n > 1, var * n / (n - 1).clamp_min(1), torch.zeros_like(var))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with mean and unbiased var over the masked positions.

    This is verl's ``masked_whiten``: the statistics are pooled over every masked token of the
    batch (not per sequence), the variance is Bessel-corrected (see ``masked_var``) and ``1e-8``
    is added inside the square root. With ``shift_mean=False`` the mean is added back. The
    result is computed at every position; positions outside the mask hold garbage-derived
    values that the caller must zero (every advantage estimator does).
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean
