"""The clipped value-function loss of PPO's critic (verl ``compute_value_loss``)."""

from __future__ import annotations

import torch

from kernels.aggregate import aggregate
from kernels.masked import masked_mean
from kernels.precision import at_least_float32


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    token_count: int | torch.Tensor | None = None,
    seq_count: int | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``0.5 * agg(max((v - R)**2, (clip(v, v_old - c, v_old + c) - R)**2))``; ``(B, T)`` inputs.

    ``values`` are the critic's current predictions (the only input with a gradient),
    ``old_values`` its predictions when the batch was collected, ``returns`` the targets
    (GAE's ``A + V``). Clipping keeps the new prediction within ``c = cliprange_value`` of the
    old one unless that makes the loss smaller, PPO's trust region for the critic. See
    ``kernels.aggregate`` for the aggregation arguments.

    Metrics (detached scalar tensors, token means over ``mask``): ``critic/vf_loss`` (the
    per-token ``0.5 * max(...)``), ``critic/vf_clipfrac`` (fraction where the clipped term is
    the larger) and ``critic/vpred_mean``.
    """
    if not cliprange_value > 0:
        raise ValueError(f"cliprange_value must be > 0, got {cliprange_value}")
    for label, t in (("values", values), ("old_values", old_values), ("returns", returns)):
        if t.shape != mask.shape:
            raise ValueError(f"{label} shape {tuple(t.shape)} != mask shape {tuple(mask.shape)}")
    keep = mask.bool()  # (B, T)
    v = torch.where(keep, values, torch.zeros_like(values))  # (B, T), no gradient to padding
    old = torch.where(keep, old_values.detach(), torch.zeros_like(v))  # (B, T)
    target = torch.where(keep, returns.detach(), torch.zeros_like(v))  # (B, T)
    # clamp(v, old ± c) rather than old + clamp(v - old, ±c): the latter is not bit-equal to v
    # when nothing is clipped, and vf_clipfrac would count such tokens (verl clamps v).
    v_clipped = torch.maximum(torch.minimum(v, old + cliprange_value), old - cliprange_value)
    loss_unclipped = (v - target).square()  # (B, T)
    loss_clipped = (v_clipped - target).square()  # (B, T)
    per_token = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    loss = 0.5 * aggregate(
        per_token,
        mask,
        loss_agg_mode,
        token_count=token_count,
        seq_count=seq_count,
        norm_constant=norm_constant,
    )
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": 0.5 * masked_mean(at_least_float32(per_token), mask),
            "critic/vf_clipfrac": masked_mean(at_least_float32(loss_clipped > loss_unclipped),
                                              mask),
            "critic/vpred_mean": masked_mean(at_least_float32(v), mask),
        }
    return loss, metrics
