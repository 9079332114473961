"""Policy losses, behind one call: ``policy_loss(row, ...)``, ``row`` the loss's row of the
config (``algorithm.policy_loss``), which loads its function and holds its options.

Every loss takes per-token ``(B, T)`` log-probs of the current policy (the only input with a
gradient), the PPO "old" log-probs, advantages, the 0/1 response mask and optional detached
importance ``weights``, and returns the aggregated scalar loss with detached scalar metrics
under verl's names (``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
``actor/ppo_kl``; the same keys for every loss). Aggregation follows ``kernels.aggregate``:
pass the mini-batch's ``token_count`` / ``seq_count`` when accumulating micro-batches.

Every loss is checked against verl 0.9.1's (value, gradient and metrics) by
``tests/test_verl_parity.py``; options particular to one loss (``tau_pos``, ``clip_cov_ratio``,
``dro_beta``, ...) are keyword arguments of its function, with verl's names and defaults. Each
loss's module is imported by its row when that loss is chosen, not by this package.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kernels.policy_losses._common import check_shapes

__all__ = ["LossRow", "PolicyLossFn", "policy_loss"]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


class LossRow(Protocol):
    """What this kernel needs of a loss's row (``actors/runtime/config/losses.py``, the one
    registry of the losses): its name, its function and its options under their keyword
    names."""

    @property
    def name(self) -> str: ...

    def load(self) -> PolicyLossFn: ...

    def kernel_options(self) -> dict[str, Any]: ...


def policy_loss(
    loss: LossRow,
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
    """The loss of the row ``loss`` (its function, called with the row's options; a user's own
    loss for ``algorithm.policy_loss = {name = "custom", ...}``) and its metrics.

    ``clip_low``/``clip_high`` are the caller's (verl ``clip_ratio_low/high``; GSPO's usual
    ranges are ~1e-4, PPO's 0.2, GMPO's 0.4; DPPO reads them as divergence thresholds); losses
    without a clip ignore them. ``dual_clip`` is verl's ``clip_ratio_c``: the dual clip of
    ``vanilla`` (and ``bypass_mode`` with ``ppo_clip``), the ratio cap of ``dppo_*``; the
    others ignore it as verl does. The options particular to one loss (``tau_pos``,
    ``clip_cov_ratio``, ``dro_beta``, ...) are its row's fields; ``kw`` holds those the caller
    adds (``bypass_mode``'s: the correction's ``loss_type``, ``rollout_is``, ...). All are
    checked against the function's signature.
    """
    fn = loss.load()
    options = loss.kernel_options()
    if twice := sorted(set(options) & set(kw)):
        raise ValueError(f"policy loss {loss.name!r}: option(s) {twice} given by its row and "
                         "by the caller")
    options.update(kw)
    takes = inspect.signature(fn).parameters
    unknown = sorted(set(options) - set(takes))
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values()):
        raise ValueError(f"policy loss {loss.name!r} takes no option(s) {unknown}")
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
        **options,
    )
