"""PPO clipped policy loss (verl ``vanilla``, AReaL decoupled PPO with behaviour weights)."""

from __future__ import annotations

import torch

from kernels.masked import masked_mean
from kernels.policy_losses._common import masked_inputs, weighted_loss
from kernels.precision import at_least_float32
from kernels.ratios import LOG_RATIO_BOUND


def ppo_clip_loss(
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
    """PPO clipped surrogate loss and its metrics; every tensor argument is ``(B, T)``.

    ``ratio = exp(clamp(logprobs - old_logprobs, -20, 20))`` and the per-token loss is
    ``max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``. Setting
    ``clip_high > clip_low`` gives DAPO's clip-higher. With ``dual_clip = c`` (``c > 1``) the
    loss of tokens with ``A < 0`` is further capped at ``-A * c``, so a huge ratio on a bad
    token cannot dominate the step.

    ``weights`` are per-token importance weights (for AReaL's decoupled PPO, the behaviour
    weight ``pi_old / mu`` from ``kernels.importance``); they are detached and multiply the
    per-token loss before aggregation. Only ``logprobs`` should carry a gradient.

    Returns the aggregated loss (see ``aggregate`` for ``loss_agg_mode``, ``token_count``,
    ``seq_count``, ``norm_constant``) and detached scalar metrics, each a token mean over this
    call's mask:

    - ``actor/pg_loss``: the per-token loss (weights applied).
    - ``actor/pg_clipfrac``: fraction of tokens where the clipped branch is the larger one.
    - ``actor/pg_clipfrac_lower``: fraction where the dual clip is active (0 without it).
    - ``actor/ppo_kl``: mean of ``old_logprobs - logprobs``.
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(
            f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
            f"clip_high={clip_high}"
        )
    lp, old = masked_inputs(logprobs, old_logprobs, mask)  # (B, T) each
    log_ratio = (lp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    per_token = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    clipped = loss_clipped > loss_unclipped  # (B, T)
    if dual_clip is not None:
        loss_dual = -advantages * dual_clip  # (B, T)
        negative = advantages < 0
        dual_active = negative & (per_token > loss_dual)  # (B, T)
        per_token = torch.where(negative, torch.minimum(per_token, loss_dual), per_token)
    else:
        dual_active = torch.zeros_like(clipped)
    loss, per_token = weighted_loss(per_token, mask, weights, loss_agg_mode, token_count, seq_count,
                                    norm_constant)
    with torch.no_grad():
        metrics = {
            "actor/pg_loss": masked_mean(at_least_float32(per_token), mask),
            "actor/pg_clipfrac": masked_mean(at_least_float32(clipped), mask),
            "actor/pg_clipfrac_lower": masked_mean(at_least_float32(dual_active), mask),
            "actor/ppo_kl": masked_mean(-at_least_float32(log_ratio), mask),
        }
    return loss, metrics
