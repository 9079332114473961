"""Checks and metrics shared by the policy losses."""

from __future__ import annotations

import torch

from kernels.aggregate import aggregate
from kernels.masked import masked_mean


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
) -> dict[str, torch.Tensor]:
    """verl's actor metrics as detached scalar tensors, each a token mean over ``mask``.

    ``clipped`` is the per-token clip indicator (None: the loss never clips). ``log_ratio`` is
    ``logprobs - old_logprobs``; ``actor/ppo_kl`` is the mean of its negation. The dual clip
    exists only in ``vanilla``, so ``actor/pg_clipfrac_lower`` is 0 here.
    """
    with torch.no_grad():
        zero = torch.zeros((), device=per_token.device)
        return {
            "actor/pg_loss": masked_mean(per_token.detach().float(), mask),
            "actor/pg_clipfrac": zero if clipped is None else masked_mean(clipped.float(), mask),
            "actor/pg_clipfrac_lower": zero,
            "actor/ppo_kl": masked_mean(-log_ratio.detach().float(), mask),
        }


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
