"""Validation metrics with verl's names and verl's formulas, plus unbiased pass@k.

For each data source and each variable (``reward``, and every numeric extra the scorer returned
for all of a prompt's samples), over the N samples of each prompt, averaged over the prompts
(verl 0.9.1 ``process_validation_metrics`` and ``RayPPOTrainer._val_metrics_update``):

- ``mean@N``, ``std@N`` (population std);
- ``best@k/mean|std``, ``worst@k/mean|std`` for k = 2, 4, 8, ... < N and k = N: the max / min
  over k samples drawn with replacement, averaged over 1000 bootstrap draws (seed 42: verl's
  numbers, draw for draw);
- ``maj@k/mean|std`` the same way, when the scorer extracted an answer from every sample
  (``ScoreResult.answer``): the score of the first sample giving the most frequent answer.

Names: ``val-core/{data_source}/{var}/{metric}`` for the core variable (``acc`` when the
scorer returns one, else ``reward``) and a ``mean``, ``maj`` or ``best`` metric at the largest
N; ``val-aux/...`` for everything else. (verl's own rule: so ``best@N/mean`` and ``maj@N/mean``
of the reward are ``val-core``, as they are in verl.)

Added here (prime-rl's ``pass@k``, HumanEval's estimator): ``val-aux/{src}/reward/pass@k`` for
k = 1, 2, 4, ... <= N and k = N, ``1 - C(n - c, k) / C(n, k)`` per prompt with ``c`` its
samples scoring at least ``validation.pass_threshold``; ``val-aux/{src}/response_length/mean``,
``/max`` and ``/clip_ratio`` (share of responses cut at the token budget); and over all sources
``val-aux/prompts``, ``val-aux/samples``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000
SEED = 42
INVALID = "[INVALID]"  # the answer of a sample the scorer found none in (it still votes)


@dataclass(frozen=True)
class ScoredPrompt:
    """One validation prompt's samples, as scored."""

    data_source: str
    rewards: Sequence[float]
    answers: Sequence[str] = ()  # one per sample when the scorer extracts answers; "": none
    lengths: Sequence[int] = ()  # response tokens of each sample
    clipped: Sequence[bool] = ()  # cut at the token budget
    extras: Sequence[dict[str, float]] = field(default_factory=tuple)  # numeric extras per sample


def outcomes(samples: Sequence[Any]) -> list[Any]:
    """A group's samples that validation counts: one per episode (an endpoint episode that
    branched hands on earlier segments sharing its last sample's reward, ``Sample.reward_of``;
    counting them would weigh that episode more)."""
    return [s for s in samples if s.reward_of < 0]


def bootstrap_metric(data: Sequence[Any], subset_size: int,
                     reduce_fns: Sequence[Callable[[np.ndarray], float]],
                     n_bootstrap: int = N_BOOTSTRAP, seed: int = SEED) -> list[tuple[float, float]]:
    """(mean, std) of each ``reduce_fn`` over ``n_bootstrap`` draws of ``subset_size`` items
    with replacement; the draws are verl's (the legacy numpy generator seeded with ``seed``,
    without touching numpy's global one)."""
    data_np = np.array(data, dtype=object)
    idxs = np.random.RandomState(seed).choice(len(data_np), size=(n_bootstrap, subset_size),
                                              replace=True)
    numeric = all(isinstance(x, int | float) for x in data)
    out = []
    for reduce_fn in reduce_fns:
        if numeric and reduce_fn in (np.max, np.min):  # the same numbers, without the loop
            values = reduce_fn(np.asarray(data, dtype=np.float64)[idxs], axis=1)
        else:
            values = np.array([reduce_fn(data_np[i]) for i in idxs], dtype=np.float64)
        out.append((float(np.mean(values)), float(np.std(values))))
    return out


def majority_value(data: Iterable[dict[str, Any]]) -> float:
    """The value of the first sample whose answer is the most frequent (verl ``calc_maj_val``)."""
    votes: dict[Any, list[float]] = defaultdict(list)
    for d in data:
        votes[d["pred"]].append(d["val"])
    top = max(votes, key=lambda k: len(votes[k]))
    return votes[top][0]


def subset_sizes(n: int) -> list[int]:
    """verl's k of best@k / worst@k / maj@k: 2, 4, 8, ... below n, then n (none for n = 1)."""
    if n <= 1:
        return []
    out, k = [], 2
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k)/C(n, k)``."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_sizes(n: int) -> list[int]:
    """k of pass@k: 1, 2, 4, ... <= n, and n."""
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out if out[-1] == n else out + [n]


