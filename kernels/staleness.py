"""How far behind the learner the samples of a batch were generated, as a histogram."""

from __future__ import annotations

import math

import torch


def staleness_histogram(versions_behind: torch.Tensor, *, max_bucket: int = 8) -> dict[str, float]:
    """Fractions of samples by policy versions behind (learner version - behaviour version).

    ``versions_behind`` holds one non-negative whole number per sample (any shape, int or
    float). The result has ``staleness/0`` ... ``staleness/{max_bucket - 1}``, the fraction of
    samples exactly that many versions behind, and ``staleness/{max_bucket}+`` for the rest:
    the same keys every step whatever the batch holds, so dashboards get continuous series.
    ``staleness/mean`` and ``staleness/max`` are over all samples (NaN for an empty input).
    The default 8 is prime-rl's ``max_off_policy_steps``.
    """
    if max_bucket < 1:
        raise ValueError(f"max_bucket must be >= 1, got {max_bucket}")
    lag = versions_behind.detach().flatten().double().cpu()  # (S,)
    if not torch.isfinite(lag).all() or (lag != lag.round()).any():
        bad = lag[~torch.isfinite(lag) | (lag != lag.round())][0].item()
        raise ValueError(f"versions_behind must hold whole numbers, got {bad}")
    if (lag < 0).any():
        raise ValueError(f"versions_behind must be >= 0, got {lag.min().item():g}")
    keys = [f"staleness/{k}" for k in range(max_bucket)] + [f"staleness/{max_bucket}+"]
    if lag.numel() == 0:
        return {**dict.fromkeys(keys, 0.0), "staleness/mean": math.nan, "staleness/max": math.nan}
    counts = torch.bincount(lag.clamp(max=max_bucket).long(), minlength=max_bucket + 1)
    fractions = (counts.double() / lag.numel()).tolist()
    return {
        **dict(zip(keys, fractions, strict=True)),
        "staleness/mean": lag.mean().item(),
        "staleness/max": lag.max().item(),
    }
