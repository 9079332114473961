"""How far the behaviour policy mu is from pi_old: verl's off-policy diagnostics.

mu is the sampler's policy (its log-probs come back with each trajectory), pi_old the learner's
policy at the start of the step, recomputed on the same tokens. ``offpolicy_metrics`` is verl
0.9.1's ``compute_offpolicy_metrics``, key for key; ``weight_metrics`` gives statistics of the
importance weights under this project's older names, ``mismatch_metrics`` both.
"""

from __future__ import annotations

import math

import torch

from kernels.masked import masked_mean, masked_sum
from kernels.precision import at_least_float32
from kernels.ratios import LOG_RATIO_BOUND, masked_log_ratio

OFFPOLICY_METRIC_NAMES = (
    "rollout_corr/training_ppl",
    "rollout_corr/training_log_ppl",
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/rollout_ppl",
    "rollout_corr/rollout_log_ppl",
    "rollout_corr/log_ppl_diff",
    "rollout_corr/log_ppl_abs_diff",
    "rollout_corr/log_ppl_diff_max",
    "rollout_corr/log_ppl_diff_min",
    "rollout_corr/ppl_ratio",
    "rollout_corr/chi2_token",
    "rollout_corr/chi2_seq",
)

WEIGHT_METRIC_NAMES = (
    "rollout_corr/is_weight_mean",
    "rollout_corr/is_weight_std",
    "rollout_corr/is_weight_min",
    "rollout_corr/is_weight_max",
    "rollout_corr/rho_max",
    "rollout_corr/ess",
)

METRIC_NAMES = WEIGHT_METRIC_NAMES + OFFPOLICY_METRIC_NAMES


def offpolicy_metrics(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """verl's off-policy metrics of pi_old (training) against mu (rollout), Python floats.

    With ``log rho = lp_old - lp_behav`` per token (raw, unclamped unless said):

    - ``kl``: ``mean(lp_behav - lp_old)`` over the masked tokens, the k1 estimate of
      KL(mu || pi_old); ``k3_kl``: ``mean(rho - 1 - log rho)``, its k3 estimate (``rho`` is
      ``exp`` of the raw log-ratio, so float32 overflows to inf past ``log rho`` ~ 88, as in
      verl).
    - ``training_ppl`` / ``rollout_ppl``: ``exp(-mean_t lp)`` per sequence, averaged over
      sequences; ``training_log_ppl`` / ``rollout_log_ppl``: ``-mean_t lp`` averaged.
    - ``log_ppl_diff``: per-sequence ``mean_t lp_behav - mean_t lp_old`` (= log of training
      ppl over rollout ppl), averaged; ``log_ppl_abs_diff`` the mean of its absolute value,
      ``log_ppl_diff_max|min`` its extremes, ``ppl_ratio`` the mean of its ``exp``.
    - ``chi2_token``: ``mean(rho**2) - 1`` with token log-ratios clamped to ±20;
      ``chi2_seq``: ``mean_seq(exp(2 * clamp(sum_t log rho, ±20))) - 1``, the raw token
      log-ratios summed before the clamp.

    Per-sequence averages are over every row of the batch, as in verl: a row without a
    response token has mean log-prob 0 (ppl 1, log-ppl difference 0, sequence ratio 1). An
    empty mask gives NaN for every metric (verl raises).
    """
    if not mask.bool().any():
        return dict.fromkeys(OFFPOLICY_METRIC_NAMES, math.nan)
    with torch.no_grad():
        old = at_least_float32(old_logprobs)
        behav = at_least_float32(behaviour_logprobs)
        raw = masked_log_ratio(old, behav, mask, clamp=False)  # (B, T), 0 outside the mask
        clamped = raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)

        seq_old = masked_mean(old, mask, dim=-1)  # (B,) 0 for an empty row
        seq_behav = masked_mean(behav, mask, dim=-1)  # (B,)
        diff = seq_behav - seq_old  # (B,)
        seq_log_rho = masked_sum(raw, mask, dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        values = torch.stack(
            [
                torch.exp(-seq_old).mean(),
                (-seq_old).mean(),
                masked_mean(-raw, mask),
                masked_mean(torch.expm1(raw) - raw, mask),
                torch.exp(-seq_behav).mean(),
                (-seq_behav).mean(),
                diff.mean(),
                diff.abs().mean(),
                diff.max(),
                diff.min(),
                torch.exp(diff).mean(),
                masked_mean(torch.exp(clamped).square(), mask) - 1.0,
                torch.exp(2.0 * seq_log_rho).mean() - 1.0,
            ]
        ).tolist()  # one device sync for all metrics
    return dict(zip(OFFPOLICY_METRIC_NAMES, values, strict=True))


def weight_metrics(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
) -> dict[str, float]:
    """Statistics of the loss ``weights`` ``(B, T)`` over ``mask``, Python floats.

    - ``rollout_corr/is_weight_mean|std|min|max``: of ``weights`` over the masked tokens (std
      is the population std).
    - ``rollout_corr/rho_max``: the largest token rho ``exp(clamp(log rho, ±20))``, before any
      cap.
    - ``rollout_corr/ess``: normalised effective sample size ``1 / mean(w_hat**2)`` with
      ``w_hat = w / mean(w)``, i.e. ``mean(w)**2 / mean(w**2)``, in (0, 1]; 1 means uniform.

    These are this project's names (the runner's console line and ``runner.py inspect`` read
    them): statistics of the weights the loss applies, after normalising and on the tokens
    rejection kept. verl reports the weights before normalising, on every response token,
    under other names (``rollout_is_*``, see ``kernels.is_metrics``). An empty mask gives NaN
    for every metric.
    """
    if not mask.bool().any():
        return dict.fromkeys(WEIGHT_METRIC_NAMES, math.nan)
    with torch.no_grad():
        keep = mask.bool()  # (B, T)
        w = at_least_float32(weights)
        rho = torch.exp(masked_log_ratio(old_logprobs, behaviour_logprobs, mask))  # (B, T)
        w_mean = masked_mean(w, mask)
        w_sq_mean = masked_mean(w.square(), mask)
        w_std = (w_sq_mean - w_mean.square()).clamp_min(0).sqrt()
        inf = torch.tensor(math.inf, dtype=w.dtype, device=w.device)
        w_min = torch.where(keep, w, inf).min()
        w_max = torch.where(keep, w, -inf).max()
        rho_max = torch.where(keep, rho, -inf.to(rho.dtype)).max().to(w.dtype)
        ess = torch.where(w_sq_mean > 0, w_mean.square() / w_sq_mean, torch.zeros_like(w_mean))
        values = torch.stack([w_mean, w_std, w_min, w_max, rho_max, ess]).tolist()
    return dict(zip(WEIGHT_METRIC_NAMES, values, strict=True))


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
) -> dict[str, float]:
    """``weight_metrics`` and ``offpolicy_metrics`` on the same ``mask``, Python floats."""
    return {**weight_metrics(old_logprobs, behaviour_logprobs, mask, weights),
            **offpolicy_metrics(old_logprobs, behaviour_logprobs, mask)}
