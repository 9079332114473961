"""Rerun one recorded learner step offline: ``python runner.py rerun RUN_DIR --step N``.

The learner is rebuilt as it was before step N: from the newest checkpoint of a step ≤ N−1
(weights, optimizer, scheduler, KL coefficient), or from the base model with a fresh optimizer
when none is left; the recorded batches of the steps in between are trained again. Then step N
runs on its recorded batch (each group decoded from its exact recorded encoding, in the
recorded order), with no sampler or reward worker, and every metric is compared with the
recorded one. On the CPU they match exactly: a step's inputs are the recorded bytes, its RNG is
seeded from (run seed, step) (``Trainer.step_seed``), the step runs on a worker thread as in
the learner actor, and on the thread counts it had: ``learner.threads``, or where the live
learner also computed on a sampler's lent threads (``learner.share_threads``), the count each
of its layers ran with, recorded with the step (``actors/runtime/cores.py: RerunThreads``).
Those counts matter: a small matrix product (a few rows of the LM head) can split its sum
between two threads and round otherwise than on one. A run whose learner had several ranks is
rerun on one (its checkpoints load with any number of ranks): the same computation with sums
in another order, so metrics agree to float rounding, not to the last bit.

Metrics about the live system rather than the computation (``timing_s/*``, ``perf/*``,
``replay/*``) are not compared. A mismatch names the first differing quantity, in the order the
computation produces them: the batch (scores, lengths, staleness), advantages, the importance
correction (proximal vs behaviour log-probs), the loss terms, the gradient norm, the learning
rate, then the rest; a difference in a step rerun on the way is reported before step N's.
Nothing is written into the run directory.
"""

from __future__ import annotations

import concurrent.futures
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from actors.offline.recorded import OfflineError, open_run, span
from actors.runtime.config import UserCodeError
from actors.runtime.rundir import STATE_FILE, checkpoints, read_state

EXCLUDED_PREFIXES = ("timing_s/", "perf/", "replay/")
# the order a step computes its quantities in: the first difference is the one to look at
ORDER = ("critic/score/", "response_length/", "staleness/", "actor/reward_kl_penalty",
         "critic/values/", "critic/returns/", "critic/advantages/", "rollout_corr/",
         "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
         "critic/vf", "actor/grad_norm", "actor/lr")


def excluded(name: str) -> bool:
    return name.startswith(EXCLUDED_PREFIXES)


def _rank(name: str) -> int:
    for i, prefix in enumerate(ORDER):
        if name.startswith(prefix):
            return i
    return len(ORDER)


def compared_names(recorded: dict[str, float], rerun: dict[str, float]) -> list[str]:
    """Every compared metric, in computation order (the trainer's order within a kind)."""
    names = list(rerun) + [k for k in recorded if k not in rerun]
    return sorted((n for n in names if not excluded(n)), key=_rank)  # sort is stable


def same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def first_difference(recorded: dict[str, float], rerun: dict[str, float]) -> str | None:
    for name in compared_names(recorded, rerun):
        if not same(recorded.get(name), rerun.get(name)):
            return name
    return None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.10g}"


def comparison_table(recorded: dict[str, float], rerun: dict[str, float]) -> str:
    names = compared_names(recorded, rerun)
    width = max(len(n) for n in names) if names else 10
    lines = [f"{'name':<{width}}  {'recorded':>18}  {'rerun':>18}  {'|diff|':>10}"]
    for n in names:
        a, b = recorded.get(n), rerun.get(n)
        diff = "-" if a is None or b is None else f"{abs(a - b):.3g}"
        flag = "" if same(a, b) else "  <-- differs"
        lines.append(f"{n:<{width}}  {_fmt(a):>18}  {_fmt(b):>18}  {diff:>10}{flag}")
    return "\n".join(lines)


def checkpoint_before(run_dir: Path, step: int) -> tuple[Path | None, int]:
    """The newest checkpoint of a step ≤ ``step − 1`` and its step (``None, 0``: the base)."""
    before = [(path, n) for n, path in checkpoints(run_dir) if n <= step - 1]
    return before[-1] if before else (None, 0)


def parse_dump(spec: str) -> tuple[int, int | None]:
    gid, _, sample = spec.partition(":")
    try:
        return int(gid), (int(sample) if sample else None)
    except ValueError:
        raise OfflineError(f"--dump {spec!r}: expected GROUP_ID or GROUP_ID:SAMPLE") from None


