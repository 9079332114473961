"""Log-ratios of two policies' per-token log-probs, clamped so that ``exp`` stays finite."""

from __future__ import annotations

import torch

from kernels.precision import at_least_float32

# exp() of a log-ratio beyond this is treated as this (exp(20) ~ 4.9e8); verl uses 20
# (``SAFETY_BOUND`` in its rollout_corr_helper, and the same literal in its losses).
LOG_RATIO_BOUND = 20.0


def masked_log_ratio(
    numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor, *, clamp: bool = True
) -> torch.Tensor:
    """``clamp(numerator - denominator, ±20)`` on masked tokens, 0 elsewhere. (B, T)

    Computed in float32 (float64 inputs stay float64). Garbage outside the mask (padding
    log-probs, NaN) is replaced by 0 with ``torch.where``, so sums over a sequence see only its
    response tokens. ``clamp=False`` gives the raw difference: verl sums raw token log-ratios
    into a sequence log-ratio and clamps only the sum.
    """
    log_ratio = at_least_float32(numerator) - at_least_float32(denominator)
    if clamp:
        log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
