"""KL-Cov (Cui et al. 2025): a KL penalty on the tokens of largest advantage/log-prob
covariance, the ones that drive entropy collapse."""

from __future__ import annotations

import torch

from kernels.policy_losses._common import masked_inputs, pg_metrics, weighted_loss


def kl_cov_loss(
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
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl ``kl_cov``; every tensor argument is ``(B, T)``.

    The unclipped surrogate ``-A * r`` with ``r = exp(lp - lp_old)`` (no clamp, no clip), plus
    ``ppo_kl_coef * |lp - lp_old|`` on the ``max(1, int(kl_cov_ratio * tokens))`` masked
    tokens of largest covariance ``(A - mean A) * (lp - mean lp)`` (means over the masked
    tokens; ``torch.topk`` over them in row-major order, as verl). Options use verl's
    ``policy_loss`` names and defaults (its config default ``ppo_kl_coef`` is 0.1; the code's
    fallback when the key is missing, 1.0, is not used). The clip ranges and ``dual_clip`` are
    accepted for a uniform signature and ignored.

    ``actor/ppo_kl`` is the mean of ``|lp - lp_old|``, as verl reports it for this loss;
    ``actor/pg_clipfrac`` is the fraction of masked tokens that got the penalty.
    """
    del clip_low, clip_high, dual_clip  # no clipping in KL-Cov
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    keep = mask.bool()  # (B, T)
    lp, old = masked_inputs(logprobs, old_logprobs, mask)  # (B, T) each
    log_ratio = lp - old  # (B, T)
    abs_kl = log_ratio.abs()  # (B, T)
    surrogate = -advantages * torch.exp(log_ratio)  # (B, T)
    penalised = torch.zeros_like(keep)  # (B, T)
    with torch.no_grad():
        adv = advantages.expand_as(lp)[keep].cpu()  # (R,) verl computes this on the CPU
        logp = lp.detach()[keep].cpu()  # (R,)
        if adv.numel() > 0:
            cov = (adv - adv.mean()) * (logp - logp.mean())  # (R,)
            top = torch.topk(cov, max(1, int(adv.numel() * kl_cov_ratio)), largest=True).indices
            flat = torch.zeros(adv.numel(), dtype=torch.bool)
            flat[top] = True
            penalised[keep] = flat.to(keep.device)
    per_token = torch.where(penalised, surrogate + ppo_kl_coef * abs_kl, surrogate)  # (B, T)
    loss, per_token = weighted_loss(per_token, mask, weights, loss_agg_mode, token_count,
                                    seq_count, norm_constant)
    return loss, pg_metrics(per_token, mask, penalised, log_ratio, ppo_kl=abs_kl)
