"""DRO (direct reward optimisation): REINFORCE with a quadratic penalty on the log-ratio."""

from __future__ import annotations

import torch

from kernels.policy_losses._common import masked_inputs, pg_metrics, weighted_loss


def dro_loss(
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
    dro_beta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl ``dro``: per-token loss ``-(A * lp - dro_beta / 2 * (lp - lp_old)**2)``; ``(B, T)``.

    ``dro_beta`` (verl ``policy_loss.dro_beta``) has no default and must be > 0. The penalty
    pulls ``lp`` back towards ``lp_old`` with a force growing with the distance, in place of a
    clip. The clip ranges and ``dual_clip`` are accepted for a uniform signature and ignored;
    ``actor/pg_clipfrac`` is 0.
    """
    del clip_low, clip_high, dual_clip  # the quadratic penalty replaces clipping
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"dro needs dro_beta > 0, got {dro_beta}")
    lp, old = masked_inputs(logprobs, old_logprobs, mask)  # (B, T) each
    log_ratio = lp - old  # (B, T)
    per_token = -(lp * advantages - 0.5 * dro_beta * log_ratio.square())  # (B, T)
    loss, per_token = weighted_loss(per_token, mask, weights, loss_agg_mode, token_count,
                                    seq_count, norm_constant)
    return loss, pg_metrics(per_token, mask, None, log_ratio)
