"""The one metrics sink of a job: every metric of every step and of every validation, to every
logger named in ``run.loggers``.

The runner owns it (``actors/job/supervisor.py``): the learner reports each step it takes
(``StepReport``), the replay buffer each validation it completes (``ValidationReport``), and
``Metrics.write`` hands the record to each sink: ``console`` (a live panel on a terminal,
``actors/job/liveview.py``; plain lines otherwise), ``jsonl`` (``metrics.jsonl`` for steps,
``validation.jsonl`` for validations), and the trackers of ``actors/job/trackers.py``
(tensorboard, wandb, mlflow). A sink that fails while the job runs is reported once and
dropped; the job and the other sinks go on.

A resumed run trains again the steps after the checkpoint it resumes from (``Resume.step``).
Sinks that can replace a record do (``jsonl`` keeps only the records up to that step,
tensorboard purges the later ones); the append-only trackers (wandb, mlflow) skip the records
they already hold (``Resume.logged``: what mlflow's store holds, asked at start; for wandb, what
``metrics.jsonl`` and ``validation.jsonl`` held), so no step is drawn twice anywhere.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, TextIO

from actors.runtime.rundir import METRICS, VALIDATION
from messages.control import ImageSample

Kind = Literal["train", "validation"]  # a learner step's metrics, or a validation's
# a metric every record of its kind has: what an append-only tracker is asked for to learn which
# records it holds
MARKERS: dict[str, str] = {"train": "critic/score/mean", "validation": "val-aux/prompts"}


class MetricSink(Protocol):
    """Where records go. A sink that shows images (tensorboard, wandb) also has
    ``write_samples(step, samples)``: a step's ``ImageSample``s, each image with its answer."""

    name: str  # in run.loggers and in the report of a failure

    def write(self, kind: Kind, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of learner step ``step`` (``train``) or of the validation of the
        policy after that step (``validation``)."""

    def close(self, outcome: str) -> None:
        """Flush and release what the sink holds (``outcome``: ``finished``, ``interrupted`` or
        ``failed: ...``, the job's); it is not written to after this."""


@dataclass(frozen=True)
class Resume:
    """What sinks opened on a run directory that already holds metrics must know."""

    step: int = 0
    """The learner resumes from the checkpoint of this step: records of later steps (and of
    validations after them) will be written again."""
    logged: frozenset[tuple[str, int]] = frozenset()
    """``(kind, step)`` of every record an earlier incarnation wrote (read from the jsonl
    files): what an append-only tracker already holds."""

    def redone(self, kind: Kind, step: int) -> bool:
        """The record was written before and is being written again (an append-only tracker
        keeps the first one rather than drawing a second value at the same step)."""
        return (kind, step) in self.logged


def read_resume(run_dir: Path, step: int) -> Resume:
    """The ``Resume`` of ``run_dir`` when the learner resumes from checkpoint ``step``."""
    logged = set()
    for kind, name in (("train", METRICS), ("validation", VALIDATION)):
        for record in _records(Path(run_dir) / name):
            logged.add((kind, int(record["step"])))
    return Resume(step, frozenset(logged))


def _records(path: Path) -> list[dict]:
    """The whole lines of a jsonl file (a line cut by a kill is left out)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n")[:-1]:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class JsonlSink:
    """``metrics.jsonl`` (one line per step) and ``validation.jsonl`` (one per validation),
    appended and flushed at once. On resume both are cut back to the records up to the
    checkpoint's step (written whole to a temp file, then renamed), so a redone step has one line."""

    name = "jsonl"

    def __init__(self, run_dir: Path, resume: Resume | None = None) -> None:
        self.paths = {"train": Path(run_dir) / METRICS, "validation": Path(run_dir) / VALIDATION}
        if resume is not None:
            for path in self.paths.values():
                kept = [r for r in _records(path) if int(r["step"]) <= resume.step]
                if path.exists():
                    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                    os.replace(tmp, path)

    def write(self, kind: Kind, step: int, metrics: Mapping[str, float]) -> None:
        with self.paths[kind].open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self, outcome: str) -> None:
        pass


def format_step(step: int, metrics: Mapping[str, float], total: int, max_staleness: int) -> str:
    """The console line of one step: reward, length, mismatch KL, the reverse KL to the teacher
    (on-policy distillation), IS weight, staleness, speed."""
    m = metrics
    teacher = (f" | teacher kl {m['distill/reverse_kl/mean']:.3f}"
               if "distill/reverse_kl/mean" in m else "")
    return (
        f"step {step:4d}/{total} | reward {m.get('critic/score/mean', 0):.3f}"
        f" | len {m.get('response_length/mean', 0):5.1f}"
        f" | kl {m.get('rollout_corr/kl', 0):+.4f} k3 {m.get('rollout_corr/k3_kl', 0):.4f}"
        f"{teacher}"
        f" | is_w {m.get('rollout_corr/is_weight_mean', 1):.3f}"
        f" clip {100 * m.get('rollout_corr/is_clip_frac', 0):.1f}%"
        f" | stale {m.get('staleness/mean', 0):.2f}/{max_staleness}"
        f" | {m.get('perf/throughput', 0):6.1f} tok/s | {m.get('timing_s/step', 0):5.1f}s"
        + (f" ({breakdown})" if (breakdown := time_breakdown(m)) else "")
    )


# the parts of a step's time, in the order a step runs them, with their short console names
STEP_PARTS = (("old_log_prob", "old"), ("ref", "ref"), ("values", "val"), ("adv", "adv"),
              ("update_actor", "upd"), ("update_critic", "crit"))


def time_breakdown(metrics: Mapping[str, float]) -> str:
    """Where the learner's step went, compactly (``old 1.2 ref 0.4 adv 0.0 upd 8.1``), then the
    time around it: waiting for the batch, publishing the weights, the sampler's generation of
    the batch (which overlaps the step in async mode); empty for a step without ``timing_s/*``."""
    parts = [f"{short} {metrics[f'timing_s/{key}']:.1f}" for key, short in STEP_PARTS
             if f"timing_s/{key}" in metrics]
    around = [f"{short} {metrics[key]:.1f}" for key, short in (
        ("timing_s/wait_batch", "wait"), ("timing_s/weight_publish", "pub"),
        ("timing_s/gen", "gen")) if key in metrics]
    return " ".join(parts) + (" | " if parts and around else "") + " ".join(around)


def headline(metrics: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Per data source, the validation figures a person looks at first: ``mean@N``, ``maj@N``
    (when the scorer extracts answers) and ``pass@N`` (N = samples per prompt)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.split("/", 3)
        if len(parts) != 4 or parts[0] not in ("val-core", "val-aux") or parts[2] != "reward":
            continue
        name = parts[3]
        if (name.startswith("mean@") or name.startswith("maj@") and name.endswith("/mean")) \
                and parts[0] == "val-core" or name.startswith("pass@"):
            out.setdefault(parts[1], {})[name.removesuffix("/mean")] = value
    for figures in out.values():  # pass@k for the largest k only
        passes = sorted((int(k[5:]), k) for k in figures if k.startswith("pass@"))
        for _, k in passes[:-1]:
            del figures[k]
    return out


def format_validation(step: int, metrics: Mapping[str, float]) -> str:
    """The console line of one validation: per data source mean@N, maj@N, pass@N; its size and
    time."""
    parts = [f"val  {step:4d}"]
    for source, figures in sorted(headline(metrics).items()):
        shown = " ".join(f"{k} {v:.3f}" for k, v in figures.items())
        parts.append(f"{source} {shown}")
    parts.append(f"{int(metrics.get('val-aux/prompts', 0))} prompts"
                 f" {metrics.get('timing_s/validation', 0):.1f}s")
    return " | ".join(parts)


class ConsoleSink:
    """Plain lines on a stream (the runner's standard output when it is not a terminal): one
    per step (``format_step``) and one per validation (``format_validation``)."""

    name = "console"

    def __init__(self, total_steps: int, max_staleness: int, stream: TextIO | None = None) -> None:
        self.total, self.max_staleness = total_steps, max_staleness
        self.stream = stream

    def write(self, kind: Kind, step: int, metrics: Mapping[str, float]) -> None:
        line = (format_step(step, metrics, self.total, self.max_staleness) if kind == "train"
                else format_validation(step, metrics))
        print(line, file=self.stream or sys.stdout, flush=True)

    def close(self, outcome: str) -> None:
        pass


_CLOSE = object()  # the last item of a Background queue


class Background:
    """A sink written from its own thread, so a slow tracker (a remote server) never holds up
    the runner's event loop. The queue is bounded: a tracker more than ``capacity`` records
    behind for ``put_timeout_s`` counts as failed. A failure in the thread is raised by the
    next ``write`` (or ``close``), where ``Metrics`` reports it."""

    def __init__(self, sink: MetricSink, capacity: int = 4096, put_timeout_s: float = 60.0) -> None:
        self.sink, self.name = sink, sink.name
        self.queue: queue.Queue = queue.Queue(capacity)
        self.put_timeout_s = put_timeout_s
        self.error: BaseException | None = None  # the thread's failure, raised once
        self.thread = threading.Thread(target=self._run, name=f"metrics-{sink.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is _CLOSE:
                return
            if self.error is not None:
                continue  # failed: drain without writing until closed
            method, args = item
            try:
                getattr(self.sink, method)(*args)
            except Exception as exc:
                self.error = exc

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def write(self, kind: Kind, step: int, metrics: Mapping[str, float]) -> None:
        self._put("write", (kind, step, dict(metrics)))

    def write_samples(self, step: int, samples: Sequence[ImageSample]) -> None:
        if hasattr(self.sink, "write_samples"):
            self._put("write_samples", (step, list(samples)))

    def _put(self, method: str, args: tuple) -> None:
        self._raise()
        try:
            self.queue.put((method, args), timeout=self.put_timeout_s)
        except queue.Full:
            raise TimeoutError(f"{self.queue.maxsize} records behind for "
                               f"{self.put_timeout_s:g} s") from None

    def close(self, outcome: str, timeout_s: float = 120.0) -> None:
        try:
            self.queue.put(_CLOSE, timeout=timeout_s)
        except queue.Full:
            return
        self.thread.join(timeout_s)
        self._raise()
        self.sink.close(outcome)


@dataclass
class Metrics:
    """Every record to every sink. A sink that raises is reported through ``report`` (once)
    and dropped; the others, and the job, go on."""

    sinks: list[MetricSink]
    report: Callable[[str], None] = field(default=lambda text: print(text, flush=True))
    failed: dict[str, str] = field(default_factory=dict)  # sink name -> what went wrong

    def write(self, kind: Kind, step: int, metrics: Mapping[str, float]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(kind, step, metrics)
            except Exception as exc:
                self._drop(sink, f"failed at {kind} step {step}: {type(exc).__name__}: {exc}")

    def write_samples(self, step: int, samples: Sequence[ImageSample]) -> None:
        """``samples`` of step ``step`` to every sink that shows samples."""
        for sink in list(self.sinks):
            if not hasattr(sink, "write_samples"):
                continue
            try:
                sink.write_samples(step, samples)
            except Exception as exc:
                self._drop(sink, f"failed at the samples of step {step}: "
                                 f"{type(exc).__name__}: {exc}")

    def _drop(self, sink: MetricSink, why: str) -> None:
        self.sinks.remove(sink)
        self.failed[sink.name] = why
        self.report(f"!!! metrics logger {sink.name} {why}; the run goes on without it")

    def close(self, outcome: str) -> None:
        for sink in list(self.sinks):
            try:
                sink.close(outcome)
            except Exception as exc:
                self._drop(sink, f"failed at close: {type(exc).__name__}: {exc}")

    def names(self) -> Iterable[str]:
        return [s.name for s in self.sinks]
