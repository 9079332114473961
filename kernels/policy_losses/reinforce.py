"""REINFORCE / GPG: the plain policy gradient ``-A * lp``, no ratio and no clipping."""

from __future__ import annotations

import torch

from kernels.policy_losses._common import masked_inputs, pg_metrics, weighted_loss


def reinforce_loss(
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
    """Per-token loss ``-A * lp`` (times ``weights``, detached), aggregated; ``(B, T)`` inputs.

    verl ``gpg`` and the REINFORCE loss of PipelineRL and verl's bypass mode. Its gradient is
    ``-A * w * grad lp``, which equals PPO's at ratio 1. Off-policy data needs importance
    weights (e.g. truncated ``pi_theta/mu``) passed as ``weights``: nothing else corrects for
    it. The clip arguments are accepted for a uniform signature and ignored; ``old_logprobs``
    only feeds ``actor/ppo_kl``. The loss value is not a surrogate objective (it depends on
    the scale of ``lp``); ``actor/pg_loss`` reports it as is, ``actor/pg_clipfrac`` is 0.
    """
    del clip_low, clip_high, dual_clip  # no ratio to clip
    lp, old = masked_inputs(logprobs, old_logprobs, mask)  # (B, T) each
    per_token = -advantages * lp  # (B, T)
    loss, per_token = weighted_loss(per_token, mask, weights, loss_agg_mode, token_count, seq_count,
                                  norm_constant)
    return loss, pg_metrics(per_token, mask, None, lp - old)
