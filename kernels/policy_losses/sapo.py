"""SAPO (Qwen, 2025): a smooth sigmoid gate on the ratio instead of a hard clip."""

from __future__ import annotations

import torch

from kernels.policy_losses._common import masked_inputs, pg_metrics, weighted_loss
from kernels.ratios import LOG_RATIO_BOUND


def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    token_count: int | torch.Tensor | None = None,
    seq_count: int | torch.Tensor | None = None,
    norm_constant: float | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl ``sapo``: per-token loss ``-f(ratio) * A`` with the gate
    ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau``; every tensor argument is ``(B, T)``.

    ``ratio = exp(clamp(lp - lp_old, ±20))``. The gate's slope at ``r = 1`` is 1, as PPO's
    ratio; away from it the gradient fades smoothly instead of being cut at a clip boundary.
    ``tau`` is ``tau_pos`` for tokens with ``A > 0`` and ``tau_neg`` otherwise (verl actor
    ``tau_pos`` / ``tau_neg``, defaults 1.0 / 1.05: a steeper gate for negative advantages).

    The loss aggregates with ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says, as verl's
    does (a job's ``algorithm.loss_agg_mode`` still aggregates its entropy and KL terms): the
    same config gives verl's numbers. The clip ranges and ``dual_clip`` are accepted for a
    uniform signature and ignored.
    ``actor/pg_clipfrac`` is 0.
    """
    del clip_low, clip_high, dual_clip, loss_agg_mode  # the gate replaces clipping; verl's mode
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo needs tau_pos > 0 and tau_neg > 0, got {tau_pos}, {tau_neg}")
    lp, old = masked_inputs(logprobs, old_logprobs, mask)  # (B, T) each
    log_ratio = (lp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(tau_neg, dtype=ratio.dtype, device=ratio.device),
    )  # (B, T)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # (B, T)
    per_token = -gate * advantages  # (B, T)
    loss, per_token = weighted_loss(per_token, mask, weights, "seq-mean-token-mean", token_count,
                                    seq_count, norm_constant)
    return loss, pg_metrics(per_token, mask, None, log_ratio)
