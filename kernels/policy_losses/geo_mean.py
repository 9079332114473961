"""GMPO (Zhao et al. 2025): PPO on the geometric mean of the token ratios of a sequence."""

from __future__ import annotations

import torch

from kernels.masked import masked_mean
from kernels.policy_losses._common import check_clip, masked_inputs, pg_metrics


def geo_mean_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    token_count: int | torch.Tensor | None = None,
    seq_count: int | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl ``geo_mean`` (GMPO); every tensor argument is ``(B, T)``.

    Each token's log-ratio ``d = lp - lp_old`` is clipped on one side, by the sign of its
    advantage: to at most ``clip_high`` where ``A > 0``, to at least ``-clip_low`` where
    ``A < 0``, and to 0 where ``A = 0`` (the ranges are in log space; GMPO's paper uses 0.4).
    The sequence ratio is ``exp(mean_t d_clipped)`` and its advantage ``mean_t A`` over the
    masked tokens (GMPO assumes sequence-level advantages); the loss is
    ``mean_seq(-A_seq * ratio_seq)``. Unlike PPO there is no ±20 clamp: a clipped side is
    already bounded and the other only shrinks the ratio (verl leaves it out too).

    The mean is over the ``B`` rows of the batch, rows without a response token included (they
    add 0), as in verl; ``seq_count`` (the mini-batch's row count, when accumulating
    micro-batches) replaces ``B``. ``loss_agg_mode``, ``token_count``, ``norm_constant`` and
    ``dual_clip`` are ignored, as in verl. ``weights`` (detached, e.g. rollout IS weights) are
    reduced to one weight per sequence by their geometric mean ``exp(mean_t log(w + 1e-10))``.

    Metrics: ``actor/pg_clipfrac`` is the fraction of tokens with ``A > 0`` whose ``d`` lies
    outside ``[-clip_low, clip_high]``, ``actor/pg_clipfrac_lower`` the same for ``A < 0``;
    ``actor/pg_loss`` is the mean sequence loss.
    """
    del loss_agg_mode, token_count, norm_constant, dual_clip  # a mean over sequences
    check_clip("geo_mean", clip_low, clip_high, max_low=float("inf"))
    lp, old = masked_inputs(logprobs, old_logprobs, mask)  # (B, T) each
    log_ratio = lp - old  # (B, T)
    clamped = log_ratio.clamp(-clip_low, clip_high)  # (B, T)
    one_sided = torch.where(
        advantages > 0,
        torch.minimum(log_ratio, torch.full_like(log_ratio, clip_high)),
        torch.maximum(log_ratio, torch.full_like(log_ratio, -clip_low)),
    )  # (B, T)
    one_sided = torch.where(advantages == 0, torch.zeros_like(one_sided), one_sided)
    ratio = torch.exp(masked_mean(one_sided, mask, dim=-1))  # (B,)
    seq_adv = masked_mean(advantages.expand_as(log_ratio), mask, dim=-1)  # (B,)
    seq_loss = -seq_adv * ratio  # (B,)
    if weights is not None:
        log_w = torch.log(weights.detach() + 1e-10)  # (B, T)
        seq_loss = seq_loss * torch.exp(masked_mean(log_w, mask, dim=-1))
    rows = seq_loss.shape[0] if seq_count is None else seq_count
    loss = seq_loss.sum() / (rows.clamp_min(1) if isinstance(rows, torch.Tensor) else max(rows, 1))
    clipped = log_ratio != clamped  # (B, T)
    metrics = pg_metrics(seq_loss[:, None].expand_as(log_ratio), mask, clipped & (advantages > 0),
                         log_ratio, clipped_lower=clipped & (advantages < 0))
    with torch.no_grad():
        metrics["actor/pg_loss"] = seq_loss.detach().mean()
    return loss, metrics
