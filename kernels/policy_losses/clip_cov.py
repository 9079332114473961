"""Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").

Tokens whose advantage and log-prob covary strongly drive the collapse of the policy's
entropy; Clip-Cov drops the gradient of a small random share of them.
"""

from __future__ import annotations

import torch

from kernels.masked import masked_mean
from kernels.policy_losses._common import check_clip, masked_inputs, pg_metrics, weighted_loss


def clip_cov_loss(
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
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl ``clip_cov``; every tensor argument is ``(B, T)``.

    The PPO clipped loss ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))`` with
    ``r = exp(lp - lp_old)`` (no ±20 clamp and no dual clip, as in verl), except that up to
    ``max(int(clip_cov_ratio * tokens), 1)`` tokens get loss 0 (and no gradient). They are
    drawn at random (``torch.randperm``, from ``generator`` or the global generator, as verl
    draws) among the masked tokens that PPO did not clip and whose centred covariance
    ``(A - mean A) * (lp - mean lp)`` lies strictly between ``clip_cov_lb`` and ``clip_cov_ub``
    (means over the masked tokens). Options use verl's ``policy_loss`` names and defaults.

    ``actor/pg_clipfrac`` is the fraction of masked tokens dropped this way.
    """
    del dual_clip  # verl's clip_cov has no dual clip
    check_clip("clip_cov", clip_low, clip_high)
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    keep = mask.bool()  # (B, T)
    lp, old = masked_inputs(logprobs, old_logprobs, mask)  # (B, T) each
    log_ratio = lp - old  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    with torch.no_grad():
        adv = advantages.expand_as(lp)
        cov = (adv - masked_mean(adv, mask)) * (lp.detach() - masked_mean(lp.detach(), mask))
        candidates = keep & ~(loss_clipped > loss_unclipped)
        candidates &= (cov < clip_cov_ub) & (cov > clip_cov_lb)
        where = torch.nonzero(candidates)  # (K, 2), row-major as verl's
        budget = max(int(clip_cov_ratio * keep.sum().item()), 1)
        dropped = torch.zeros_like(keep)
        if len(where) > 0:
            chosen = where[torch.randperm(len(where), generator=generator)[:budget]]
            dropped[chosen[:, 0], chosen[:, 1]] = True
    per_token = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    per_token = torch.where(dropped, torch.zeros_like(per_token), per_token)
    loss, per_token = weighted_loss(per_token, mask, weights, loss_agg_mode, token_count,
                                    seq_count, norm_constant)
    return loss, pg_metrics(per_token, mask, dropped, log_ratio)
