"""What ``run.deterministic`` costs: the default job's seconds per step with the fixed schedule
against the schedule timing makes, run one after the other in pairs (off, on, off, on, ...) so
the machine's load falls on both alike. A step's time is read from the runner's ``step`` events
in status.jsonl, from the fourth step on (start-up and the first weights left out).

    python bench/bench_deterministic.py --model MODEL_DIR [--steps 16] [--pairs 3] [OVERRIDE ...]

Overrides go to both sides (``learner.share_threads=false`` compares the schedules alone: the
deterministic one never shares threads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def seconds_per_step(model: str, steps: int, deterministic: bool, overrides: list[str],
                     run_dir: Path) -> float:
    cmd = [sys.executable, "runner.py", "topology.toml", f"model.path={model}",
           f"run.dir={run_dir}", f"learner.total_steps={steps}", "validation.datasets=[]",
           "run.status_interval=0", *overrides, f"run.deterministic={str(deterministic).lower()}"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"the job failed ({res.returncode}): {res.stderr[-2000:]}")
    times = [row["time"] for row in map(json.loads, (run_dir / "status.jsonl").open())
             if row["event"] == "step"]
    return (times[-1] - times[2]) / (len(times) - 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model directory (the tests' tiny model, "
                                                   "bench/shaped_model.py's thin one)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.steps < 5:
        raise SystemExit("--steps must be at least 5 (the first three are left out)")
    per: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="flowrl-bench-det-") as tmp:
        for k in range(args.pairs):
            for on in (False, True):
                load = os.getloadavg()[0]
                started = time.monotonic()
                s = seconds_per_step(args.model, args.steps, on, args.overrides,
                                     Path(tmp) / f"{k}-{on}")
                per[on].append(s)
                print(f"pair {k} deterministic={on}: {s:.3f} s/step, "
                      f"{time.monotonic() - started:.1f} s in all, load {load:.2f}", flush=True)
    off, on = statistics.median(per[False]), statistics.median(per[True])
    ratios = [b / a for a, b in zip(per[False], per[True], strict=True)]
    print(f"median s/step: off {off:.3f}, on {on:.3f} (on/off {on / off:.2f}); per pair "
          + ", ".join(f"{r:.2f}" for r in ratios))


if __name__ == "__main__":
    main()
