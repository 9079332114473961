"""Metrics of one rejection rule under verl's ``rollout_corr/rollout_rs_{option}_*`` names."""

from __future__ import annotations

import math

import torch

from kernels.masked import masked_mean


def rule_metrics(
    name: str,
    stat: torch.Tensor,
    token_keep: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    floor: float,
) -> dict[str, float]:
    """verl's ``compute_rs_metrics`` and per-option masked fractions for one rule, as floats.

    ``stat`` is the rule's statistic, ``(B, T)`` per token or ``(B,)`` per sequence;
    ``token_keep (B, T)`` what the rule keeps; ``low``/``high`` its bounds in the statistic's
    space (``-inf``/``inf`` when open). ``floor`` is where the statistic is clamped from below
    for the std (verl: the lower bound, or 0 for k2/k3). Keys, after
    ``rollout_corr/rollout_rs_{name}``:

    - ``_mean``: token mean of the statistic (a sequence statistic counts once per token).
    - ``_max|_min``: over tokens, or over sequences (rows with a response token) for a
      sequence rule.
    - ``_fraction_high|_low``: fraction of tokens (sequences) above ``high`` / below ``low``
      (``_low`` is 0 when the rule has no lower bound).
    - ``_std``: population std of the statistic clamped to ``[floor, high]``, over tokens.
    - ``_seq_mean|_seq_std|_seq_max|_seq_min``: of the per-sequence statistic (a token
      statistic's per-sequence mean) over sequences, std unbiased;
      ``_seq_max_deviation``: its largest absolute value; ``_seq_fraction_high`` and, with a
      lower bound only, ``_seq_fraction_low``.
    - ``_masked_fraction``: fraction of tokens this rule removes; ``_seq_masked_fraction``:
      fraction of sequences it removes a token from.

    An empty mask gives 0.0 everywhere.
    """
    prefix = f"rollout_corr/rollout_rs_{name}"
    has_low = low > -math.inf
    keys = ["_mean", "_max", "_min", "_fraction_high", "_fraction_low", "_std", "_seq_mean",
            "_seq_std", "_seq_max", "_seq_min", "_seq_max_deviation", "_seq_fraction_high"]
    keys += ["_seq_fraction_low"] * has_low + ["_masked_fraction", "_seq_masked_fraction"]
    valid = mask.bool()  # (B, T)
    if not valid.any():
        return {prefix + key: 0.0 for key in keys}
    seqs = valid.any(-1)  # (B,)
    per_sequence = stat.dim() == 1
    per_token = stat[:, None].expand_as(valid) if per_sequence else stat  # (B, T)
    dtype = per_token.dtype
    seq_values = (stat if per_sequence else masked_mean(stat, mask, dim=-1))[seqs]  # (S,)
    inf = torch.tensor(math.inf, dtype=dtype, device=stat.device)
    zero = torch.zeros((), dtype=dtype, device=stat.device)

    def frac(flags: torch.Tensor) -> torch.Tensor:
        return flags.to(dtype).mean()

    if per_sequence:
        most, least = seq_values.max(), seq_values.min()
        frac_high, frac_low = frac(seq_values > high), frac(seq_values < low)
    else:
        most = torch.where(valid, per_token, -inf).max()
        least = torch.where(valid, per_token, inf).min()
        frac_high = masked_mean((per_token > high).to(dtype), mask)
        frac_low = masked_mean((per_token < low).to(dtype), mask)
    if valid.sum() > 1:
        bounded = per_token.clamp(floor, high)
        var = masked_mean(bounded.square(), mask) - masked_mean(bounded, mask).square()
        std = var.clamp_min(0.0).sqrt()
    else:
        std = zero
    removed = valid & ~token_keep  # (B, T)
    values = [
        masked_mean(per_token, mask),
        most,
        least,
        frac_high,
        frac_low if has_low else zero,
        std,
        seq_values.mean(),
        seq_values.std() if seq_values.numel() > 1 else zero,
        seq_values.max(),
        seq_values.min(),
        seq_values.abs().max(),
        frac(seq_values > high),
    ]
    values += [frac(seq_values < low)] * has_low
    values += [masked_mean(removed.to(dtype), mask), frac(removed.any(-1)[seqs])]
    return {prefix + key: value
            for key, value in zip(keys, torch.stack(values).tolist(), strict=True)}
