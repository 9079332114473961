"""``run.deterministic``: two fresh runs of one topology and seed, with two samplers and two
reward workers, agree bit for bit (``runner.py diff`` exits 0; ``metrics.jsonl`` and
``validation.jsonl`` equal but for timing and the live system's counters), though one of them
loses its samplers to SIGKILL mid-run and is then killed whole with SIGKILL and resumed. The
schedule itself, step by step, is ``tests/test_replay.py``'s; the behaviour without the option
is every other job test's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import (
    FAST,
    ROOT,
    actor_pids,
    command,
    metrics,
    pids_of,
    status_lines,
    validations,
    wait_for_steps,
)

STEPS = 4
DETERMINISTIC = ["run.deterministic=true", "sampler.count=2", "reward.count=2",
                 f"learner.total_steps={STEPS}", "learner.save_every=2",
                 "validation.every=2", 'validation.datasets=[{builtin="repeat_letter", size=4}]']
SYSTEM = ("timing_s/", "perf/", "replay/")  # about the live system: not the computation


def computed(rows: list[dict]) -> list[dict]:
    """A jsonl file's rows without the keys about timing and the live system."""
    return [{k: v for k, v in row.items() if not k.startswith(SYSTEM)} for row in rows]


def run_job(model: Path, run_dir: Path) -> None:
    res = subprocess.run(command(model, run_dir, *DETERMINISTIC), cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def assert_same(a: Path, b: Path) -> None:
    """``runner.py diff`` agrees (every trained group, sample, token and metric, bit for bit),
    and the metrics and validation files are equal but for timing and system keys."""
    res = subprocess.run([sys.executable, "runner.py", "diff", str(a), str(b)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"agree: steps 1..{STEPS}" in res.stdout
    assert computed(metrics(a)) == computed(metrics(b))
    assert [r["step"] for r in metrics(b)] == list(range(1, STEPS + 1))
    assert computed(validations(a)) == computed(validations(b))
    assert [r["step"] for r in validations(b)] == [0, 2, 4]


@pytest.fixture(scope="module")
def straight(tiny_model, tmp_path_factory) -> Path:
    """Run A: straight through, the run the others are compared with."""
    run_dir = tmp_path_factory.mktemp("deterministic") / "a"
    run_job(tiny_model, run_dir)
    return run_dir


def test_two_deterministic_runs_agree_through_a_sampler_kill_and_a_resume(tiny_model, straight,
                                                                          tmp_path):
    """Run A goes straight through. Run B loses both its samplers to SIGKILL once a step is
    recorded, while the next batch is generating (the runner restarts them; the batch goes out
    again whole, with the same version and seed), then the runner and every actor to SIGKILL
    at once after step 3 (a checkpoint at step 2); the same command resumes it, training step 3
    again. B agrees with A bit for bit. (On a loaded machine the kill may land only after the
    last step's checkpoint: the resume then has the last validation alone to do, whose weights
    the learner must hold out until a sampler has polled for them.)"""
    run_dir = tmp_path / "b"
    cmd = command(tiny_model, run_dir, *FAST, *DETERMINISTIC)
    with (tmp_path / "log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for_steps(run_dir, 1, proc)
        samplers = pids_of(run_dir, "sampler")
        assert len(samplers) == 2
        for pid in samplers:
            os.kill(pid, signal.SIGKILL)
        wait_for_steps(run_dir, 3, proc, timeout=240)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    exited = [s for s in status_lines(run_dir) if s["event"] == "exited"]
    assert sorted(s["actor"] for s in exited) == ["sampler-0", "sampler-1"]
    assert all(s["returncode"] == -signal.SIGKILL and s["restart"] for s in exited)
    deadline = time.monotonic() + 30
    while actor_pids(run_dir):
        assert time.monotonic() < deadline, "actors outlived kill -9"
        time.sleep(0.1)
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert_same(straight, run_dir)


def test_diff_names_a_learning_rate_changed_on_resume_at_the_step_it_moved(tiny_model, straight,
                                                                          tmp_path):
    """A change made mid-run is found where it was made: run A's copy, resumed from its
    checkpoint of step 2 with another ``learner.lr``, parts from A first at step 3's learning
    rate (its batch and everything the step computes before its update agree)."""
    changed = tmp_path / "c"
    shutil.copytree(straight, changed)
    shutil.rmtree(changed / "checkpoints" / "step_4")  # the newest is step 2's
    res = subprocess.run(command(tiny_model, changed, *DETERMINISTIC, "learner.lr=1e-3"), cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0 and "resuming from step_2" in res.stdout, \
        res.stdout[-3000:] + res.stderr[-3000:]
    res = subprocess.run([sys.executable, "runner.py", "diff", str(straight), str(changed)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "differ first at step 3: metric actor/lr: 0.003 / 0.001" in res.stdout, res.stdout
