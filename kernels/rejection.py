"""Masked importance sampling / rejection (IcePop, verl ``rollout_rs``): drop, don't clip.

Where truncated IS caps the weight of a token whose behaviour policy mu and proximal policy
pi_old disagree, rejection removes the token (or its whole sequence) from the loss by setting
its mask to 0. Every statistic is a function of the per-token log-ratio
``log rho = clamp(lp_old - lp_behav, ±20)`` over the response tokens:

- ``k1 = -log rho``, ``k2 = (log rho)**2 / 2``, ``k3 = rho - 1 - log rho``: Schulman's
  estimators of KL(mu || pi_old) for tokens sampled from mu (verl's ``token_k*``; ``k3`` is
  the ``rollout_corr/k3_kl`` of ``kernels.offpolicy``). k1 has either sign, k2 and k3 are
  >= 0. At sequence level each is reduced over the sequence's masked tokens by ``reduce``:
  ``mean`` (verl ``seq_mean_k*``), ``sum`` (``seq_sum_k*``) or ``max`` (``seq_max_k*``).
- ``ratio``: ``rho_t`` at token level; the sequence ratio ``exp(sum_t log rho_t)`` at
  sequence level. ``geo_mean`` (sequence level only): the geometric mean
  ``exp(mean_t log rho_t)``, which does not drift with length as the product does. Their
  bounds are ratios, compared in log space.

A rule keeps what lies in ``[low, high]``; a statistic that is NaN is rejected. The metrics
(``kernels.rejection_metrics``) are verl's ``rollout_corr/rollout_rs_*``. The rules and
verl's option strings (``RejectionRule``, ``parse_rs_preset``) live in the torch-free
``kernels.rollout_options``.
"""

from __future__ import annotations

import math

import torch

from kernels.masked import masked_mean, masked_sum
from kernels.ratios import masked_log_ratio
from kernels.rejection_metrics import rule_metrics
from kernels.rollout_options import RejectionRule

__all__ = ["rejection_mask"]


def rejection_mask(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    rules: list[RejectionRule] | tuple[RejectionRule, ...],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The response ``mask`` ``(B, T)`` with every token that some rule rejects set to 0.

    Rules combine with AND: a token is kept only if every rule keeps it (a sequence rule keeps
    or drops all tokens of its sequence). The result has ``mask``'s dtype and never adds a
    token that ``mask`` lacks. Nothing here carries a gradient.

    Metrics are verl's, Python floats (every one 0.0 on an empty mask, where verl raises):

    - ``rollout_corr/rollout_rs_masked_fraction``: fraction of the masked tokens removed.
    - ``rollout_corr/rollout_rs_seq_masked_fraction``: fraction of the rows that lost at least
      one token, over every row of the batch (rows without a response token count, as 0).
    - per rule, ``rollout_corr/rollout_rs_{rule.name}_*``: see ``rule_metrics``.

    Two rules with the same name would share metric names: that is an error.
    """
    if old_logprobs.shape != mask.shape or behaviour_logprobs.shape != mask.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)}, behaviour_logprobs "
            f"{tuple(behaviour_logprobs.shape)} and mask {tuple(mask.shape)} must share a shape"
        )
    for rule in rules:
        if not isinstance(rule, RejectionRule):
            raise ValueError(f"rules must be RejectionRule instances, got {rule!r}")
    names = [rule.name for rule in rules]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"two rejection rules for {name}; merge their bounds")
    with torch.no_grad():
        valid = mask.bool()  # (B, T)
        log_rho = masked_log_ratio(old_logprobs, behaviour_logprobs, mask)  # (B, T)
        keep = valid.clone()  # (B, T)
        metrics: dict[str, float] = {}
        for rule in rules:
            stat, low, high = _statistic(rule, log_rho, mask)  # (B, T) or (B,)
            rule_keep = (stat >= low) & (stat <= high)
            token_keep = rule_keep if rule.level == "token" else rule_keep[:, None].expand_as(valid)
            keep &= token_keep
            floor = 0.0 if rule.statistic in ("k2", "k3") and low == -math.inf else low
            metrics.update(rule_metrics(rule.name, stat, token_keep, mask, low=low, high=high,
                                        floor=floor))
        removed = valid & ~keep  # (B, T)
        if valid.any():
            metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(
                removed.to(log_rho.dtype), mask).item()
            metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = (
                removed.any(-1).to(log_rho.dtype).mean().item())
        else:
            metrics["rollout_corr/rollout_rs_masked_fraction"] = 0.0
            metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = 0.0
    return keep.to(mask.dtype), metrics


def _statistic(
    rule: RejectionRule, log_rho: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, float, float]:
    """The rule's statistic, ``(B, T)`` or ``(B,)``, and its bounds in the same space.

    Ratios are compared in log space (``log rho`` vs ``log low``), so a sequence ratio far
    beyond ``exp(20)`` is still judged exactly.
    """
    low = -math.inf if rule.low is None else rule.low
    high = math.inf if rule.high is None else rule.high
    if rule.statistic in ("ratio", "geo_mean"):
        low = math.log(low) if low > 0 else -math.inf
        high = math.log(high) if high > 0 else -math.inf
        if rule.level == "token":
            return log_rho, low, high
        if rule.statistic == "ratio":
            return masked_sum(log_rho, mask, dim=-1), low, high
        return masked_mean(log_rho, mask, dim=-1), low, high
    if rule.statistic == "k1":
        per_token = -log_rho
    elif rule.statistic == "k2":
        per_token = 0.5 * log_rho.square()
    else:
        per_token = torch.expm1(log_rho) - log_rho
    if rule.level == "token":
        return per_token, low, high
    if rule.reduce == "sum":
        return masked_sum(per_token, mask, dim=-1), low, high
    if rule.reduce == "max":
        most = torch.where(mask.bool(), per_token, torch.full_like(per_token, -math.inf)).amax(-1)
        return torch.where(torch.isinf(most) & (most < 0), torch.zeros_like(most), most), low, high
    return masked_mean(per_token, mask, dim=-1), low, high
