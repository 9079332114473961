"""Policy losses by verl name, behind one call: ``policy_loss(name, ...)``.

Every loss takes per-token ``(B, T)`` log-probs of the current policy (the only input with a
gradient), the PPO "old" log-probs, advantages, the 0/1 response mask and optional detached
importance ``weights``, and returns the aggregated scalar loss with detached scalar metrics
under verl's names (``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
``actor/ppo_kl``; the same keys for every loss). Aggregation follows ``kernels.aggregate``:
pass the mini-batch's ``token_count`` / ``seq_count`` when accumulating micro-batches.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from kernels.policy_losses._common import check_shapes
from kernels.policy_losses.cispo import cispo_loss
from kernels.policy_losses.gspo import gspo_loss
from kernels.policy_losses.reinforce import reinforce_loss
from kernels.policy_losses.vanilla import ppo_clip_loss

__all__ = [
    "DEFAULT_AGG_MODES",
    "POLICY_LOSSES",
    "cispo_loss",
    "gspo_loss",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_loss",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": ppo_clip_loss,
    "gspo": gspo_loss,
    "reinforce": reinforce_loss,
    "gpg": reinforce_loss,
    "cispo": cispo_loss,
}

# The aggregation each loss is usually run with (ALGORITHMS.md); the caller still chooses.
DEFAULT_AGG_MODES: dict[str, str] = {
    "vanilla": "token-mean",
    "gspo": "seq-mean-token-mean",
    "reinforce": "token-mean",
    "gpg": "token-mean",
    "cispo": "token-mean",
}


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    loss_agg_mode: str,
    token_count: int | torch.Tensor | None = None,
    seq_count: int | torch.Tensor | None = None,
    norm_constant: float | None = None,
    **kw,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss ``name`` of ``POLICY_LOSSES`` (``vanilla``, ``gspo``, ``reinforce``/``gpg``,
    ``cispo``) and its metrics.

    ``clip_low``/``clip_high`` are the caller's (GSPO's usual ranges are ~1e-4, PPO's 0.2);
    ``reinforce`` ignores them. ``dual_clip`` applies to ``vanilla`` only, the others ignore
    it as verl does. ``kw`` holds options particular to one loss, checked against its
    signature; none of the current losses takes any.
    """
    fn = POLICY_LOSSES.get(name)
    if fn is None:
        raise ValueError(f"unknown policy loss {name!r}; expected one of {tuple(POLICY_LOSSES)}")
    unknown = sorted(set(kw) - set(inspect.signature(fn).parameters))
    if unknown:
        raise ValueError(f"policy loss {name!r} takes no option(s) {unknown}")
    check_shapes(logprobs, old_logprobs, advantages, mask, weights)
    return fn(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        weights=weights,
        loss_agg_mode=loss_agg_mode,
        token_count=token_count,
        seq_count=seq_count,
        norm_constant=norm_constant,
        **kw,
    )
