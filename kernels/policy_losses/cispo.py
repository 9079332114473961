"""CISPO: REINFORCE weighted by the clipped, detached importance ratio (MiniMax-M1)."""

from __future__ import annotations

import torch

from kernels.policy_losses._common import check_clip, pg_metrics, weighted_loss
from kernels.ratios import masked_log_ratio


def cispo_loss(
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
    """Per-token loss ``-sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * lp``; ``(B, T)``.

    ``ratio = exp(clamp(lp - lp_old, ±20))``. Unlike PPO, a clipped token keeps its gradient
    ``-clip(ratio) * A * grad lp``: clipping bounds the weight of a token instead of dropping
    it, so rare high-ratio tokens (often the "aha" tokens of reasoning) still learn. MiniMax
    clips only from above; ``clip_low = 1`` (lower bound 0) reproduces that.

    ``weights`` (detached) multiply the per-token loss; ``dual_clip`` is accepted for a
    uniform signature and ignored. ``actor/pg_clipfrac`` is the fraction of masked tokens whose
    ratio lies outside ``[1 - clip_low, 1 + clip_high]``; other metrics as ``ppo_clip_loss``.
    """
    del dual_clip  # the weight is already bounded on both sides
    check_clip("cispo", clip_low, clip_high)
    keep = mask.bool()  # (B, T)
    lp = torch.where(keep, logprobs, torch.zeros_like(logprobs))  # (B, T)
    log_ratio = masked_log_ratio(lp.detach(), old_logprobs.detach(), mask)  # (B, T), detached
    ratio = torch.exp(log_ratio)  # (B, T), detached
    low, high = 1.0 - clip_low, 1.0 + clip_high
    per_token = -ratio.clamp(low, high) * advantages * lp  # (B, T)
    loss, per_token = weighted_loss(per_token, mask, weights, loss_agg_mode, token_count, seq_count,
                                  norm_constant)
    return loss, pg_metrics(per_token, mask, (ratio < low) | (ratio > high), log_ratio)
