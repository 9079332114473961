"""What starting a job through Ray costs: the same job on this machine with its processes
started by the runner (``run.launcher = "local"``) and by Ray (``--ray``: a Ray started for the
job), one after the other in alternating order, ``--rounds`` times.

    .venv/bin/python bench/bench_ray.py --rounds 3 --steps 6

Two numbers per job: start-up, from starting ``runner.py`` to its ``=== job started`` line
(every actor ready; under Ray this includes starting Ray and reserving the placement group,
which the runner's own "after Ns" leaves out), and the per-step wall time once the job runs
(the median over steps 2.. of ``timing_s/step`` + ``timing_s/between_steps`` from
``metrics.jsonl``). Messages never pass through Ray, so the second should not differ. Both
use one weights transport (``--transport``, zmq): ``auto`` is shm on one machine but zmq under
Ray (its nodes may be machines), a difference of transport, not of launcher. The job is the
default topology on a tiny random llama (as the tests build it). Needs ``flowrl[ray]``. Run by
hand; results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.jobs import TINY  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

STARTED = re.compile(r"=== job started: all \d+ actors ready")


def one_job(model: Path, work: Path, launcher: str, steps: int, port: int,
            transport: str) -> tuple[float, float]:
    """(start-up s, median per-step s) of one job."""
    run_dir = work / f"{launcher}-{time.monotonic_ns()}"
    cmd = [sys.executable, "runner.py", "topology.toml", f"model.path={model}",
           f"run.dir={run_dir}", *TINY, f"learner.total_steps={steps}", f"run.base_port={port}",
           f"learner.weights_transport={transport}"]
    if launcher == "ray":
        cmd.append("--ray")
    began, started, said = time.monotonic(), 0.0, []
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # the line's arrival is the moment the job started
            said.append(line)
            if not started and STARTED.search(line):
                started = time.monotonic() - began
    if proc.returncode != 0 or not started:
        raise SystemExit(f"{launcher} job failed:\n{''.join(said)[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_step = [r["timing_s/step"] + r["timing_s/between_steps"] for r in rows[1:]]
    return started, statistics.median(per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--port", type=int, default=28100, help="run.base_port of the jobs")
    parser.add_argument("--transport", default="zmq",
                        help="learner.weights_transport of both (auto: shm on one machine, zmq "
                             "under Ray, which may be on several)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny")
        results: dict[str, list[tuple[float, float]]] = {"local": [], "ray": []}
        for r in range(args.rounds):
            for launcher in (("local", "ray") if r % 2 == 0 else ("ray", "local")):
                results[launcher].append(one_job(model, work, launcher, args.steps, args.port,
                                                 args.transport))
                start, step = results[launcher][-1]
                print(f"round {r + 1} {launcher:5s}: started after {start:6.1f}s, "
                      f"{step:.2f}s per step", flush=True)
    med = {k: (statistics.median(s for s, _ in v), statistics.median(t for _, t in v))
           for k, v in results.items()}
    print(f"\nmedian over {args.rounds} rounds | start-up s | per-step s")
    for k, (s, t) in med.items():
        print(f"{k:5s} | {s:.1f} | {t:.2f}")
    print(f"ray / local | {med['ray'][0] / med['local'][0]:.2f} | "
          f"{med['ray'][1] / med['local'][1]:.2f}")


if __name__ == "__main__":
    main()
