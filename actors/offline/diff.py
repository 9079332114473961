"""``runner.py diff RUN_A RUN_B``: where two recorded runs part.

Two runs of one topology and seed, a run before and after a change of code, or a run against a
copy of it: the recordings are compared step by step in the order a step is made, and the first
difference is printed with both values and the policy versions that produced them:

1. which steps each run recorded;
2. the step's batch, group by group in the order the learner got them: the prompt's tokens,
   then each sample's response tokens, behaviour log-probs, weights version, reward;
3. the step's metrics, in the order the trainer computes them (``rerun``'s order; timing,
   throughput and the replay buffer's counters are about the live system and not compared).

Values are compared exactly (bit for bit; NaN equals NaN). Exit status 1 where the runs
differ, 0 where they agree, 2 for a run that cannot be read.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import numpy as np

from actors.offline.recorded import RecordedRun, open_run, span
from actors.offline.rerun import compared_names, same
from messages.rollout import ScoredGroup
from messages.tensor import Tensor

DTYPES = {"int32": np.int32, "float32": np.float32, "int8": np.int8, "int64": np.int64}


def values(t: Tensor | None) -> np.ndarray:
    """A recorded tensor's values (empty for none)."""
    if t is None:
        return np.zeros(0)
    return np.frombuffer(t.data, dtype=DTYPES[t.dtype]).reshape(t.shape)


def first_index(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first position where two 1-D arrays differ (a length counts past the shorter's
    end), or None when they are equal; NaN equals NaN."""
    n = min(len(a), len(b))
    differ = a[:n] != b[:n]
    if a.dtype.kind == "f" and b.dtype.kind == "f":
        differ &= ~(np.isnan(a[:n]) & np.isnan(b[:n]))
    where = np.flatnonzero(differ)
    if len(where):
        return int(where[0])
    return None if len(a) == len(b) else n


def _at(a: np.ndarray, i: int) -> str:
    return repr(a[i].item()) if i < len(a) else "(none: it ends before)"


def group_difference(x: ScoredGroup, y: ScoredGroup) -> str | None:
    """The first difference of two groups, in the order they were made, or None."""
    i = first_index(values(x.prompt_ids), values(y.prompt_ids))
    if i is not None:
        return (f"prompt token {i}: {_at(values(x.prompt_ids), i)} / "
                f"{_at(values(y.prompt_ids), i)}")
    if len(x.samples) != len(y.samples):
        return f"samples: {len(x.samples)} / {len(y.samples)}"
    for j, (s, t) in enumerate(zip(x.samples, y.samples, strict=True)):
        versions = f"(weights versions {s.policy_version} / {t.policy_version})"
        for what, a, b in (("response token", values(s.response_ids), values(t.response_ids)),
                           ("behaviour log-prob of token", values(s.behaviour_logprobs),
                            values(t.behaviour_logprobs)),
                           ("own prompt token", values(s.prompt_ids), values(t.prompt_ids))):
            i = first_index(a, b)
            if i is not None:
                return f"sample {j}, {what} {i}: {_at(a, i)} / {_at(b, i)} {versions}"
        if s.policy_version != t.policy_version:
            return f"sample {j}, weights version: {s.policy_version} / {t.policy_version}"
        if not same(s.reward, t.reward) or s.reward_error != t.reward_error:
            return (f"sample {j}, reward: {s.reward!r} / {t.reward!r}"
                    + (f" (errors {s.reward_error!r} / {t.reward_error!r})"
                       if s.reward_error or t.reward_error else "") + f" {versions}")
    return None


def step_difference(a: RecordedRun, b: RecordedRun, step: int) -> str | None:
    """The first difference of a step both runs recorded, or None."""
    xs, ys = a.batch_groups(step), b.batch_groups(step)
    if len(xs) != len(ys):
        return f"the batch's groups: {len(xs)} / {len(ys)}"
    for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if (why := group_difference(x, y)) is not None:
            return f"group {k} of the batch (prompt ids {x.prompt.prompt_id} / " \
                   f"{y.prompt.prompt_id}), {why}"
    ma, mb = a.metrics.get(step, {}), b.metrics.get(step, {})
    for name in compared_names(ma, mb):
        if not same(ma.get(name), mb.get(name)):
            return f"metric {name}: {ma.get(name)!r} / {mb.get(name)!r}"
    return None


def diff(run_a: str | Path, run_b: str | Path, out: TextIO = sys.stdout) -> int:
    """Print where two recorded runs first differ (exit 1) or that they agree (0)."""
    a, b = open_run(run_a), open_run(run_b)
    print(f"A: {a.run_dir} (steps {span(a.steps)})\nB: {b.run_dir} (steps {span(b.steps)})",
          file=out)
    for step in sorted(set(a.steps) | set(b.steps)):
        if step not in a.batches or step not in b.batches:
            only = "A" if step in a.batches else "B"
            print(f"differ first at step {step}: recorded in {only} only", file=out)
            return 1
        why = step_difference(a, b, step)
        if why is not None:
            print(f"differ first at step {step}: {why} (A / B)", file=out)
            return 1
    print(f"agree: steps {span(a.steps)}, every group, sample, token and metric compared "
          f"exactly (timing_s/, perf/, replay/ not compared)", file=out)
    return 0