def rerun(run_dir: str | Path, step: int, *, overrides: Sequence[str] = (),
          dump: Sequence[str] = (), dump_dir: str | None = None,
          out: TextIO = sys.stdout) -> int:
    """Rerun step ``step``; 0 when every compared metric matches exactly, 1 otherwise."""
    run = open_run(run_dir, overrides)
    if step not in run.batches:
        raise OfflineError(f"step {step} is not recorded in {run.run_dir} "
                           f"(recorded steps: {span(run.steps)})")
    if step not in run.metrics:
        raise OfflineError(f"step {step} has a recorded batch but no recorded metrics")
    dumps = [parse_dump(d) for d in dump]
    ckpt, start = checkpoint_before(run.run_dir, step)
    forward = list(range(start + 1, step))
    unrecorded = [s for s in forward if s not in run.batches]
    if unrecorded:
        raise OfflineError(f"steps {span(unrecorded)} (between the checkpoint of step {start} and "
                           f"step {step}) are not recorded: cannot rebuild the learner")
    batch = run.batch_groups(step)
    gids = [g.prompt.prompt_id for g in batch]
    for gid, sample in dumps:
        if gid not in gids:
            raise OfflineError(f"--dump: group {gid} is not in step {step}'s batch (groups: {gids})")
        if sample is not None and not 0 <= sample < len(batch[0].samples):
            raise OfflineError(f"--dump: group {gid} has samples 0..{len(batch[0].samples) - 1}")

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the report is the output

    if ckpt is not None:
        recorded_step = read_state(ckpt)["step"]
        if recorded_step != start:
            raise OfflineError(f"{ckpt}: its {STATE_FILE} says step {recorded_step}")
    threads = torch.get_num_threads()
    torch.set_num_threads(run.topology.learner.threads)
    try:
        return _rerun(run, step, forward, ckpt, batch, dumps, overrides, dump_dir, out)
    except UserCodeError as exc:  # a user's own loss or estimator: changed, or raising
        raise OfflineError(str(exc)) from None
    finally:
        torch.set_num_threads(threads)  # as it was: a caller in-process keeps its own setting


def _rerun(run, step, forward, ckpt, batch, dumps, overrides, dump_dir, out) -> int:
    from actors.learner.trainer import Trainer
    from actors.runtime.cores import RerunThreads

    gids = [g.prompt.prompt_id for g in batch]
    # the learner actor builds its Trainer and trains on a worker thread: so does the rerun
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as thread:
        trainer = thread.submit(Trainer, run.topology, run.run_dir, ckpt).result()
        threads = RerunThreads(run.topology.learner.threads)
        threads.attach(trainer.policy.model, trainer.policy.optimizer)

        def train(s: int, groups, *trace: dict) -> tuple[dict, str]:
            """Step ``s`` on the thread counts it had live (``threads`` of its batches row)."""
            threads.start(run.batches[s].get("threads"))
            got = trainer.train_step(groups, *trace)
            return got, threads.finish()

        _say_what_runs(run, step, ckpt, overrides, out)
        first = _steps_on_the_way(thread, train, run, forward, out)
        trace: dict = {}
        got, unlike = thread.submit(train, step, batch, trace).result()
        if unlike:
            print(f"=== step {step}: {unlike}", file=out)
    recorded = run.metrics[step]
    print(f"\nstep {step}: {len(batch)} groups × {len(batch[0].samples)} samples "
          f"(group ids {gids})", file=out)
    print(comparison_table(recorded, got), file=out)
    skipped = sorted(n for n in {**recorded, **got} if excluded(n))
    print(f"not compared (about the live system, not the computation): {', '.join(skipped)}",
          file=out)
    diff = first_difference(recorded, got)
    if diff is not None and first is None:
        first = (step, diff)
    if dumps:
        _dump(trainer, batch, trace, dumps, step, dump_dir, out)
    return _verdict(run, step, recorded, got, first, out)


def _say_what_runs(run, step: int, ckpt, overrides, out: TextIO) -> None:
    """The rerun's header: the step, where the learner was rebuilt from, its threads, and
    why a run with several ranks may differ by float rounding."""
    source = f"checkpoint {ckpt}" if ckpt is not None else "the base model (no checkpoint ≤ " \
        f"step {step - 1} left), fresh optimizer"
    print(f"=== rerun of step {step} of {run.run_dir}", file=out)
    print(f"=== learner rebuilt from {source}; threads={run.topology.learner.threads}", file=out)
    ranks = run.topology.learner.nproc_per_node * run.topology.learner.nnodes
    if ranks > 1:  # one process sums what the ranks reduced, in another order
        print(f"=== the run's learner had {ranks} ranks, the rerun has one: their sums are "
              "taken in another order, so expect differences of float rounding", file=out)
    if overrides:
        print(f"=== overrides: {' '.join(overrides)}", file=out)


