"""DPPO (2026): a trust region on the probability of the sampled token, not on the ratio.

REINFORCE with a truncated importance ratio, where a token is dropped (loss and gradient 0)
once its probability has moved too far from pi_old in the direction its advantage pushes it:
by total variation ``|p - p_old|`` (``dppo_tv``) or by the KL of the two Bernoulli
distributions "this token / any other" (``dppo_kl``). See verl 0.9.1 ``core_algos``.
"""

from __future__ import annotations

import torch

from kernels.policy_losses._common import check_clip, masked_inputs, pg_metrics, weighted_loss
from kernels.ratios import LOG_RATIO_BOUND

# verl's fallback for clip_ratio_c in DPPO when the config lacks it: "a large threshold is
# recommended" (paper, section 5.4). verl's actor config sets clip_ratio_c = 3.0 by default.
DPPO_RATIO_CAP = 20.0


def _dppo(
    divergence: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    weights: torch.Tensor | None,
    loss_agg_mode: str,
    token_count: int | torch.Tensor | None,
    seq_count: int | torch.Tensor | None,
    norm_constant: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    check_clip(f"dppo_{divergence}", clip_low, clip_high, max_low=float("inf"))
    cap = DPPO_RATIO_CAP if dual_clip is None else dual_clip
    if not cap > 0:
        raise ValueError(f"dppo ratio cap (dual_clip) must be > 0, got {cap}")
    lp, old = masked_inputs(logprobs, old_logprobs, mask)  # (B, T) each
    log_ratio = (lp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    with torch.no_grad():
        truncated = ratio.clamp(max=cap)  # (B, T)
        prob, old_prob = torch.exp(lp), torch.exp(old)  # (B, T) each
        if divergence == "tv":
            keep_up = (prob - old_prob) <= clip_high
            keep_down = (prob - old_prob) >= -clip_low
        else:
            binary_kl = old_prob * (old - lp) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )  # (B, T)
            keep_up = (binary_kl <= clip_high) | (prob <= old_prob)
            keep_down = (binary_kl <= clip_low) | (prob >= old_prob)
        valid = torch.where(advantages > 0, keep_up, keep_down)  # (B, T)
    per_token = -advantages * truncated * lp * valid.to(lp.dtype)  # (B, T)
    loss, per_token = weighted_loss(per_token, mask, weights, loss_agg_mode, token_count,
                                    seq_count, norm_constant)
    return loss, pg_metrics(per_token, mask, ~valid, log_ratio,
                            clipped_lower=(ratio > cap) & valid)


def dppo_tv_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    token_count: int | torch.Tensor | None = None,
    seq_count: int | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl ``dppo_tv``: per-token loss ``-A * sg(min(r, c)) * lp * valid``; ``(B, T)`` inputs.

    ``r = exp(clamp(lp - lp_old, ±20))``, ``c`` is ``dual_clip`` (verl's ``clip_ratio_c``; None
    gives verl's fallback 20.0, but verl's actor config sets 3.0 by default). With
    ``p = exp(lp)``, a token is valid when ``p - p_old <= clip_high`` (``A > 0``) or
    ``p - p_old >= -clip_low`` (``A <= 0``): ``clip_low``/``clip_high`` are total-variation
    thresholds here, not ratio ranges (verl reuses ``clip_ratio_low/high``).

    ``actor/pg_clipfrac`` is the fraction of invalid tokens, ``actor/pg_clipfrac_lower`` the
    fraction of valid tokens whose ratio exceeds ``c``.
    """
    return _dppo("tv", logprobs, old_logprobs, advantages, mask, clip_low=clip_low,
                 clip_high=clip_high, dual_clip=dual_clip, weights=weights,
                 loss_agg_mode=loss_agg_mode, token_count=token_count, seq_count=seq_count,
                 norm_constant=norm_constant)


def dppo_kl_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    token_count: int | torch.Tensor | None = None,
    seq_count: int | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl ``dppo_kl``: as ``dppo_tv`` with the binary KL
    ``p_old * log(p_old / p) + (1 - p_old) * log((1 - p_old + 1e-8) / (1 - p + 1e-8))`` as the
    divergence. A token is valid when that KL is at most ``clip_high`` (``A > 0``) or
    ``clip_low`` (``A <= 0``), or when its probability moved against its advantage's push.
    """
    return _dppo("kl", logprobs, old_logprobs, advantages, mask, clip_low=clip_low,
                 clip_high=clip_high, dual_clip=dual_clip, weights=weights,
                 loss_agg_mode=loss_agg_mode, token_count=token_count, seq_count=seq_count,
                 norm_constant=norm_constant)
