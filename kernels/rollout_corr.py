"""verl's rollout correction in one call: IS weights, rejection mask and metrics together.

``rollout_correction`` is verl 0.9.1's ``compute_rollout_correction_and_rejection_mask`` built
from this package's parts (``truncated_is_weights``, ``rejection_mask``,
``offpolicy_metrics``), with verl's option strings and metric names. Like verl it computes the
weights, the rejection and the metrics each on the original response mask; the caller applies
both (the loss uses ``keep`` as its mask and ``weights`` as per-token weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.importance import truncated_is_weights
from kernels.offpolicy import offpolicy_metrics
from kernels.rejection import rejection_mask
from kernels.rollout_options import RejectionRule, parse_is_threshold, parse_rs_preset


@dataclass(frozen=True)
class RolloutCorrection:
    """What ``rollout_correction`` returns."""

    weights: torch.Tensor | None
    """``(B, T)`` detached IS weights, 0 outside the mask; None when ``rollout_is`` is None."""
    keep: torch.Tensor
    """``(B, T)`` the response mask after rejection, in the mask's dtype."""
    metrics: dict[str, float]
    """verl's ``rollout_corr/`` metrics (plus ``rollout_corr/is_clip_frac``, see
    ``truncated_is_weights``)."""


def rollout_correction(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | tuple[float, float] = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | Sequence[RejectionRule] | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> RolloutCorrection:
    """IS weights of pi_old over mu, the rejection mask, and every verl ``rollout_corr/`` metric.

    Options carry verl's ``algorithm.rollout_correction`` names and defaults:

    - ``rollout_is``: ``"token"``, ``"sequence"`` or None (no weights).
    - ``rollout_is_threshold``: a cap (truncated IS), or ``"lower_upper"`` or a pair
      ``(lower, upper)`` (IcePop: weights outside the band are 0); see ``parse_is_threshold``.
    - ``rollout_is_batch_normalize``: rescale the weights to mean 1.
    - ``rollout_rs``: verl's comma-separated options (``"token_k1,seq_max_k3"``, see
      ``parse_rs_preset``) with ``rollout_rs_threshold``, or a list of ``RejectionRule``
      (the threshold is then unused); None: no rejection.

    ``old_logprobs``, ``behaviour_logprobs`` and ``mask`` are ``(B, T)``; nothing here carries
    a gradient.
    """
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        upper, lower = parse_is_threshold(rollout_is_threshold)
        weights, is_metrics = truncated_is_weights(
            old_logprobs, behaviour_logprobs, mask, cap=upper, lower=lower, level=rollout_is,
            normalize=rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    keep = mask
    if rollout_rs is not None:
        if isinstance(rollout_rs, str):
            if rollout_rs_threshold is None:
                raise ValueError("rollout_rs_threshold is needed with rollout_rs options")
            rules = parse_rs_preset(rollout_rs, rollout_rs_threshold)
        else:
            rules = list(rollout_rs)
        keep, rs_metrics = rejection_mask(old_logprobs, behaviour_logprobs, mask, rules)
        metrics.update(rs_metrics)
    metrics.update(offpolicy_metrics(old_logprobs, behaviour_logprobs, mask))
    return RolloutCorrection(weights, keep, metrics)