def _steps_on_the_way(thread, train, run, forward, out: TextIO) -> tuple[int, str] | None:
    """Train the steps between the checkpoint and the step asked for, each compared with its
    record; the first (step, quantity) that differs, or None."""
    first: tuple[int, str] | None = None
    for s in forward:
        got, unlike = thread.submit(train, s, run.batch_groups(s)).result()
        diff = first_difference(run.metrics.get(s, {}), got)
        print(f"    rerun step {s} on the way: {'match' if diff is None else 'differs at ' + diff}"
              + (f" ({unlike})" if unlike else ""), file=out)
        if diff is not None and first is None:
            first = (s, diff)
    return first


def _verdict(run, step: int, recorded: dict, got: dict, first: tuple[int, str] | None,
             out: TextIO) -> int:
    """The result line: a match (0), or the first differing quantity and where (1)."""
    if first is None:
        n = len(compared_names(recorded, got))
        print(f"\nresult: match — all {n} compared metrics of step {step} are identical", file=out)
        return 0
    s, name = first
    a, b = run.metrics.get(s, {}).get(name), (got.get(name) if s == step else None)
    where = f"step {s}" + (" (rerun on the way, before the step asked for)" if s != step else "")
    detail = f" (recorded {_fmt(a)}, rerun {_fmt(b)})" if s == step else ""
    print(f"\nresult: MISMATCH — first differing quantity: {name} at {where}{detail}", file=out)
    return 1


def _dump(trainer, batch, trace: dict, dumps: list[tuple[int, int | None]], step: int,
          dump_dir: str | None, out: TextIO) -> None:
    """Per-token tensors of the chosen samples: a table on ``out``, or .pt and .parquet files."""
    import torch

    n = len(batch[0].samples)
    gids = [g.prompt.prompt_id for g in batch]
    chosen = [(gid, j) for gid, sample in dumps
              for j in ([sample] if sample is not None else range(n))]
    columns = ("mask", "keep", "advantages", "behaviour_logprobs", "old_logprobs",
               "current_logprobs", "is_weights")
    samples: dict[str, dict[str, torch.Tensor]] = {}
    for gid, j in chosen:
        row = gids.index(gid) * n + j
        at = trace["mask"][row].bool()  # (W-1,) response positions
        one = {c: trace[c][row][at].clone() for c in columns}
        one["token_ids"] = trace["input_ids"][row, 1:][at].clone()
        samples[f"{gid}:{j}"] = one
    if dump_dir is None:
        tok = trainer.policy.tokenizer
        for key, one in samples.items():
            print(f"\n--- dump of sample {key} (step {step}): one row per response token", file=out)
            print(f"{'t':>3} {'token':>10} {'mask':>4} {'keep':>4} {'adv':>9} {'behav_lp':>9} "
                  f"{'old_lp':>9} {'cur_lp':>9} {'is_w':>7}", file=out)
            for t in range(len(one["token_ids"])):
                text = repr(tok.decode([int(one["token_ids"][t])]))[:10]
                print(f"{t:>3} {text:>10} {int(one['mask'][t]):>4} {int(one['keep'][t]):>4} "
                      f"{float(one['advantages'][t]):>9.4f} "
                      f"{float(one['behaviour_logprobs'][t]):>9.4f} "
                      f"{float(one['old_logprobs'][t]):>9.4f} "
                      f"{float(one['current_logprobs'][t]):>9.4f} "
                      f"{float(one['is_weights'][t]):>7.4f}", file=out)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(dump_dir)
    folder.mkdir(parents=True, exist_ok=True)
    pt = folder / f"step_{step}_dump.pt"
    torch.save(samples, pt)
    rows = [{"group_id": int(key.split(":")[0]), "sample": int(key.split(":")[1]), "t": t,
             "token_id": int(one["token_ids"][t]),
             **{c: float(one[c][t]) for c in columns}}
            for key, one in samples.items() for t in range(len(one["token_ids"]))]
    parquet = folder / f"step_{step}_dump.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    print(f"\ndumped {len(samples)} samples ({len(rows)} tokens) to {pt} and {parquet}", file=out)
