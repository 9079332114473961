"""Log-ratios of two policies' per-token log-probs, clamped so that ``exp`` stays finite."""

from __future__ import annotations

import torch

# exp() of a log-ratio beyond this is treated as this (exp(20) ~ 4.9e8); verl uses 20.
LOG_RATIO_BOUND = 20.0


def masked_log_ratio(
    numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``clamp(numerator - denominator, ±20)`` in float32 on masked tokens, 0 elsewhere. (B, T)

    Garbage outside the mask (padding log-probs, NaN) is replaced by 0 with ``torch.where``, so
    sums over a sequence see only its response tokens.
    """
    log_ratio = (numerator.float() - denominator.float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
