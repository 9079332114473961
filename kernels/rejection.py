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
(``kernels.rejection_metrics``) are verl's ``rollout_corr/rollout_rs_*``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.masked import masked_mean, masked_sum
from kernels.ratios import masked_log_ratio
from kernels.rejection_metrics import rule_metrics

RS_STATISTICS = ("ratio", "geo_mean", "k1", "k2", "k3")
RS_LEVELS = ("token", "sequence")
RS_REDUCTIONS = ("mean", "sum", "max")


@dataclass(frozen=True)
class RejectionRule:
    """Keep tokens (``level="token"``) or whole sequences (``"sequence"``) whose ``statistic``
    lies in ``[low, high]``; ``None`` leaves that side open. See the module docstring for the
    statistics and ``reduce``. Bounds of ``ratio`` and ``geo_mean`` are ratios (so
    ``low >= 0``); bounds of ``k1``/``k2``/``k3`` are values of the KL statistic itself.
    """

    statistic: str
    level: str
    low: float | None = None
    high: float | None = None
    reduce: str = "mean"
    """Sequence level, k1/k2/k3: how token statistics become the sequence's (mean, sum, max)."""

    def __post_init__(self) -> None:
        if self.statistic not in RS_STATISTICS:
            raise ValueError(
                f"unknown rejection statistic {self.statistic!r}; expected one of {RS_STATISTICS}"
            )
        if self.level not in RS_LEVELS:
            raise ValueError(f"unknown rejection level {self.level!r}; expected one of {RS_LEVELS}")
        if self.reduce not in RS_REDUCTIONS:
            raise ValueError(
                f"unknown rejection reduce {self.reduce!r}; expected one of {RS_REDUCTIONS}"
            )
        if self.reduce != "mean" and (self.level != "sequence" or self.statistic in ("ratio",
                                                                                   "geo_mean")):
            raise ValueError(
                f"reduce={self.reduce!r} applies to k1/k2/k3 at sequence level, not "
                f"{self.statistic} at {self.level} level"
            )
        if self.statistic == "geo_mean" and self.level != "sequence":
            raise ValueError(f"geo_mean is a sequence statistic, got level {self.level!r}")
        if self.low is None and self.high is None:
            raise ValueError(f"rejection rule {self.name} needs low or high, got neither")
        for side in ("low", "high"):
            bound = getattr(self, side)
            if bound is not None and math.isnan(bound):
                raise ValueError(f"rejection rule {self.name}: {side} is NaN")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"rejection rule {self.name}: low {self.low} > high {self.high}")
        if self.statistic in ("ratio", "geo_mean") and self.low is not None and self.low < 0:
            raise ValueError(
                f"rejection rule {self.name}: a ratio bound low must be >= 0, got {self.low}"
            )

    @property
    def name(self) -> str:
        """The stem of this rule's metric names: verl's option name for a KL rule
        (``token_k3``, ``seq_sum_k2``, ...), else ``ratio_token``, ``ratio_sequence`` or
        ``geo_mean_sequence``."""
        if self.statistic in ("ratio", "geo_mean"):
            return f"{self.statistic}_{self.level}"
        if self.level == "token":
            return f"token_{self.statistic}"
        return f"seq_{self.reduce}_{self.statistic}"


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


def parse_rs_preset(options: str, thresholds: str | float) -> list[RejectionRule]:
    """Rules from verl's ``rollout_rs`` / ``rollout_rs_threshold`` strings, as verl reads them.

    ``options`` is a comma-separated list (repeats dropped, as verl does); ``thresholds`` gives
    one entry per option, or one shared by all. Options:

    - ``token_k1``, ``seq_sum_k1``, ``seq_mean_k1``: the k1 statistic (``-log rho``; summed or
      averaged over the sequence) kept in ``[log lower, log upper]`` for a threshold
      ``"lower_upper"``; a single number ``u`` means ``lower = 1/u``. verl's documentation
      calls these ratio bounds, but its code bounds ``exp(k1) = 1/rho``; this follows the
      code, and the two agree whenever ``lower = 1/upper`` (every verl preset, e.g.
      ``seq_sum_k1`` with ``"0.5_2.0"``).
    - ``token_k2|k3``, ``seq_sum_k2|k3``, ``seq_mean_k2|k3``, ``seq_max_k2|k3``: an upper
      bound on the KL statistic (e.g. ``seq_mean_k3`` with ``0.01``).
    """
    names = list(dict.fromkeys(part.strip() for part in options.split(",") if part.strip()))
    if not names:
        raise ValueError(f"rollout_rs options must name at least one option, got {options!r}")
    if isinstance(thresholds, str):
        specs = [part.strip() for part in thresholds.split(",") if part.strip()]
    else:
        specs = [str(thresholds)]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(
            f"rollout_rs_threshold {thresholds!r} has {len(specs)} entries for {len(names)} options"
        )
    return [_preset_rule(name, spec) for name, spec in zip(names, specs, strict=True)]


_PRESETS = {
    "token_k1": ("k1", "token", "mean"),
    "token_k2": ("k2", "token", "mean"),
    "token_k3": ("k3", "token", "mean"),
    "seq_sum_k1": ("k1", "sequence", "sum"),
    "seq_sum_k2": ("k2", "sequence", "sum"),
    "seq_sum_k3": ("k3", "sequence", "sum"),
    "seq_mean_k1": ("k1", "sequence", "mean"),
    "seq_mean_k2": ("k2", "sequence", "mean"),
    "seq_mean_k3": ("k3", "sequence", "mean"),
    "seq_max_k2": ("k2", "sequence", "max"),
    "seq_max_k3": ("k3", "sequence", "max"),
}


def _preset_rule(name: str, spec: str) -> RejectionRule:
    if name not in _PRESETS:
        raise ValueError(f"unsupported rollout_rs option {name!r}; expected one of "
                         f"{sorted(_PRESETS)}")
    statistic, level, reduce = _PRESETS[name]
    if statistic == "k1":
        low_text, sep, high_text = spec.partition("_")
        try:
            high = float(high_text if sep else low_text)
            low = float(low_text) if sep else 1.0 / high
        except (ValueError, ZeroDivisionError):
            raise ValueError(
                f"bad threshold {spec!r} for {name}; expected 'low_high' or a number > 0"
            ) from None
        if not (high > 0 and low > 0):
            raise ValueError(f"thresholds of {name} must be > 0, got {spec!r}")
        if low > high:
            raise ValueError(f"thresholds of {name} must have lower <= upper, got {spec!r}")
        return RejectionRule(statistic, level, math.log(low), math.log(high), reduce)
    if "_" in spec:
        raise ValueError(f"threshold of {name} is a single upper bound, got {spec!r}")
    try:
        high = float(spec)
    except ValueError:
        raise ValueError(f"bad threshold {spec!r} for {name}; expected one number") from None
    if not high > 0:
        raise ValueError(f"threshold of {name} must be > 0, got {spec!r}")
    return RejectionRule(statistic, level, None, high, reduce)
