"""The one metrics sink and its loggers, in this process: a failing logger is reported and
dropped while the others go on; a resume replaces (jsonl, tensorboard) or skips (wandb, mlflow)
the steps it trains again, in the same tracker runs; a tracker that cannot start is a clear
error. Results are read back from the files the trackers wrote (``tests/trackers.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from actors.job.config.load import decode_topology
from actors.job.metrics import Background, JsonlSink, Metrics, Resume, read_resume
from actors.job.trackers import TrackerError, mlflow_key, open_trackers
from tests.jobs import ROOT, jsonl
from tests.trackers import mlflow_history, mlflow_run, tensorboard_scalars, wandb_runs


class Recording:
    def __init__(self, name: str, fail_at: int | None = None) -> None:
        self.name, self.fail_at = name, fail_at
        self.records: list[tuple[str, int, dict]] = []
        self.closed = ""

    def write(self, kind, step, metrics) -> None:
        if step == self.fail_at:
            raise ConnectionError("server went away")
        self.records.append((kind, step, dict(metrics)))

    def close(self, outcome: str) -> None:
        self.closed = outcome


def test_a_logger_failing_mid_run_is_reported_once_and_the_others_go_on():
    good, bad, slow_bad = Recording("good"), Recording("bad", fail_at=2), Recording("wandb", 3)
    threaded = Background(slow_bad)
    reports: list[str] = []
    hub = Metrics([good, bad, threaded], report=reports.append)
    for step in range(1, 6):
        hub.write("train", step, {"x": float(step)})
    hub.write("validation", 5, {"val-core/a/reward/mean@4": 0.5})
    threaded.thread.join(0)  # (its failure at step 3 surfaces at the next write or at close)
    hub.close("finished")
    assert [r[1] for r in good.records] == [1, 2, 3, 4, 5, 5] and good.closed == "finished"
    assert [r[1] for r in bad.records] == [1]
    assert [r[1] for r in slow_bad.records] == [1, 2]
    assert set(hub.failed) == {"bad", "wandb"} and [s.name for s in hub.sinks] == ["good"]
    assert len(reports) == 2 and "bad failed at train step 2: ConnectionError" in reports[0]
    assert "wandb failed" in reports[1] and "the run goes on" in reports[1]


def test_jsonl_resume_keeps_the_records_up_to_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "x"')
    (tmp_path / "validation.jsonl").write_text(
        "".join(json.dumps({"step": s, "v": s}) + "\n" for s in (0, 3, 5)))
    resume = read_resume(tmp_path, 3)
    assert resume.logged == {("train", s) for s in range(1, 6)} | {("validation", s)
                                                                   for s in (0, 3, 5)}
    assert resume.redone("train", 4) and not resume.redone("train", 6)
    sink = JsonlSink(tmp_path, resume)
    for s in (4, 5):
        sink.write("train", s, {"x": 10.0 * s})
    sink.write("validation", 5, {"v": 50.0})
    assert [(r["step"], r["x"]) for r in jsonl(tmp_path / "metrics.jsonl")] == \
        [(1, 1), (2, 2), (3, 3), (4, 40.0), (5, 50.0)]
    assert [(r["step"], r["v"]) for r in jsonl(tmp_path / "validation.jsonl")] == \
        [(0, 0), (3, 3), (5, 50.0)]


def test_trackers_continue_their_runs_and_draw_each_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    topo = decode_topology({"learner": {"total_steps": 7}})
    (tmp_path / "topology.json").write_text("{}")
    names = ("tensorboard", "wandb", "mlflow")

    def incarnation(resume: Resume, steps, validations, scale: float) -> None:
        hub = Metrics(open_trackers(names, topo, tmp_path, resume), report=pytest.fail)
        for s in steps:
            hub.write("train", s, {"critic/score/mean": scale * s, "actor/lr": 1e-5})
        for s in validations:
            hub.write("validation", s, {"val-core/arith/reward/mean@4": scale * s / 10,
                                        "val-aux/prompts": 8.0})
        hub.close("finished")
        assert not hub.failed

    incarnation(Resume(), range(1, 6), (0, 4), 1.0)
    jsonl_sink = JsonlSink(tmp_path, Resume())  # the ledger append-only trackers skip by
    for s in range(1, 6):
        jsonl_sink.write("train", s, {})
    for s in (0, 4):
        jsonl_sink.write("validation", s, {})
    # a crash after step 5; the learner resumes from the checkpoint of step 3: 4 and 5 (and the
    # validation of 4) are done again, with other values, then 6 and 7
    incarnation(read_resume(tmp_path, 3), range(4, 8), (4, 7), 2.0)
    import wandb

    wandb.teardown()  # this process's wandb service: not for the jobs later tests start

    scalars = tensorboard_scalars(tmp_path / "tensorboard")  # replaced
    assert scalars["critic/score/mean"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 8.0), (5, 10.0),
                                            (6, 12.0), (7, 14.0)]
    assert [s for s, _ in scalars["val-core/arith/reward/mean@4"]] == [0, 4, 7]
    assert dict(scalars["val-core/arith/reward/mean@4"])[4] == pytest.approx(0.8)

    runs = wandb_runs(tmp_path)  # one run, continued; each step drawn once (the first value)
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"]
    assert runs[0]["config"]["learner"]["total_steps"] == 7
    rows = [r for run in runs for r in run["history"]]
    train = [(r["step"], r["critic/score/mean"]) for r in rows if "critic/score/mean" in r]
    assert train == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 12.0), (7, 14.0)]
    val = [r["step"] for r in rows if "val-core/arith/reward/mean@4" in r]
    assert val == [0, 4, 7]

    assert mlflow_history(tmp_path, "critic/score/mean") == \
        [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 12.0), (7, 14.0)]
    assert [s for s, _ in mlflow_history(tmp_path, mlflow_key("val-core/arith/reward/mean@4"))] \
        == [0, 4, 7]
    client, run = mlflow_run(tmp_path)
    assert run.info.status == "FINISHED" and run.data.params["learner.total_steps"] == "7"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_tracker_that_cannot_start_stops_the_job_before_any_actor(tmp_path, tiny_model,
                                                                   monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    with pytest.raises(TrackerError, match="run.loggers: mlflow failed to start"):
        open_trackers(("mlflow",), decode_topology({}), tmp_path, Resume())
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "runner.py", "topology.toml", f"model.path={tiny_model}",
                          f"run.dir={run_dir}", 'run.loggers=["jsonl", "tensorboard", "mlflow"]'],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "error: run.loggers: mlflow failed to start" in res.stderr
    assert not (run_dir / "status.jsonl").exists()  # no actor was started


def test_a_resume_backfills_what_a_killed_runner_never_received(tmp_path):
    """The recording is the record: a step the checkpoint holds whose report the killed runner
    never wrote, and validations that will not be done again, reach the loggers at the resume;
    the steps after the checkpoint are left to be trained again."""
    from actors.job.loggers import open_metrics
    from actors.job.supervisor import awaits_final_validation
    from actors.runtime.recording import Recorder
    from actors.runtime.rundir import STATE_FILE, checkpoint_dir

    recorder = Recorder(tmp_path, ["metrics", "validation_metrics"])
    for s in range(1, 6):
        recorder.append("metrics", {"step": s, "metrics": {"critic/score/mean": s / 10}})
    for s in (0, 3, 6):
        recorder.append("validation_metrics", {"step": s, "seconds": 1.0, "metrics": {
            "val-core/a/reward/mean@4": s / 10, "val-aux/prompts": 4.0}})
    recorder.flush()
    (tmp_path / "metrics.jsonl").write_text(  # the report of step 4 never arrived
        "".join(json.dumps({"step": s, "critic/score/mean": s / 10}) + "\n" for s in (1, 2, 3, 5)))
    (tmp_path / "validation.jsonl").write_text(  # nor that of the validation of step 3
        "".join(json.dumps({"step": s, "val-core/a/reward/mean@4": s / 10}) + "\n" for s in (0, 6)))
    ckpt = checkpoint_dir(tmp_path, 4)
    ckpt.mkdir(parents=True)
    (ckpt / STATE_FILE).write_text(json.dumps({"step": 4, "version": 4}))
    topo = decode_topology({"learner": {"total_steps": 6}, "run": {"loggers": ["jsonl", "tensorboard"]},
                            "validation": {"every": 3, "datasets": [{"builtin": "arithmetic"}]}})
    hub, _, resume = open_metrics(topo, tmp_path)
    assert [r["step"] for r in jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]  # 5: redone
    assert [r["step"] for r in jsonl(tmp_path / "validation.jsonl")] == [0, 3, 6]
    hub.close("finished")
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["critic/score/mean"]] == [4]
    assert sorted(s for s, _ in scalars["val-core/a/reward/mean@4"]) == [3, 6]
    # the validation of the last step is recorded: the job will not wait for it again
    assert not awaits_final_validation(topo, resume)
    assert awaits_final_validation(topo, Resume(4, frozenset({("validation", 3)})))
