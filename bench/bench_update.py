"""The learner's update inside a job against the same batches trained alone, side by side.

    python bench/bench_update.py                        # the default job's model and batch
    python bench/bench_update.py --layers 2             # 2 layers of its shape, random weights
    python bench/bench_update.py --steps 12 learner.device=cuda sampler.device=cuda

Runs the default job (``python runner.py topology.toml``, no validation, the overrides given)
for ``--steps`` steps with its recording on, then, in this process, trains a fresh learner of the
same topology on the recorded batches, step after step, in order, on a worker thread with
``learner.threads`` threads (as ``runner.py rerun`` does; nothing else runs meanwhile). Both
sides time the same span, the trainer's own ``timing_s/update_actor`` (the forward, backward
and optimizer passes of the step, the batch's preparation and the proximal log-probs left out),
so their ratio is what running inside the job costs the update: the job's threads shared with
a sampler that generates the next batch at the same time, its recording and its reports.
Printed: each side's median from the third step on (the first steps warm allocators and
kernels), their ratio, and the load average before and after.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from shaped_model import shaped_model  # noqa: E402 - bench/ is put on the path above

KEY = "timing_s/update_actor"


def run_job(run_dir: Path, steps: int, overrides: list[str]) -> list[float]:
    cmd = [sys.executable, "runner.py", "topology.toml", f"run.dir={run_dir}",
           f"learner.total_steps={steps}", f"learner.save_every={steps}", "run.status_interval=0",
           "validation.every=0", "validation.before_training=false", *overrides]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"the job failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[KEY] for r in rows]


def standalone(run_dir: Path, steps: int) -> list[float]:
    """The recorded batches of steps 1..steps trained again by a fresh learner, alone."""
    import torch

    from actors.learner.trainer import Trainer
    from actors.offline.recorded import open_run

    run = open_run(run_dir, [])
    torch.set_num_threads(run.topology.learner.threads)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as thread:
        trainer = thread.submit(Trainer, run.topology, Path(tempfile.mkdtemp()), None).result()
        return [thread.submit(trainer.train_step, run.batch_groups(s)).result()[KEY]
                for s in range(1, steps + 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layers", type=int, default=0,
                   help="a model of this many layers of the default model's shape (0: the "
                        "default model itself)")
    p.add_argument("--profiles", default="",
                   help="copy the job's RUN_DIR/profiles here (with learner.profile_steps=[N])")
    p.add_argument("overrides", nargs="*", help="dotted overrides for the job")
    args = p.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # (saving and loading the models: not the measurement)
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-update-") as tmp:
        overrides = list(args.overrides)
        if args.layers:
            overrides.append(f"model.path={shaped_model(Path(tmp) / 'model', layers=args.layers)}")
        run_dir = Path(tmp) / "run"
        job = run_job(run_dir, args.steps, overrides)
        if args.profiles and (run_dir / "profiles").is_dir():
            shutil.copytree(run_dir / "profiles", args.profiles, dirs_exist_ok=True)
        alone = standalone(run_dir, args.steps)
    j, a = statistics.median(job[2:]), statistics.median(alone[2:])
    what = f"{args.layers} layers" if args.layers else "the default model"
    print(f"update_actor, {what}, median of steps 3-{args.steps}:")
    print(f"  in the job    {j:.3f} s   (each: {' '.join(f'{x:.3f}' for x in job)})")
    print(f"  standalone    {a:.3f} s   (each: {' '.join(f'{x:.3f}' for x in alone)})")
    print(f"  job / standalone: {j / a:.2f}x")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
