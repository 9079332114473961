"""Re-score recorded completions: ``python runner.py rerun RUN_DIR --rescore file.py[:name]``.

Every sample of the trained batches (``--steps A:B`` to narrow, ``--limit`` groups at most) is
scored again by a verl-style ``compute_score(data_source, solution_str, ground_truth,
extra_info)`` through the live path (``Rollout.score_group`` of
``actors/offline/live_path.py``: one request per group with the prompt and each sample's
turns, as the sampler sends it) and the reward worker's own ``Scoring`` (the function runs in child
processes with the run's ``reward.timeout_s`` and limits, so a function that hangs or crashes
gives an error and score 0.0, never a hung command; the run's DAPO overlong penalty, if any,
applies as it did live). It prints how many scores changed, the mean before and after (overall
and per step), and the samples that flipped: reward crossing 0.5, or moved by more than
``--threshold``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import msgspec

from actors.offline.recorded import OfflineError, excerpt, open_run
from messages.rollout import ScoredGroup

CHANGED_EPS = 1e-9  # scores closer than this are the same score
FLIPS_SHOWN = 20


@dataclass
class Rescored:
    step: int
    group_id: int
    sample: int
    before: float
    after: float
    error: str
    text: str
    ground_truth: str


def parse_function(spec: str) -> tuple[Path, str]:
    """``file.py[:name]`` -> (path, name); checks, without running it, that the file defines it."""
    path_text, _, name = spec.partition(":")
    name = name or "compute_score"
    path = Path(path_text)
    if not path.is_file():
        raise OfflineError(f"--rescore: no reward file {path}")
    if not name.isidentifier():
        raise OfflineError(f"--rescore: {name!r} is not a Python name")
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as exc:
        raise OfflineError(f"--rescore: {path} is not valid Python: {exc}") from None
    defined = {node.name for node in tree.body
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    defined |= {t.id for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    defined |= {(a.asname or a.name) for node in tree.body if isinstance(node, ast.ImportFrom)
                for a in node.names}
    if name not in defined:
        raise OfflineError(f"--rescore: {path} defines no function {name!r} "
                           f"(it has: {', '.join(sorted(defined)) or 'nothing'})")
    return path.resolve(), name


def parse_steps(text: str | None, recorded: list[int]) -> list[int]:
    if not text:
        return recorded
    lo, sep, hi = text.partition(":")
    try:
        a = int(lo) if lo else recorded[0]
        b = int(hi) if hi else (recorded[-1] if sep else a)
    except ValueError:
        raise OfflineError(f"--steps {text!r}: expected A:B (either side may be left out)") from None
    steps = [s for s in recorded if a <= s <= b]
    if not steps:
        raise OfflineError(f"--steps {text}: no recorded step in {a}..{b}")
    return steps


def rescore(run_dir: str | Path, function: str, *, steps: str | None = None, limit: int = 0,
            threshold: float = 0.5, timeout_s: float = 0.0, out: TextIO = sys.stdout) -> int:
    """Re-score and report; ``timeout_s`` > 0 replaces the run's ``reward.timeout_s``. Exit
    status 1 when every sample failed to score (a function that cannot run scores nothing)."""
    run = open_run(run_dir)
    path, name = parse_function(function)
    chosen = parse_steps(steps, run.steps)
    rows = run.groups()
    todo: list[tuple[int, int]] = [(s, gid) for s in chosen for gid in run.batches[s]["group_ids"]
                                   if gid in rows]
    if limit > 0:
        todo = todo[:limit]
    samples: list[Rescored] = []
    groups = [(s, gid, run.group(rows[gid]["message"])) for s, gid in todo]
    # the overlong penalty's L_max: the response budget the groups were sampled with
    max_tokens = max((g.sampling.max_tokens for *_, g in groups if g.sampling), default=0)
    for s, gid, group in groups:
        samples += [Rescored(s, gid, j, x.reward, x.reward, "", x.text, group.prompt.ground_truth)
                    for j, x in enumerate(group.samples)]
    from actors.runtime.config import RewardFunction

    reward = msgspec.structs.replace(run.topology.reward,
                                     functions=[RewardFunction(path=str(path), name=name)],
                                     timeout_s=timeout_s or run.topology.reward.timeout_s)
    topo = msgspec.structs.replace(run.topology, reward=reward)
    results = [x for g in score_recorded(topo, max_tokens, [g for *_, g in groups]) for x in g.samples]
    for r, x in zip(samples, results, strict=True):
        r.after, r.error = x.reward, x.reward_error
    label = f"{path.name}:{name}"
    _report(samples, label, threshold, out)
    if samples and all(r.error for r in samples):  # nothing was scored: the function is broken
        print(f"error: every one of the {len(samples)} samples failed in {label}; the first: "
              f"{samples[0].error}", file=sys.stderr)
        return 1
    return 0


def score_recorded(topo, max_tokens: int, groups: list[ScoredGroup]) -> list[ScoredGroup]:
    """The groups scored again as the live sampler scores them (``Rollout.score_group``: one
    request per group through the reward worker's ``Scoring``), a bounded number at once."""
    import anyio

    from actors.offline.live_path import recorded, scoring_rollout

    async def main() -> list[ScoredGroup]:
        out: list[ScoredGroup] = []
        async with scoring_rollout(topo, Path(topo.model.path), max_tokens) as rollout:
            for i in range(0, len(groups), 32):  # bounded: one chunk of groups in flight
                out += await rollout.score([recorded(g) for g in groups[i:i + 32]])
        return out

    return anyio.run(main, backend="trio")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _report(samples: list[Rescored], label: str, threshold: float, out: TextIO) -> None:
    changed = [r for r in samples if abs(r.after - r.before) > CHANGED_EPS]
    errors = [r for r in samples if r.error]
    steps = sorted({r.step for r in samples})
    print(f"=== re-scored {len(samples)} samples of {len({(r.step, r.group_id) for r in samples})} "
          f"groups (steps {steps[0] if steps else '-'}..{steps[-1] if steps else '-'}) "
          f"with {label}", file=out)
    print(f"changed: {len(changed)} of {len(samples)} scores; errors: {len(errors)}", file=out)
    print(f"mean reward: before {_mean([r.before for r in samples]):.4f}, "
          f"after {_mean([r.after for r in samples]):.4f}", file=out)
    print(f"\n{'step':>5} {'samples':>7} {'before':>8} {'after':>8} {'changed':>7}", file=out)
    for s in steps:
        rs = [r for r in samples if r.step == s]
        print(f"{s:>5} {len(rs):>7} {_mean([r.before for r in rs]):>8.4f} "
              f"{_mean([r.after for r in rs]):>8.4f} "
              f"{sum(abs(r.after - r.before) > CHANGED_EPS for r in rs):>7}", file=out)
    flips = [r for r in samples
             if (r.before >= 0.5) != (r.after >= 0.5) or abs(r.after - r.before) > threshold]
    print(f"\nflipped (crossing 0.5 or moved by more than {threshold:g}): {len(flips)}", file=out)
    for r in flips[:FLIPS_SHOWN]:
        err = f" error: {excerpt(r.error, 60)}" if r.error else ""
        print(f"  step {r.step:>3} group {r.group_id}:{r.sample}  {r.before:.3f} -> {r.after:.3f}"
              f"  truth {excerpt(r.ground_truth, 16)!r}  text {excerpt(r.text)!r}{err}", file=out)
    if len(flips) > FLIPS_SHOWN:
        print(f"  ... and {len(flips) - FLIPS_SHOWN} more", file=out)
    for r in errors[:3]:
        print(f"  error at step {r.step} group {r.group_id}:{r.sample}: {excerpt(r.error, 120)}",
              file=out)
