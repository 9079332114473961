"""Masked importance sampling / rejection (IcePop, verl ``rollout_rs``): drop, don't clip.

Where truncated IS caps the weight of a token whose behaviour policy mu and proximal policy
pi_old disagree, rejection removes the token (or its whole sequence) from the loss by setting
its mask to 0. Every statistic is a function of the per-token log-ratio
``log rho = clamp(lp_old - lp_behav, ±20)`` over the response tokens:

- ``ratio``: ``rho_t`` at token level; the sequence ratio ``exp(sum_t log rho_t)`` at
  sequence level.
- ``geo_mean`` (sequence level only): the geometric mean ``exp(mean_t log rho_t)``, which does
  not drift with length as the product does.
- ``k1 = -log rho``, ``k2 = (log rho)**2 / 2``, ``k3 = rho - 1 - log rho``: Schulman's
  estimators of KL(mu || pi_old) for tokens sampled from mu (verl's ``token_k*``; ``k3`` is
  the ``rollout_corr/k3_kl`` of ``mismatch_metrics``). k1 has either sign, k2 and k3 are >= 0.
  At sequence level each is the mean over the sequence's masked tokens (verl ``seq_mean_k*``).

A rule keeps what lies in ``[low, high]``; a statistic that is NaN is rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.masked import masked_mean, masked_sum
from kernels.ratios import masked_log_ratio

RS_STATISTICS = ("ratio", "geo_mean", "k1", "k2", "k3")
RS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class RejectionRule:
    """Keep tokens (``level="token"``) or whole sequences (``"sequence"``) whose ``statistic``
    lies in ``[low, high]``; ``None`` leaves that side open. See the module docstring for the
    statistics. Bounds of ``ratio`` and ``geo_mean`` are ratios (so ``low >= 0``); bounds of
    ``k1``/``k2``/``k3`` are values of the KL statistic itself.
    """

    statistic: str
    level: str
    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        if self.statistic not in RS_STATISTICS:
            raise ValueError(
                f"unknown rejection statistic {self.statistic!r}; expected one of {RS_STATISTICS}"
            )
        if self.level not in RS_LEVELS:
            raise ValueError(f"unknown rejection level {self.level!r}; expected one of {RS_LEVELS}")
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
        """``{statistic}_{level}``, the stem of this rule's metric names."""
        return f"{self.statistic}_{self.level}"


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

    Metrics, Python floats under verl's ``rollout_corr/`` prefix (0.0 on an empty mask):

    - ``rollout_corr/rs_masked_frac_token``: fraction of the masked tokens that were removed.
    - ``rollout_corr/rs_masked_frac_seq``: fraction of the sequences with at least one masked
      token that lost at least one token (for sequence rules alone: sequences dropped).
    - per rule, ``rollout_corr/{statistic}_{level}_frac_low`` and ``..._frac_high``: the
      fraction of masked tokens (token rules) or of sequences (sequence rules) whose statistic
      lies below ``low`` / above ``high``.

    Two rules with the same statistic and level would share metric names: that is an error.
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
        seqs = valid.any(-1)  # (B,) rows with at least one response token
        log_rho = masked_log_ratio(old_logprobs, behaviour_logprobs, mask)  # (B, T)
        keep = valid.clone()  # (B, T)
        fractions = []
        for rule in rules:
            stat, low, high = _statistic(rule, log_rho, mask)  # (B, T) or (B,)
            rule_keep = (stat >= low) & (stat <= high)
            below, above = (stat < low).float(), (stat > high).float()
            if rule.level == "token":
                keep &= rule_keep
                fractions += [masked_mean(below, mask), masked_mean(above, mask)]
            else:
                keep &= rule_keep[:, None]
                fractions += [masked_mean(below, seqs), masked_mean(above, seqs)]
        removed = valid & ~keep  # (B, T)
        frac_token = masked_mean(removed.float(), mask)
        frac_seq = masked_mean(removed.any(-1).float(), seqs)
        values = torch.stack([frac_token, frac_seq, *fractions]).tolist()  # one device sync
    keys = ["rollout_corr/rs_masked_frac_token", "rollout_corr/rs_masked_frac_seq"]
    for name in names:
        keys += [f"rollout_corr/{name}_frac_low", f"rollout_corr/{name}_frac_high"]
    return keep.to(mask.dtype), dict(zip(keys, values, strict=True))


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
    return masked_mean(per_token, mask, dim=-1), low, high


def parse_rs_preset(options: str, thresholds: str | float) -> list[RejectionRule]:
    """Rules from verl's ``rollout_rs`` / ``rollout_rs_threshold`` strings.

    ``options`` is a comma-separated list; ``thresholds`` gives one entry per option, or one
    shared by all. Supported options and their rules:

    - ``token_k1``, ``seq_sum_k1``, ``seq_mean_k1``: ratio bounds ``"low_high"`` on the token
      ratio, the sequence ratio and the geometric mean respectively; a single number ``u``
      means ``[1/u, u]``. E.g. ``seq_sum_k1`` with ``"0.5_2.0"``, ``seq_mean_k1`` with
      ``"0.999_1.001"``.
    - ``token_k2``, ``token_k3``, ``seq_mean_k2``, ``seq_mean_k3``: an upper bound on the KL
      statistic (e.g. ``seq_mean_k3`` with ``0.01``).

    verl applies k1 bounds to ``exp(k1) = 1/rho``; read as ratio bounds, as its documentation
    states, they agree whenever ``low = 1/high`` (every preset above). verl's ``seq_sum_k2/k3``
    and ``seq_max_k2/k3`` have no rule here and are rejected.
    """
    names = [part.strip() for part in options.split(",") if part.strip()]
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


_K1_PRESETS = {
    "token_k1": ("ratio", "token"),
    "seq_sum_k1": ("ratio", "sequence"),
    "seq_mean_k1": ("geo_mean", "sequence"),
}
_KL_PRESETS = {
    "token_k2": ("k2", "token"),
    "token_k3": ("k3", "token"),
    "seq_mean_k2": ("k2", "sequence"),
    "seq_mean_k3": ("k3", "sequence"),
}


def _preset_rule(name: str, spec: str) -> RejectionRule:
    if name in _K1_PRESETS:
        low_text, sep, high_text = spec.partition("_")
        try:
            high = float(high_text if sep else low_text)
            low = float(low_text) if sep else None
        except ValueError:
            raise ValueError(
                f"bad threshold {spec!r} for {name}; expected 'low_high' or a number"
            ) from None
        if not high > 0 or (low is not None and not low > 0):
            raise ValueError(f"thresholds of {name} must be > 0, got {spec!r}")
        statistic, level = _K1_PRESETS[name]
        return RejectionRule(statistic, level, 1.0 / high if low is None else low, high)
    if name in _KL_PRESETS:
        try:
            high = float(spec)
        except ValueError:
            raise ValueError(f"bad threshold {spec!r} for {name}; expected one number") from None
        if not high > 0:
            raise ValueError(f"threshold of {name} must be > 0, got {spec!r}")
        statistic, level = _KL_PRESETS[name]
        return RejectionRule(statistic, level, None, high)
    supported = sorted([*_K1_PRESETS, *_KL_PRESETS])
    raise ValueError(f"unsupported rollout_rs option {name!r}; expected one of {supported}")
