"""Off-policy correction between the behaviour policy mu and the proximal policy pi_old.

mu is the sampler's policy: its per-token log-probs come back with each trajectory and may be
several weight versions old (or the same weights in another numeric format). pi_old is the
learner's policy at the start of the current step, recomputed on the same tokens. Every
function here works from the per-token log-ratio ``log rho = lp_old - lp_behav`` over the
response tokens selected by the 0/1 ``mask``, all ``(B, T)``.

Truncated importance sampling (TIS) and IcePop turn rho into detached loss weights
(``truncated_is_weights``, verl's ``compute_rollout_correction_weights``);
``normalize_weights`` rescales them to mean 1. How far apart the two policies are is
``kernels.offpolicy``; rejection (masked IS) is ``kernels.rejection``, verl's whole pipeline in
one call ``kernels.rollout_corr``.
"""

from __future__ import annotations

import torch

from kernels.is_metrics import is_weight_metrics
from kernels.masked import masked_mean, masked_sum
from kernels.ratios import LOG_RATIO_BOUND, masked_log_ratio

__all__ = ["IS_LEVELS", "normalize_weights", "truncated_is_weights"]

IS_LEVELS = ("token", "sequence")


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
    lower: float | None = None,
    normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights of pi_old over mu, detached, ``(B, T)``, and their metrics.

    At ``level="token"`` each token gets its own ``rho_t = exp(clamp(lp_old - lp_behav, ±20))``.
    At ``level="sequence"`` every token of a sequence gets the sequence ratio
    ``exp(clamp(sum_t (lp_old - lp_behav), ±20))``: the raw token log-ratios of its masked
    tokens are summed and only the sum is clamped (verl), so one token at +25 and one at -20
    give ``e^5``. Sequence weights are unbiased for sequence-level rewards, with a variance that
    grows with length.

    Without ``lower`` the weight is ``min(rho, cap)`` (truncated IS). With ``lower`` it is
    ``rho`` inside ``[lower, cap]`` and 0 outside (IcePop; verl's ``"lower_upper"``
    threshold, see ``kernels.rollout_options.parse_is_threshold``). ``normalize`` rescales the weights to mean 1 as
    ``normalize_weights`` does (verl ``rollout_is_batch_normalize``). Weights are 0 outside
    the mask.

    The metrics are verl's ``rollout_corr/rollout_is_*`` (``kernels.is_metrics``, computed
    before normalising), ``rollout_corr/rollout_is_oob_ratio`` with IcePop (fraction of tokens
    outside the band), ``rollout_corr/rollout_is_batch_norm_factor`` with ``normalize`` (the
    mean divided by, 1.0 when it was too small to divide by), and
    ``rollout_corr/is_clip_frac``, the same number as ``rollout_is_ratio_fraction_high``: the
    fraction of masked tokens whose ratio exceeds ``cap``, or at sequence level the fraction of
    sequences (every row) whose ratio does.
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if lower is not None and not 0 < lower <= cap:
        raise ValueError(f"lower must be in (0, cap], got {lower} with cap {cap}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown IS level {level!r}; expected one of {IS_LEVELS}")
    with torch.no_grad():
        keep = mask.bool()
        log_rho = masked_log_ratio(old_logprobs, behaviour_logprobs, mask, clamp=False)  # (B, T)
        if level == "sequence":
            log_for_metrics = log_rho.sum(-1, keepdim=True)  # (B, 1)
            log_w = log_for_metrics.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).expand_as(log_rho)
        else:
            log_for_metrics = log_rho
            log_w = log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        raw = torch.where(keep, torch.exp(log_w), torch.zeros_like(log_w))  # (B, T)
        if lower is None:
            weights = raw.clamp(max=cap)
        else:
            inside = (raw >= lower) & (raw <= cap)
            weights = torch.where(inside, raw, torch.zeros_like(raw))
        metrics = is_weight_metrics(weights, raw, log_for_metrics, mask, level=level,
                                    upper=cap, lower=lower)
        metrics["rollout_corr/is_clip_frac"] = (
            metrics["rollout_corr/rollout_is_ratio_fraction_high"] if keep.any() else 0.0
        )
        if lower is not None:
            outside = (raw < lower) | (raw > cap)
            metrics["rollout_corr/rollout_is_oob_ratio"] = masked_mean(
                outside.to(raw.dtype), mask).item()
        if normalize:
            mean = _weights_mean(weights, mask, level)
            if mean > 1e-8:
                weights = weights / mean
                metrics["rollout_corr/rollout_is_batch_norm_factor"] = mean.item()
            else:
                metrics["rollout_corr/rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _weights_mean(w: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The mean that ``normalize_weights`` divides by: over tokens, or over sequences of each
    sequence's mean weight."""
    if level == "token":
        return masked_mean(w, mask)
    seqs = mask.bool().any(-1)  # (B,)
    return masked_mean(masked_sum(w, mask, dim=-1) / mask.bool().sum(-1).clamp_min(1), seqs)


def normalize_weights(
    weights: torch.Tensor, mask: torch.Tensor, *, level: str = "token"
) -> torch.Tensor:
    """Importance weights ``(B, T)`` rescaled to mean 1 over the batch, detached (verl
    ``rollout_is_batch_normalize``).

    At ``level="token"`` the mean is over masked tokens. At ``level="sequence"`` it is over
    sequences (rows with at least one masked token) of each sequence's mean weight, so that
    sequence-level weights count once per sequence rather than once per token, as in verl.
    Normalising trades the bias of truncation for a step size that does not shrink when most
    weights are capped. Weights whose mean is at most 1e-8 (all zero, say) are returned unscaled,
    as in verl; positions outside the mask are 0 either way.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown IS level {level!r}; expected one of {IS_LEVELS}")
    if weights.shape != mask.shape:
        raise ValueError(f"weights shape {tuple(weights.shape)} != mask shape {tuple(mask.shape)}")
    with torch.no_grad():
        keep = mask.bool()  # (B, T)
        w = torch.where(keep, weights.detach(), torch.zeros_like(weights))  # (B, T)
        mean = _weights_mean(w, mask, level)
        scale = torch.where(mean > 1e-8, 1.0 / mean.clamp_min(1e-8), torch.ones_like(mean))
        return w * scale
