"""A whole job with validation, every logger, checkpoint retention, killed with ``kill -9`` mid-run
and resumed: what the user reads afterwards (metrics.jsonl, validation.jsonl, tensorboard,
wandb offline, mlflow file store, the recording, status.jsonl, the checkpoints) has every step
and every validation exactly once, the training counters balance with the validation prompts
counted apart, and the tracker runs are the same ones across the two incarnations."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from actors.job.trackers import mlflow_key
from tests.jobs import (
    ROOT,
    actor_pids,
    balanced,
    command,
    metrics,
    status_lines,
    validations,
    wait_for_steps,
)
from tests.trackers import mlflow_history, tensorboard_scalars, wandb_runs

VALIDATION = ["validation.every=3", "validation.n=4", "validation.temperature=0.8",
              'validation.datasets=[{builtin="repeat_letter", size=6}]']
LOGGERS = ['run.loggers=["console", "jsonl", "tensorboard", "wandb", "mlflow"]']
CORE = "val-core/repeat_letter/reward/mean@4"


def test_validation_loggers_and_retention_through_a_kill_9_and_resume(tiny_model, tmp_path):
    from actors.runtime.recording import read_table
    from actors.runtime.rundir import checkpoint_position

    run_dir = tmp_path / "run"
    cmd = command(tiny_model, run_dir, "learner.total_steps=9", "learner.save_every=2",
                  "learner.keep_checkpoints=2", "run.status_interval=1", *VALIDATION, *LOGGERS)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("WANDB_SERVICE", None)  # a wandb service of this test process is not the job's
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    try:
        wait_for_steps(run_dir, 5, proc)
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and every actor, at once
        proc.wait(timeout=30)
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while actor_pids(run_dir):
        assert time.monotonic() < deadline, "actors outlived kill -9"
        time.sleep(0.1)
    resumed_from, _ = checkpoint_position(run_dir)
    assert resumed_from >= 4
    killed_steps = [r["step"] for r in metrics(run_dir)]
    assert killed_steps[:resumed_from] == list(range(1, resumed_from + 1))

    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert not actor_pids(run_dir)

    # every step once, the redone ones replaced; the training counters balance on every row
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert all(balanced(r) for r in rows)
    # validation at 0, every 3 steps and after the last, each once, with verl's metrics
    vals = validations(run_dir)
    assert [v["step"] for v in vals] == [0, 3, 6, 9]
    for v in vals:
        assert 0 <= v[CORE] <= 1 and v["val-aux/prompts"] == 6 and v["val-aux/samples"] == 24
        assert {"val-core/repeat_letter/reward/best@4/mean", "val-core/repeat_letter/reward/maj@4/mean",
                "val-aux/repeat_letter/reward/pass@1", "val-aux/repeat_letter/reward/pass@4",
                "val-aux/repeat_letter/response_length/mean", "timing_s/validation"} <= set(v)
        assert v["timing_s/validation_generate"] > 0
    # the validation samples are recorded in their own table, apart from training prompts
    table = read_table(run_dir, "validation").to_pylist()
    final = {(r["step"], r["prompt_id"]): r for r in table}
    assert {s for s, _ in final} == {0, 3, 6, 9} and len(final) == 24
    for r in final.values():
        assert len(r["completions"]) == len(r["rewards"]) == len(r["answers"]) == 4
        assert all(r["answers"]) and len(r["response_lengths"]) == 4
    recorded_val = {r["step"] for r in read_table(run_dir, "validation_metrics").to_pylist()}
    assert recorded_val == {0, 3, 6, 9}
    prompts = read_table(run_dir, "prompts")["prompt_id"].to_pylist()
    assert prompts == list(range(len(prompts)))  # training prompts only, no id repeats
    status = status_lines(run_dir)
    replay = status[-1]["replay-0"]
    assert replay["issued"] == replay["trained"] + replay["dropped"] + replay["in_flight"]
    assert replay["issued"] <= len(prompts)  # the recording holds every one (its last status
    # may predate the last few); validation prompts are never among them
    assert replay["val_rounds"] >= 1 and replay["val_issued"] >= 6 * replay["val_rounds"]
    assert status[-1]["sampler-0"]["val_groups"] >= 6
    events = [line["event"] for line in status]
    assert "validation" in events and "status" in events and events[-1] == "stopped"
    assert status[-1]["outcome"] == "finished"

    # the trackers: one run each, continued; each step and each validation drawn once
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert [s for s, _ in scalars["critic/score/mean"]] == list(range(1, 10))
    assert [v for _, v in scalars["critic/score/mean"]] == \
        [rows[i]["critic/score/mean"] for i in range(9)]
    assert [s for s, _ in scalars[CORE]] == [0, 3, 6, 9]
    runs = wandb_runs(run_dir)
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"]
    history = [r for run in runs for r in run["history"]]
    # never a step twice; what wandb had not written out when it was killed may be missing, and
    # only that: the last steps the killed runner logged
    first = [r["step"] for r in runs[0]["history"] if "critic/score/mean" in r]
    assert first == list(range(1, len(first) + 1))
    drawn = sorted(r["step"] for r in history if "critic/score/mean" in r)
    assert len(drawn) == len(set(drawn))
    assert set(range(1, 10)) - set(drawn) <= set(range(len(first) + 1, max(killed_steps) + 1))
    assert set(range(max(killed_steps) + 1, 10)) <= set(drawn)
    val_drawn = [r["step"] for r in history if CORE in r]
    assert len(val_drawn) == len(set(val_drawn)) and set(val_drawn) <= {0, 3, 6, 9}
    assert [s for s, _ in mlflow_history(run_dir, "critic/score/mean")] == list(range(1, 10))
    assert [s for s, _ in mlflow_history(run_dir, mlflow_key(CORE))] == [0, 3, 6, 9]

    # checkpoints: the 2 newest besides the final one
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step_6", "step_8", "step_9"]
