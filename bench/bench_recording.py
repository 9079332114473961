"""What recording a run costs: the same work with ``run.record`` on and off, side by side.

    .venv/bin/python bench/bench_recording.py                       # both parts
    .venv/bin/python bench/bench_recording.py --part hotpath --groups-per-step 32 --n 8 --tokens 1024
    .venv/bin/python bench/bench_recording.py --part jobs --rounds 3 --steps 20

Two parts:

- ``hotpath``: the replay actor's recording work per step in this process, with synthetic
  scored groups of a realistic size (``--n`` samples of ``--tokens`` response tokens per group,
  ``--groups-per-step`` groups per batch): the write-ahead flush of the prompts and groups
  parts (the actor runs it in a worker thread when groups come in) and what a batch request
  waits for (``take_batch``, the flush of the fates part, encoding the ``TrainBatch``). On and
  off alternate step by step.
- ``jobs``: whole jobs (``runner.py``, every actor its own process) on a tiny random llama,
  ``--rounds`` rounds each running one job with recording on and one with it off, both at the
  same time (so load from outside the bench hits both alike; ``--sequential``: one after the
  other, in alternating order). Throughput is steady-state learner steps per second: from the
  ``--warm``-th step's line in ``metrics.jsonl`` to the last step's.

Ratios are on / off (time: > 1 means recording is slower; throughput: < 1 means slower).
The target is a job within 5% of its throughput without recording. Run by hand; results go in
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from actors.data.sources import make_task  # noqa: E402
from actors.replay.state import ReplayState  # noqa: E402
from actors.runtime.config import TaskConfig  # noqa: E402
from actors.runtime.recording import Recorder  # noqa: E402
from messages.codec import Codec, encode  # noqa: E402
from messages.rollout import GroupsDone, Sample, ScoredGroup, ToReplay, TrainBatch  # noqa: E402
from messages.tensor import Tensor  # noqa: E402


def synthetic_groups(state: ReplayState, k: int, n: int, tokens: int, rng) -> list[ScoredGroup]:
    """``k`` scored groups for prompts issued by ``state``: ``n`` samples of ``tokens`` tokens."""
    out = []
    for p in state.issue(b"sampler", k):
        samples = [
            Sample(Tensor("int32", (tokens,), rng.integers(0, 50_000, tokens, dtype=np.int32).tobytes()),
                   Tensor("float32", (tokens,), (-rng.random(tokens, dtype=np.float32)).tobytes()),
                   state.version, "x" * (4 * tokens), "stop", float(rng.random()))
            for _ in range(n)]
        out.append(ScoredGroup(prompt=p, prompt_ids=Tensor("int32", (64,), bytes(256)),
                               samples=samples, sampler="sampler-0", generate_seconds=1.0))
    return out


def hotpath(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    codec: Codec[ToReplay] = Codec(ToReplay)
    critical: dict[str, list[float]] = {"on": [], "off": []}  # a batch request's answer time
    ahead: list[float] = []  # the write-ahead flush of prompts and groups (a worker thread)
    with tempfile.TemporaryDirectory(prefix="bench-rec-") as tmp:
        states, recorders = {}, {}
        for mode in ("on", "off"):
            states[mode] = ReplayState(
                task=make_task(TaskConfig(name="arithmetic"), seed=0),
                groups_per_step=args.groups_per_step, max_staleness=1000,
                capacity=10 * args.groups_per_step, record=mode == "on")
            recorders[mode] = Recorder(Path(tmp) / mode, ["prompts", "groups", "fates"],
                                       enabled=mode == "on")

        def move(s: ReplayState, rec: Recorder) -> None:  # the actor's record(), its loop part
            for table, row in s.records:
                rec.append(table, row)
            s.records.clear()

        for step in range(1, args.hot_steps + args.hot_warm + 1):
            for mode in (("on", "off") if step % 2 else ("off", "on")):
                s, rec = states[mode], recorders[mode]
                frames = [encode(GroupsDone([g])) for g in synthetic_groups(
                    s, args.groups_per_step, args.n, args.tokens, rng)]
                for f in frames:  # groups come in (event loop)
                    for g in codec.decode(f).groups:
                        s.accept(g)
                t0 = time.perf_counter()
                move(s, rec)  # written ahead when groups come in (worker thread)
                rec.flush(("prompts", "groups"))
                t1 = time.perf_counter()
                batch = s.take_batch(args.groups_per_step, step=step)  # a batch request
                move(s, rec)
                rec.flush()  # what the request waits for: the fates
                encode(TrainBatch(step=step - 1, groups=batch or [], counters=s.counters()))
                t2 = time.perf_counter()
                if step > args.hot_warm:
                    critical[mode].append(t2 - t1)
                    if mode == "on":
                        ahead.append(t1 - t0)
                s.version = step
    on, off = statistics.median(critical["on"]), statistics.median(critical["off"])
    size = args.groups_per_step * args.n * args.tokens
    print(f"hot path: {args.groups_per_step} groups/step x {args.n} samples x {args.tokens} tokens "
          f"= {size:,} tokens/step, {args.hot_steps} steps per mode (+{args.hot_warm} warm-up), "
          "alternating")
    print(f"  batch request answered (take_batch + fates flush + encode), median: recording on "
          f"{1e3 * on:.2f} ms | off {1e3 * off:.2f} ms | extra {1e3 * (on - off):.2f} ms/step")
    print(f"  written ahead in a worker thread (prompts + groups parts): median "
          f"{1e3 * statistics.median(ahead):.2f} ms/step, max {1e3 * max(ahead):.2f} ms")


def _steps_done(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def run_jobs(model: Path, runs: dict[str, Path], args: argparse.Namespace) -> dict[str, float]:
    """Run one job per ``{mode: run_dir}`` at the same time; steady-state steps/s of each."""
    procs, t_warm, t_last = {}, {}, {}
    for mode, run_dir in runs.items():
        cmd = [sys.executable, "runner.py", "topology.toml", f"model.path={model}",
               f"run.dir={run_dir}", "task.name=repeat_letter", "sampler.max_tokens=8",
               "run.status_interval=0", f"learner.total_steps={args.steps}",
               f"learner.save_every={args.steps}", f"run.record={'true' if mode == 'on' else 'false'}",
               *args.overrides]
        procs[mode] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True)
    while any(p.poll() is None for p in procs.values()):
        now = time.monotonic()
        for mode, run_dir in runs.items():
            done = _steps_done(run_dir)
            if mode not in t_warm and done >= args.warm:
                t_warm[mode] = now
            if mode not in t_last and done >= args.steps:
                t_last[mode] = now
        time.sleep(0.02)
    out = {}
    for mode, p in procs.items():
        if p.returncode != 0:
            raise SystemExit(f"{mode} job failed ({p.returncode}): "
                             f"{p.stderr.read()[-2000:] if p.stderr else ''}")
        recorded = (runs[mode] / "record").exists()
        assert recorded == (mode == "on"), f"run.record={mode} but record/ exists: {recorded}"
        out[mode] = (args.steps - args.warm) / (t_last[mode] - t_warm[mode])
    return out


def jobs(args: argparse.Namespace) -> None:
    from tests.tiny_model import build_tiny_model

    results: dict[str, list[float]] = {"on": [], "off": []}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="bench-rec-jobs-") as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        for r in range(args.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            got: dict[str, float] = {}
            if args.together:  # both at once: the machine's other load hits both alike
                got = run_jobs(model, {m: Path(tmp) / f"run-{r}-{m}" for m in order}, args)
            else:
                for mode in order:
                    got.update(run_jobs(model, {mode: Path(tmp) / f"run-{r}-{mode}"}, args))
            for mode in order:
                results[mode].append(got[mode])
            ratios.append(got["on"] / got["off"])
            print(f"  round {r + 1}/{args.rounds} ({'together' if args.together else order[0] + ' first'}): "
                  f"on {got['on']:.3f} steps/s, off {got['off']:.3f} steps/s, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"jobs: {args.rounds} rounds x 2 jobs of {args.steps} steps "
          f"({'run at the same time' if args.together else 'one after the other'}; tiny llama, "
          f"task repeat_letter, steady state from step {args.warm})")
    for mode in ("on", "off"):
        print(f"  recording {mode:<3}: steps/s median {statistics.median(results[mode]):.3f} "
              f"(all {' '.join(f'{x:.3f}' for x in results[mode])})")
    ratio = statistics.median(ratios)
    print(f"  throughput ratio on/off: median of rounds {ratio:.3f}, mean {statistics.mean(ratios):.3f} "
          f"(target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("both", "hotpath", "jobs"), default="both")
    p.add_argument("--groups-per-step", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per group")
    p.add_argument("--tokens", type=int, default=1024, help="response tokens per sample")
    p.add_argument("--hot-steps", type=int, default=20)
    p.add_argument("--hot-warm", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--sequential", dest="together", action="store_false",
                   help="run a round's two jobs one after the other (default: at the same time)")
    p.add_argument("overrides", nargs="*", help="extra topology overrides for the jobs")
    args = p.parse_args(argv)
    if args.part in ("both", "hotpath"):
        hotpath(args)
    if args.part in ("both", "jobs"):
        jobs(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
