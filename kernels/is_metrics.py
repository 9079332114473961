"""Statistics of rollout importance weights under verl's ``rollout_corr/rollout_is_*`` names."""

from __future__ import annotations

import math

import torch

from kernels.masked import masked_mean
from kernels.precision import at_least_float32
from kernels.ratios import LOG_RATIO_BOUND

IS_METRIC_NAMES = (
    "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_is_max",
    "rollout_corr/rollout_is_min",
    "rollout_corr/rollout_is_ratio_fraction_high",
    "rollout_corr/rollout_is_ratio_fraction_low",
    "rollout_corr/rollout_is_std",
    "rollout_corr/rollout_is_eff_sample_size",
    "rollout_corr/rollout_is_seq_mean",
    "rollout_corr/rollout_is_seq_std",
    "rollout_corr/rollout_is_seq_max",
    "rollout_corr/rollout_is_seq_min",
    "rollout_corr/rollout_is_seq_max_deviation",
    "rollout_corr/rollout_is_seq_fraction_high",
    "rollout_corr/rollout_is_seq_fraction_low",
)


def is_weight_metrics(
    weights: torch.Tensor,
    raw_weights: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    upper: float,
    lower: float | None = None,
) -> dict[str, float]:
    """verl's ``compute_is_metrics``: statistics of applied and raw IS weights, Python floats.

    ``weights (B, T)`` are the applied weights (after the cap or the IcePop band),
    ``raw_weights (B, T)`` the same before it (0 outside ``mask``), ``log_ratio`` the raw
    log-ratios behind them: ``(B, T)`` token log-ratios at ``level="token"``, ``(B, 1)`` summed
    sequence log-ratios at ``level="sequence"``. ``upper`` is the cap, ``lower`` the IcePop
    lower bound (None: ``1 / upper``, used for the "low" fractions only).

    - ``rollout_is_mean``: token mean of ``weights``. ``rollout_is_max|min``: at token level of
      ``weights``; at sequence level ``exp`` of the largest (clamped at 20) and smallest sequence
      log-ratio over every row.
    - ``rollout_is_ratio_fraction_high|low``: fraction of tokens whose raw weight is above
      ``upper`` / below the lower bound; at sequence level the fraction of rows whose sequence
      log-ratio is above ``log upper`` / below ``log lower``.
    - ``rollout_is_std``: population std of ``weights`` clamped to ``[0, upper]`` (0 with a
      single token); ``rollout_is_eff_sample_size``: ``1 / mean(w_hat**2)`` with
      ``w_hat = w / (mean(w) + 1e-8)`` on the same clamped weights (0 when every weight is 0,
      where verl divides by zero).
    - ``rollout_is_seq_mean|std|max|min``: of each row's mean weight over every row (an empty
      row has mean 0; std is unbiased), ``rollout_is_seq_max_deviation``: the largest
      ``|mean - 1|``, ``rollout_is_seq_fraction_high|low``: fraction of rows whose mean raw
      weight is above ``upper`` / below the lower bound.

    An empty mask gives NaN for every metric (verl raises).
    """
    if not mask.bool().any():
        return dict.fromkeys(IS_METRIC_NAMES, math.nan)
    low = 1.0 / upper if lower is None else lower
    with torch.no_grad():
        keep = mask.bool()
        w = at_least_float32(weights)
        raw = at_least_float32(raw_weights)
        lr = at_least_float32(log_ratio)
        inf = torch.tensor(math.inf, dtype=w.dtype, device=w.device)
        mean = masked_mean(w, mask)
        if level == "sequence":
            w_max = torch.exp(lr.max().clamp(max=LOG_RATIO_BOUND))
            w_min = torch.exp(lr.min())
            frac_high = (lr > math.log(upper)).to(w.dtype).mean()
            frac_low = (lr < math.log(low)).to(w.dtype).mean()
        else:
            w_max = torch.where(keep, w, -inf).max()
            w_min = torch.where(keep, w, inf).min()
            frac_high = masked_mean((raw > upper).to(w.dtype), mask)
            frac_low = masked_mean((raw < low).to(w.dtype), mask)
        bounded = w.clamp(0.0, upper)  # (B, T)
        bounded_mean = masked_mean(bounded, mask)
        if keep.sum() > 1:
            var = masked_mean(bounded.square(), mask) - bounded_mean.square()
            std = var.clamp_min(0.0).sqrt()
        else:
            std = torch.zeros_like(mean)
        second = masked_mean((bounded / (bounded_mean + 1e-8)).square(), mask)
        ess = torch.where(second > 0, 1.0 / second, torch.zeros_like(second))
        seq = masked_mean(w, mask, dim=-1)  # (B,) mean weight of each row
        seq_std = seq.std() if seq.numel() > 1 else torch.zeros_like(mean)
        raw_seq = masked_mean(raw, mask, dim=-1)  # (B,)
        values = torch.stack(
            [
                mean,
                w_max,
                w_min,
                frac_high,
                frac_low,
                std,
                ess,
                seq.mean(),
                seq_std,
                seq.max(),
                seq.min(),
                (seq - 1.0).abs().max(),
                (raw_seq > upper).to(w.dtype).mean(),
                (raw_seq < low).to(w.dtype).mean(),
            ]
        ).tolist()  # one device sync for all metrics
    return dict(zip(IS_METRIC_NAMES, values, strict=True))
