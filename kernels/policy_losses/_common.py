"""Checks and metrics shared by the policy losses."""

from __future__ import annotations

import torch

from kernels.aggregate import aggregate
from kernels.masked import masked_mean
from kernels.precision import at_least_float32


def check_clip(name: str, clip_low: float, clip_high: float, *, max_low: float = 1.0) -> None:
    """Clip ranges are ``1 - clip_low`` and ``1 + clip_high``; the lower bound must stay >= 0."""
    if not (0.0 <= clip_low <= max_low and clip_high >= 0.0):
        bound = "<" if max_low < 1.0 else "<="
        raise ValueError(
            f"{name} needs 0 <= clip_low {bound} 1 and clip_high >= 0, got clip_low={clip_low}, "
            f"clip_high={clip_high}"
        )


def check_shapes(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
) -> None:
    """Every per-token input is ``(B, T)`` like ``mask``; advantages may broadcast to it."""
    for label, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("weights", weights)):
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{label} shape {tuple(t.shape)} != mask shape {tuple(mask.shape)}")
    try:
        broadcast = torch.broadcast_shapes(advantages.shape, mask.shape)
    except RuntimeError:
        broadcast = None
    if broadcast != mask.shape:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} does not broadcast to mask shape "
            f"{tuple(mask.shape)}"
        )


def pg_metrics(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    clipped: torch.Tensor | None,
    log_ratio: torch.Tensor,
    *,
    clipped_lower: torch.Tensor | None = None,
    ppo_kl: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """verl's actor metrics as detached scalar tensors, each a token mean over ``mask``.

    ``clipped`` is the per-token clip indicator (None: the loss never clips), ``clipped_lower``
    the indicator behind ``actor/pg_clipfrac_lower`` (None: 0). ``log_ratio`` is
    ``logprobs - old_logprobs``; ``actor/ppo_kl`` is the mean of its negation unless
    ``ppo_kl`` (a per-token tensor to average instead) is given.
    """
    with torch.no_grad():
        zero = torch.zeros((), device=per_token.device)

        def frac(flags: torch.Tensor | None) -> torch.Tensor:
            return zero if flags is None else masked_mean(at_least_float32(flags), mask)

        kl = -log_ratio if ppo_kl is None else ppo_kl
        return {
            "actor/pg_loss": masked_mean(at_least_float32(per_token.detach()), mask),
            "actor/pg_clipfrac": frac(clipped),
            "actor/pg_clipfrac_lower": frac(clipped_lower),
            "actor/ppo_kl": masked_mean(at_least_float32(kl.detach()), mask),
        }


def masked_inputs(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lp, lp_old)`` with 0 outside ``mask`` (``torch.where``: garbage there gets neither a
    value nor a gradient); ``lp_old`` detached."""
    keep = mask.bool()
    lp = torch.where(keep, logprobs, torch.zeros_like(logprobs))
    old = torch.where(keep, old_logprobs.detach(), torch.zeros_like(lp))
    return lp, old


def weighted_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    loss_agg_mode: str,
    token_count: int | torch.Tensor | None,
    seq_count: int | torch.Tensor | None,
    norm_constant: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the detached importance ``weights`` to a ``(B, T)`` per-token loss, then aggregate.

    Returns ``(loss, per_token)`` with ``per_token`` weighted, for the metrics.
    """
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, mask, loss_agg_mode, token_count=token_count,
                     seq_count=seq_count, norm_constant=norm_constant)
    return loss, per_token
