"""The options of rollout correction, as plain Python: rejection rules, verl's option strings.

Nothing here imports torch, so the topology's checks (``actors.job.config.checks``, which
light processes import) validate ``[algorithm.correction]`` with the very code the kernels
run: ``RejectionRule`` (what ``kernels.rejection.rejection_mask`` applies),
``parse_rs_preset`` (verl's ``rollout_rs`` / ``rollout_rs_threshold`` strings) and
``parse_is_threshold`` (verl's ``rollout_is_threshold``). ``kernels.rollout_corr`` takes
verl's strings as verl's function does, and reads them with the same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RS_STATISTICS = ("ratio", "geo_mean", "k1", "k2", "k3")
RS_LEVELS = ("token", "sequence")
RS_REDUCTIONS = ("mean", "sum", "max")


@dataclass(frozen=True)
class RejectionRule:
    """Keep tokens (``level="token"``) or whole sequences (``"sequence"``) whose ``statistic``
    lies in ``[low, high]``; ``None`` leaves that side open. See ``kernels.rejection`` for the
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


def parse_rs_preset(options: str, thresholds: str | float) -> list[RejectionRule]:
    """Rules from verl's ``rollout_rs`` / ``rollout_rs_threshold`` strings, as verl reads them.

    ``options`` is a comma-separated list (repeats dropped, as verl does); ``thresholds`` gives
    one entry per option, or one shared by all. Options:

    - ``token_k1``, ``seq_sum_k1``, ``seq_mean_k1``: the k1 statistic (``-log rho``; summed or
      averaged over the sequence) kept in ``[log lower, log upper]`` for a threshold
      ``"lower_upper"``; a single number ``u`` means ``lower = 1/u``. verl's documentation
      calls these ratio bounds, but its code bounds ``exp(k1) = 1/rho``: ``"0.5_1.5"`` keeps
      ``1/rho`` in ``[0.5, 1.5]``, i.e. ``rho`` in ``[0.667, 2]``. This follows the code (the
      reference, and what a verl user's run did; a deliberate choice, so not a difference from
      verl), and the two readings agree whenever ``lower = 1/upper`` (every verl preset, e.g.
      ``seq_sum_k1`` with ``"0.5_2.0"``). To bound ``rho`` itself, write a ``ratio`` rule.
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


def parse_is_threshold(spec: str | float | tuple[float, float]) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold`` as ``(upper, lower)``.

    A number (or a string holding one) is a TIS cap: ``(cap, None)``. ``"lower_upper"``
    (e.g. ``"0.5_5.0"``) or a pair ``(lower, upper)`` is an IcePop band. Bounds must be > 0
    and ``lower <= upper``.
    """
    if isinstance(spec, tuple) and len(spec) == 2:
        lower, upper = (float(x) for x in spec)
    elif isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(f"rollout_is_threshold must be a number or 'lower_upper', got {spec!r}")
    else:
        lower = None
        try:
            if isinstance(spec, str) and "_" in spec:
                lower_text, upper_text = spec.strip().split("_", 1)
                lower, upper = float(lower_text), float(upper_text)
            else:
                upper = float(spec)
        except ValueError:
            raise ValueError(f"bad rollout_is_threshold {spec!r}; expected a number or "
                             "'lower_upper'") from None
    if not upper > 0 or (lower is not None and not lower > 0):
        raise ValueError(f"rollout_is_threshold bounds must be > 0, got {spec!r}")
    if lower is not None and lower > upper:
        raise ValueError(f"rollout_is_threshold lower bound above upper: {spec!r}")
    return upper, lower
