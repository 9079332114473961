"""Metric sinks: where the metrics of every learner step go.

Each sink takes ``write(step, metrics)`` with verl's metric names. ``JsonlSink`` is the learner's
record of a run (``RUN_DIR/metrics.jsonl``, one line per step); ``ConsoleSink`` is the runner's
one line per step. Experiment trackers plug in as further sinks behind the same two calls.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, TextIO


class MetricSink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of learner step ``step``."""

    def close(self) -> None:
        """Flush and release what the sink holds (a sink is not written to after this)."""


class JsonlSink:
    """One JSON line per step, appended and flushed at once (a kill loses no written step)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        pass


def format_step(step: int, metrics: Mapping[str, float], total: int, max_staleness: int) -> str:
    """The console line of one step: reward, length, mismatch KL, IS weight, staleness, speed."""
    m = metrics
    return (
        f"step {step:4d}/{total} | reward {m.get('critic/score/mean', 0):.3f}"
        f" | len {m.get('response_length/mean', 0):5.1f}"
        f" | kl {m.get('rollout_corr/kl', 0):+.4f} k3 {m.get('rollout_corr/k3_kl', 0):.4f}"
        f" | is_w {m.get('rollout_corr/is_weight_mean', 1):.3f}"
        f" clip {100 * m.get('rollout_corr/is_clip_frac', 0):.1f}%"
        f" | stale {m.get('staleness/mean', 0):.2f}/{max_staleness}"
        f" | {m.get('perf/throughput', 0):6.1f} tok/s | {m.get('timing_s/step', 0):5.1f}s"
    )


class ConsoleSink:
    """``format_step`` lines on a stream (the runner's standard output)."""

    def __init__(self, total_steps: int, max_staleness: int, stream: TextIO | None = None) -> None:
        self.total, self.max_staleness = total_steps, max_staleness
        self.stream = stream

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        print(format_step(step, metrics, self.total, self.max_staleness),
              file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        pass
