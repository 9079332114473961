"""A recorded run opened for reading: its resolved topology and its recorded tables.

Nothing here writes into the run directory. A resumed run may have recorded a step (or a group)
twice; the last record wins (``actors.recording.last_by``), as it is the one the run went on from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from actors.job.config.load import apply_overrides, decode_topology, recorded
from actors.runtime.config import ConfigError, Topology
from actors.runtime.recording import decode_group, last_by, read_table
from actors.runtime.rundir import RECORD_DIR, TOPOLOGY
from messages.rollout import SamplingParams, ScoredGroup


class OfflineError(Exception):
    """A run directory, recording, step or file that cannot be used (exit status 2)."""


def excerpt(text: str, width: int = 72) -> str:
    """One line of at most ``width`` characters (newlines shown as ⏎)."""
    flat = text.replace("\n", "⏎")
    return flat if len(flat) <= width else flat[: width - 1] + "…"


@dataclass
class RecordedRun:
    run_dir: Path
    topology: Topology
    batches: dict[int, dict[str, Any]]  # step -> batches row (the last one written)
    metrics: dict[int, dict[str, float]]  # step -> recorded metrics
    _groups: dict[int, dict[str, Any]] | None = field(default=None, repr=False)

    @property
    def steps(self) -> list[int]:
        return sorted(self.batches)

    def groups(self) -> dict[int, dict[str, Any]]:
        """``group_id -> groups row`` (read once, on first use)."""
        if self._groups is None:
            self._groups = last_by(read_table(self.run_dir, "groups"), "group_id")
        return self._groups

    def group(self, message: bytes) -> ScoredGroup:
        """A recorded group as the learner gets it. Groups recorded before they carried their
        sampling parameters get the run's sampler settings, which they were generated with."""
        group = decode_group(message)
        if group.sampling is not None:
            return group
        s = self.topology.sampler
        return msgspec.structs.replace(group, sampling=SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
            stop=tuple(s.stop)))

    def batch_groups(self, step: int) -> list[ScoredGroup]:
        """Step ``step``'s batch exactly as the learner got it, in the recorded order."""
        if step not in self.batches:
            raise OfflineError(f"step {step} is not recorded in {self.run_dir} "
                               f"(recorded steps: {span(self.steps)})")
        rows = self.groups()
        missing = [g for g in self.batches[step]["group_ids"] if g not in rows]
        if missing:
            raise OfflineError(f"step {step}: groups {missing} of its batch are not in the "
                               "recording (the run stopped before the replay buffer flushed them?)")
        return [self.group(rows[g]["message"]) for g in self.batches[step]["group_ids"]]


def span(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}"
    return ", ".join(map(str, steps))


def open_run(run_dir: str | Path, overrides: Sequence[str] = ()) -> RecordedRun:
    """Open ``run_dir``; ``overrides`` (dotted ``key=value``) change its topology for a what-if."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise OfflineError(f"no run directory {run_dir}")
    topo_file = run_dir / TOPOLOGY
    if not topo_file.is_file():
        raise OfflineError(f"no {topo_file}: not the run directory of a job started with runner.py")
    if not (run_dir / RECORD_DIR / "batches").is_dir():
        raise OfflineError(f"no recording in {run_dir} (no {RECORD_DIR}/batches: the run "
                           "trained no step, ran with run.record = false, or predates recording)")
    try:
        data = json.loads(topo_file.read_text())
        topology = decode_topology(apply_overrides(recorded(data), list(overrides)))
    except (ConfigError, ValueError, msgspec.DecodeError) as exc:
        raise OfflineError(f"bad topology {topo_file}: {exc}") from None
    batches = last_by(read_table(run_dir, "batches"), "step")
    if not batches:
        raise OfflineError(f"no recorded step in {run_dir}")
    metrics = {step: dict(row["metrics"])
               for step, row in last_by(read_table(run_dir, "metrics"), "step").items()}
    return RecordedRun(run_dir, topology, batches, metrics)
