"""verl's ``bypass_mode`` loss: the behaviour log-probs serve as the PPO old log-probs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kernels.policy_losses.reinforce import reinforce_loss
from kernels.policy_losses.vanilla import ppo_clip_loss
from kernels.rollout_corr import rollout_correction
from kernels.rollout_options import RejectionRule

BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


def bypass_mode_loss(
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
    loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | tuple[float, float] = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | Sequence[RejectionRule] | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """verl ``bypass_mode``: ``old_logprobs`` are the behaviour (rollout) log-probs mu; every
    tensor argument is ``(B, T)``.

    First ``kernels.rollout_corr.rollout_correction`` runs on the current policy against mu
    (``lp.detach()`` vs ``old_logprobs``) with the ``rollout_*`` options (verl's
    ``rollout_correction`` names and defaults); its rejection mask replaces ``mask``. Then:

    - ``loss_type="ppo_clip"`` (verl's default): ``ppo_clip_loss`` on ``pi_theta / mu``,
      without IS weights (the clipped ratio already is the correction).
    - ``loss_type="reinforce"``: ``reinforce_loss`` ``-w * A * lp`` with the IS weights ``w``
      of ``rollout_is`` (none when it is None).

    ``weights`` must be None: bypass mode computes its own. The metrics are the loss's plus the
    ``rollout_corr/`` family (Python floats). Note that verl's ``vanilla`` always applies its
    dual clip (``clip_ratio_c``, 3.0 by default); here ``dual_clip`` None means none.
    """
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"unknown bypass loss_type {loss_type!r}; expected one of "
                         f"{BYPASS_LOSS_TYPES}")
    if weights is not None:
        raise ValueError("bypass_mode computes its own IS weights; pass weights=None")
    corr = rollout_correction(
        logprobs.detach(), old_logprobs, mask, rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
    )
    counts: dict[str, Any] = dict(loss_agg_mode=loss_agg_mode, token_count=token_count,
                                  seq_count=seq_count, norm_constant=norm_constant)
    if loss_type == "reinforce":
        loss, metrics = reinforce_loss(logprobs, old_logprobs, advantages, corr.keep,
                                       weights=corr.weights, **counts)
    else:
        loss, metrics = ppo_clip_loss(logprobs, old_logprobs, advantages, corr.keep,
                                      clip_low=clip_low, clip_high=clip_high,
                                      dual_clip=dual_clip, **counts)
    return loss, {**metrics, **corr.metrics}
