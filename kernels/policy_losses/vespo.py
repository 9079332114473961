"""VESPO: REINFORCE weighted by a gamma-shaped function of the sequence's importance ratio (TRL's
``loss_type = "vespo"``)."""

from __future__ import annotations

import math

import torch

from kernels.policy_losses._common import masked_inputs, pg_metrics, weighted_loss
from kernels.ratios import masked_log_ratio

LOG_W_LOW = math.log(1e-8)  # TRL's floor of log w (its reference implementation's)


def vespo_loss(
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
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss ``-sg(φ(w)) * A * lp``; ``(B, T)`` inputs.

    ``w = exp(Σ_t clamp(lp - lp_old, ±20))`` is the sequence's importance ratio (its log
    clamped to ``[log 1e-8, 20]``) and ``φ(w) = exp(λ + k log w - λ w)`` a gamma density scaled
    so that ``φ(1) = 1``: on-policy VESPO is REINFORCE, and a sequence far off in either
    direction has its gradient smoothly scaled down instead of clipped. ``k`` and ``λ`` are
    ``vespo_k_pos``/``vespo_lambda_pos`` for tokens with ``A >= 0``, the ``_neg`` pair otherwise
    (TRL's names and defaults; ``λ`` at least 1e-4, as TRL clamps it).

    ``weights`` (detached, π_old/μ) multiply the per-token loss as for every loss here; TRL
    instead folds its sampler correction into ``w``. The clip arguments are accepted for a
    uniform signature and ignored; ``actor/pg_clipfrac`` is 0.
    """
    del clip_low, clip_high, dual_clip  # φ bounds the weight smoothly
    lp, old = masked_inputs(logprobs, old_logprobs, mask)  # (B, T) each
    log_ratio = masked_log_ratio(lp.detach(), old, mask)  # (B, T), detached, 0 off the mask
    with torch.no_grad():
        log_w = log_ratio.sum(-1, keepdim=True).clamp(LOG_W_LOW, 20.0)  # (B, 1)
        positive = advantages >= 0  # (B, T) or (B, 1)
        k = torch.where(positive, vespo_k_pos, vespo_k_neg)
        lam = torch.where(positive, vespo_lambda_pos, vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # (B, T)
    per_token = -phi * advantages * lp  # (B, T)
    loss, per_token = weighted_loss(per_token, mask, weights, loss_agg_mode, token_count, seq_count,
                                  norm_constant)
    return loss, pg_metrics(per_token, mask, None, log_ratio)
