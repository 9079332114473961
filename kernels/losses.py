"""Loss aggregation and the PPO clipped policy loss (verl ``vanilla``, AReaL decoupled PPO).

A learner step usually splits its mini-batch into micro-batches and accumulates gradients. For
the sum of micro-batch losses to equal the loss of the whole mini-batch, each micro-batch must
divide by the mini-batch's normaliser, not its own: pass ``token_count`` (response tokens in the
whole mini-batch) for ``token-mean``, ``seq_count`` (sequences with at least one response token
in the whole mini-batch) for the ``seq-mean-*`` modes. Left out, the normaliser is taken from
the micro-batch itself, which is right only when there is a single micro-batch.
"""

from __future__ import annotations

import torch

from kernels.masked import masked_mean, masked_sum

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# exp() of a log-ratio beyond this is treated as this; keeps ratios finite (verl uses 20).
LOG_RATIO_BOUND = 20.0


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    token_count: int | torch.Tensor | None = None,
    seq_count: int | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``(B, T)`` over the 0/1 ``mask`` ``(B, T)`` to a scalar.

    Modes (verl ``loss_agg_mode``):

    - ``token-mean``: ``sum(loss over masked tokens) / token_count`` (default: the mask's sum).
    - ``seq-mean-token-sum``: each sequence's token sum, averaged over sequences.
    - ``seq-mean-token-mean``: each sequence's token mean, averaged over sequences.
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): each sequence's token sum divided by
      ``norm_constant``, averaged over sequences. ``norm_constant`` defaults to ``T``, but it
      should be a constant such as the maximum response length, or the loss scale drifts with
      the padding of each micro-batch.

    Sequences are averaged over ``seq_count``, by default the number of rows holding at least
    one masked token (all-padding rows do not dilute the mean). A zero normaliser gives a zero
    loss instead of NaN. See the module docstring for micro-batching.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(
            f"loss_mat shape {tuple(loss_mat.shape)} != mask shape {tuple(mask.shape)}"
        )
    if mode == "token-mean":
        count = mask.bool().sum() if token_count is None else token_count
        return masked_sum(loss_mat, mask) / _at_least_one(count)
    seq_tokens = mask.bool().sum(-1)  # (B,)
    seq_sums = masked_sum(loss_mat, mask, dim=-1)  # (B,)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sums
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sums / seq_tokens.clamp_min(1)
    elif mode == "seq-mean-token-sum-norm":
        constant = loss_mat.shape[-1] if norm_constant is None else norm_constant
        if not constant > 0:
            raise ValueError(f"norm_constant must be > 0, got {norm_constant}")
        per_seq = seq_sums / constant
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {AGG_MODES}")
    count = (seq_tokens > 0).sum() if seq_count is None else seq_count
    return per_seq.sum() / _at_least_one(count)


def _at_least_one(count: int | torch.Tensor) -> int | torch.Tensor:
    if isinstance(count, torch.Tensor):
        return count.clamp_min(1)
    return max(count, 1)


def ppo_clip_loss(
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
    """PPO clipped surrogate loss and its metrics; every tensor argument is ``(B, T)``.

    ``ratio = exp(clamp(logprobs - old_logprobs, -20, 20))`` and the per-token loss is
    ``max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``. Setting
    ``clip_high > clip_low`` gives DAPO's clip-higher. With ``dual_clip = c`` (``c > 1``) the
    loss of tokens with ``A < 0`` is further capped at ``-A * c``, so a huge ratio on a bad
    token cannot dominate the step.

    ``weights`` are per-token importance weights (for AReaL's decoupled PPO, the behaviour
    weight ``pi_old / mu`` from ``kernels.importance``); they are detached and multiply the
    per-token loss before aggregation. Only ``logprobs`` should carry a gradient.

    Returns the aggregated loss (see ``aggregate`` for ``loss_agg_mode``, ``token_count``,
    ``seq_count``, ``norm_constant``) and detached scalar metrics, each a token mean over this
    call's mask:

    - ``actor/pg_loss``: the per-token loss (weights applied).
    - ``actor/pg_clipfrac``: fraction of tokens where the clipped branch is the larger one.
    - ``actor/pg_clipfrac_lower``: fraction where the dual clip is active (0 without it).
    - ``actor/ppo_kl``: mean of ``old_logprobs - logprobs``.
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(
            f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
            f"clip_high={clip_high}"
        )
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    per_token = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    clipped = loss_clipped > loss_unclipped  # (B, T)
    if dual_clip is not None:
        loss_dual = -advantages * dual_clip  # (B, T)
        negative = advantages < 0
        dual_active = negative & (per_token > loss_dual)  # (B, T)
        per_token = torch.where(negative, torch.minimum(per_token, loss_dual), per_token)
    else:
        dual_active = torch.zeros_like(clipped)
    if weights is not None:
        per_token = per_token * weights.detach()

    loss = aggregate(
        per_token,
        mask,
        loss_agg_mode,
        token_count=token_count,
        seq_count=seq_count,
        norm_constant=norm_constant,
    )
    with torch.no_grad():
        metrics = {
            "actor/pg_loss": masked_mean(per_token.float(), mask),
            "actor/pg_clipfrac": masked_mean(clipped.float(), mask),
            "actor/pg_clipfrac_lower": masked_mean(dual_active.float(), mask),
            "actor/ppo_kl": masked_mean(-log_ratio.float(), mask),
        }
    return loss, metrics