def prompt_metrics(values: Sequence[float], preds: Sequence[str] | None,
                   seed: int = SEED) -> dict[str, float]:
    """One variable over one prompt's samples (verl's per-uid metrics)."""
    n = len(values)
    metric = {f"mean@{n}": float(np.mean(values))}
    if n <= 1:
        return metric
    metric[f"std@{n}"] = float(np.std(values))
    for k in subset_sizes(n):
        (bon_mean, bon_std), (won_mean, won_std) = bootstrap_metric(
            values, k, [np.max, np.min], seed=seed)
        metric[f"best@{k}/mean"], metric[f"best@{k}/std"] = bon_mean, bon_std
        metric[f"worst@{k}/mean"], metric[f"worst@{k}/std"] = won_mean, won_std
        if preds is not None:
            votes = [{"val": v, "pred": p} for v, p in zip(values, preds, strict=True)]
            [(maj_mean, maj_std)] = bootstrap_metric(votes, k, [majority_value], seed=seed)
            metric[f"maj@{k}/mean"], metric[f"maj@{k}/std"] = maj_mean, maj_std
    return metric


def _variables(p: ScoredPrompt) -> dict[str, list[float]]:
    out = {"reward": [float(r) for r in p.rewards]}
    if p.extras and len(p.extras) == len(p.rewards):
        shared = set.intersection(*(set(e) for e in p.extras)) if p.extras else set()
        for key in sorted(shared):
            if key not in ("reward", "pred"):
                out[key] = [float(e[key]) for e in p.extras]
    return out


def source_metrics(prompts: Sequence[ScoredPrompt], seed: int = SEED
                   ) -> dict[str, dict[str, dict[str, float]]]:
    """``{data_source: {var: {metric: value averaged over the prompts}}}`` (verl's
    ``process_validation_metrics``)."""
    per_prompt: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for p in prompts:
        if not p.rewards:
            continue
        preds = list(p.answers) if len(p.answers) == len(p.rewards) and all(p.answers) else None
        for var, values in _variables(p).items():
            for name, value in prompt_metrics(values, preds, seed).items():
                per_prompt[p.data_source][var][name].append(value)
    return {src: {var: {name: float(np.mean(vals)) for name, vals in metrics.items()}
                  for var, metrics in by_var.items()}
            for src, by_var in per_prompt.items()}


def named(by_source: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """verl's names: ``val-core`` for the core variable's mean/maj/best at the largest N."""
    out: dict[str, float] = {}
    for src, by_var in by_source.items():
        core = "acc" if "acc" in by_var else "reward"
        for var, metrics in by_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for name, value in metrics.items():
                section = ("val-core" if var == core and name.startswith(("mean", "maj", "best"))
                           and f"@{n_max}" in name else "val-aux")
                out[f"{section}/{src}/{var}/{name}"] = value
    return out


def validation_metrics(prompts: Sequence[ScoredPrompt], pass_threshold: float = 1.0,
                       seed: int = SEED) -> dict[str, float]:
    """Every validation metric of one round (see the module docstring)."""
    out = named(source_metrics(prompts, seed))
    by_source: dict[str, list[ScoredPrompt]] = defaultdict(list)
    for p in prompts:
        if p.rewards:
            by_source[p.data_source].append(p)
    for src, group in by_source.items():
        passes: dict[int, list[float]] = defaultdict(list)
        for p in group:
            n = len(p.rewards)
            c = sum(r >= pass_threshold for r in p.rewards)
            for k in pass_sizes(n):
                passes[k].append(pass_at_k(n, c, k))
        for k, values in passes.items():
            out[f"val-aux/{src}/reward/pass@{k}"] = float(np.mean(values))
        lengths = [x for p in group for x in p.lengths]
        if lengths:
            clipped = [x for p in group for x in p.clipped]
            out[f"val-aux/{src}/response_length/mean"] = float(np.mean(lengths))
            out[f"val-aux/{src}/response_length/max"] = float(max(lengths))
            out[f"val-aux/{src}/response_length/clip_ratio"] = (
                float(np.mean(clipped)) if clipped else 0.0)
    out["val-aux/prompts"] = float(sum(len(g) for g in by_source.values()))
    out["val-aux/samples"] = float(sum(len(p.rewards) for p in prompts))
    return out
