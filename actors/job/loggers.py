"""The loggers of a job (``run.loggers``) as its one metrics sink, opened by the runner before
any actor starts: the console (the live panel on a terminal, plain lines otherwise), the jsonl
files, the trackers. Opened on a run directory that holds a run already, they are set up for the
checkpoint the learner resumes from (``metrics.Resume``), and given what the recording holds
that they lack (``backfill``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from actors.job.liveview import LiveView, View
from actors.job.metrics import (
    ConsoleSink,
    JsonlSink,
    Kind,
    Metrics,
    MetricSink,
    Resume,
    read_resume,
)
from actors.runtime.config import Topology
from actors.runtime.rundir import RECORD_DIR, checkpoint_position


def open_metrics(topology: Topology, run_dir: Path) -> tuple[Metrics, View | None, Resume]:
    """The job's one metrics sink over the loggers of ``run.loggers``, set up for the
    checkpoint the learner will resume from; with the live panel's model on a terminal.
    Raises ``TrackerError`` when a tracker cannot start."""
    from actors.job.trackers import open_trackers

    L, loggers = topology.learner, topology.run.loggers
    if L.resume:
        resume = read_resume(run_dir, checkpoint_position(run_dir)[0])
    else:  # the learner starts over: every earlier record is replaced, tracker runs begin anew
        resume = Resume()
    sinks: list[MetricSink] = []
    view = None
    if "console" in loggers:
        if sys.stdout.isatty():
            view = View(L.total_steps, topology.algorithm.max_staleness, str(run_dir),
                        time.monotonic(), topology.run.heartbeat_interval,
                        step=resume.step, first_step=resume.step)
            sinks.append(LiveView(view))
        else:
            sinks.append(ConsoleSink(L.total_steps, topology.algorithm.max_staleness))
    if "jsonl" in loggers:
        sinks.append(JsonlSink(run_dir, resume))
    sinks += open_trackers(loggers, topology, run_dir, resume, continue_runs=L.resume)
    metrics = Metrics(sinks)
    if L.resume:
        resume = backfill(metrics, run_dir, resume)
    return metrics, view, resume


def backfill(metrics: Metrics, run_dir: Path, resume: Resume) -> Resume:
    """Write what the recording holds and the loggers lack: the report of a step the checkpoint
    holds, or of a recorded validation, that a killed runner never received (steps after the
    checkpoint are trained again instead), and the recorded validations after the checkpoint's
    step (never done again; append-only trackers skip those they hold). The console is spared
    the old lines. Returns the resume with them counted as logged."""
    from actors.runtime.recording import last_by, read_table

    missing: list[tuple[Kind, int, dict[str, float]]] = []
    tables: tuple[tuple[Kind, str], ...] = (("train", "metrics"),
                                            ("validation", "validation_metrics"))
    for kind, table in tables:
        if not (run_dir / RECORD_DIR / table).is_dir():
            continue
        for step, row in sorted(last_by(read_table(run_dir, table, ["step", "metrics"]),
                                        "step").items()):
            logged = (kind, step) in resume.logged
            # a recorded validation is never done again: after the checkpoint's step, the
            # loggers that cut back to it (jsonl, tensorboard) need it again too
            if kind == "train" and step <= resume.step and not logged \
                    or kind == "validation" and (step > resume.step or not logged):
                missing.append((kind, step, dict(row["metrics"])))
    quiet = Metrics([s for s in metrics.sinks if s.name != "console"], metrics.report,
                    metrics.failed)
    for kind, step, values in missing:
        quiet.write(kind, step, values)
    metrics.sinks[:] = [s for s in metrics.sinks if s.name == "console" or s in quiet.sinks]
    return Resume(resume.step, resume.logged | {(k, s) for k, s, _ in missing})
