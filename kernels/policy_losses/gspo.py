"""GSPO: PPO clipping on the sequence-level ratio, with a per-token straight-through gradient."""

from __future__ import annotations

import torch

from kernels.masked import masked_mean
from kernels.policy_losses._common import check_clip, masked_inputs, pg_metrics, weighted_loss

# verl clamps the combined log-ratio from above at 10 before exp (e^10 ~ 2.2e4, far past any
# clip range); tokens above it get no gradient, as clipped tokens would not.
GSPO_LOG_RATIO_MAX = 10.0


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    token_count: int | torch.Tensor | None = None,
    seq_count: int | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO loss (Zheng et al. 2025, verl ``gspo``); every tensor argument is ``(B, T)``.

    The sequence ratio is the geometric mean of the token ratios over the sequence's masked
    tokens, ``s_i = exp(mean_t (lp_t - lp_old_t))``. Each token carries
    ``s_it = sg(s_i) * exp(lp_t - sg(lp_t))``: its value is ``s_i``, its gradient
    ``s_i * grad lp_t``, so a sequence-level advantage moves every token of the sequence
    equally. The per-token loss is PPO's ``max(-A * s_it, -A * clip(s_it, 1 - clip_low,
    1 + clip_high))``; clipping is all-or-nothing per sequence. GSPO's ranges are tiny
    (paper: 3e-4 / 4e-4, the defaults here) because ``s_i`` is a per-token average.

    GSPO's paper aggregates with ``seq-mean-token-mean`` (the default here); like verl 0.9.1
    this function honours ``loss_agg_mode``. ``dual_clip`` is accepted for a uniform signature
    and ignored, as in verl. ``weights`` (detached) multiply the per-token
    loss. Metrics as ``ppo_clip_loss``; ``actor/ppo_kl`` is the token mean of
    ``lp_old - lp``.
    """
    del dual_clip  # GSPO has no dual clip (verl ignores clip_ratio_c here too)
    check_clip("gspo", clip_low, clip_high)
    lp, old = masked_inputs(logprobs, old_logprobs, mask)  # (B, T) each
    log_ratio = lp - old  # (B, T)
    seq_log_ratio = masked_mean(log_ratio.detach(), mask, dim=-1)  # (B,) log s_i
    log_s = (seq_log_ratio[:, None] + lp - lp.detach()).clamp(max=GSPO_LOG_RATIO_MAX)  # (B, T)
    ratio = torch.exp(log_s)  # (B, T), value s_i on every token of sequence i
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    per_token = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    loss, per_token = weighted_loss(per_token, mask, weights, loss_agg_mode, token_count, seq_count,
                                  norm_constant)
    return loss, pg_metrics(per_token, mask, loss_clipped > loss_unclipped, log_ratio)
