"""Policy losses by verl name, behind one call: ``policy_loss(name, ...)``.

Every loss takes per-token ``(B, T)`` log-probs of the current policy (the only input with a
gradient), the PPO "old" log-probs, advantages, the 0/1 response mask and optional detached
importance ``weights``, and returns the aggregated scalar loss with detached scalar metrics
under verl's names (``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
``actor/ppo_kl``; the same keys for every loss). Aggregation follows ``kernels.aggregate``:
pass the mini-batch's ``token_count`` / ``seq_count`` when accumulating micro-batches.

Every loss is checked against verl 0.9.1's (value, gradient and metrics) by
``tests/test_verl_parity.py``; options particular to one loss (``tau_pos``, ``clip_cov_ratio``,
``dro_beta``, ...) are keyword arguments of its function, with verl's names and defaults.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from kernels.policy_losses._common import check_shapes
from kernels.policy_losses.bypass import bypass_mode_loss
from kernels.policy_losses.cispo import cispo_loss
from kernels.policy_losses.clip_cov import clip_cov_loss
from kernels.policy_losses.dppo import dppo_kl_loss, dppo_tv_loss
from kernels.policy_losses.dro import dro_loss
from kernels.policy_losses.geo_mean import geo_mean_loss
from kernels.policy_losses.gspo import gspo_loss
from kernels.policy_losses.kl_cov import kl_cov_loss
from kernels.policy_losses.reinforce import reinforce_loss
from kernels.policy_losses.sapo import sapo_loss
from kernels.policy_losses.vanilla import ppo_clip_loss

__all__ = [
    "DEFAULT_AGG_MODES",
    "POLICY_LOSSES",
    "bypass_mode_loss",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "geo_mean_loss",
    "gspo_loss",
    "kl_cov_loss",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_loss",
    "sapo_loss",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": ppo_clip_loss,
    "gspo": gspo_loss,
    "reinforce": reinforce_loss,
    "gpg": reinforce_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "geo_mean": geo_mean_loss,
    "clip_cov": clip_cov_loss,
    "kl_cov": kl_cov_loss,
    "dppo_tv": dppo_tv_loss,
    "dppo_kl": dppo_kl_loss,
    "dro": dro_loss,
    "bypass_mode": bypass_mode_loss,
}

# The aggregation each loss is usually run with (ALGORITHMS.md, verl); the caller still
# chooses. verl forces seq-mean-token-mean on sapo; geo_mean ignores the mode (a mean over
# sequences).
DEFAULT_AGG_MODES: dict[str, str] = {
    "vanilla": "token-mean",
    "gspo": "seq-mean-token-mean",
    "reinforce": "token-mean",
    "gpg": "token-mean",
    "cispo": "token-mean",
    "sapo": "seq-mean-token-mean",
    "geo_mean": "token-mean",
    "clip_cov": "token-mean",
    "kl_cov": "token-mean",
    "dppo_tv": "token-mean",
    "dppo_kl": "token-mean",
    "dro": "token-mean",
    "bypass_mode": "token-mean",
}


def policy_loss(
    name: str | PolicyLossFn,
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
    """The loss ``name`` of ``POLICY_LOSSES`` (or a function called as they are: a user's own
    loss, ``algorithm.policy_loss = {name = "custom"}``) and its metrics.

    ``clip_low``/``clip_high`` are the caller's (verl ``clip_ratio_low/high``; GSPO's usual
    ranges are ~1e-4, PPO's 0.2, GMPO's 0.4; DPPO reads them as divergence thresholds); losses
    without a clip ignore them. ``dual_clip`` is verl's ``clip_ratio_c``: the dual clip of
    ``vanilla`` (and ``bypass_mode`` with ``ppo_clip``), the ratio cap of ``dppo_*``; the
    others ignore it as verl does. ``kw`` holds options particular to one loss (``tau_pos``,
    ``clip_cov_ratio``, ``kl_cov_ratio``, ``ppo_kl_coef``, ``dro_beta``, ``loss_type``,
    ``rollout_is``, ...), checked against its signature.
    """
    fn = name if callable(name) else POLICY_LOSSES.get(name)
    if fn is None:
        raise ValueError(f"unknown policy loss {name!r}; expected one of {tuple(POLICY_LOSSES)}")
    takes = inspect.signature(fn).parameters
    unknown = sorted(set(kw) - set(takes))
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values()):
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
