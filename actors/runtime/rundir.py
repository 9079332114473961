"""The layout of a run directory, in one place, readable without torch (the replay buffer,
the runner and the offline tools need it and must stay light).

```
RUN_DIR/
  topology.json        the resolved topology every actor reads (replaced whole, atomically)
  metrics.jsonl        one line per learner step (every metric, verl names)
  validation.jsonl     one line per validation (val-core/..., val-aux/...; ``step``: the policy
                       after that many steps)
  tensorboard/         event files (run.loggers = [..., "tensorboard"])
  trackers.json        the wandb / mlflow run this run directory logs to (a resume continues it)
  status.jsonl         the runner's record of the job, one line per event (``started``: every
                       actor ready; ``step``: a learner step; ``validation``: a validation
                       reported; ``status``: every run.status_interval seconds; ``exited``: an
                       actor died, why (``cause``: failure, node lost, no room) and whether it
                       restarts; ``lost``: an actor of another
                       host went silent; ``attached`` / ``detached``: a worker attached by
                       hand joined / left, finished or silent; ``stopped``: the outcome), each
                       with every actor's last reported status
  hosts/NAME/          with [hosts]: the runner of host NAME (not the owner): its lock, topology
                       and status.jsonl (its own actors only)
  logs/NAME.traceback  the traceback of an actor that died
  logs/NAME.log        an actor's own output, when the runner shows its live panel
  record/TABLE/        the recording (actors/runtime/recording.py)
  checkpoints/step_N/  Hugging Face checkpoints, each written whole (temp folder, rename); the
                       ``learner.keep_checkpoints`` newest are kept, plus the final one
```

``checkpoints/step_N/`` is written whole by the learner's policy: into a ``.tmp_step_N_PID``
folder first, then renamed, so every ``step_N`` folder is complete; ``STATE_FILE`` in it holds
the step, the policy version and the KL coefficient.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import msgspec

TOPOLOGY = "topology.json"
METRICS = "metrics.jsonl"
VALIDATION = "validation.jsonl"
TENSORBOARD = "tensorboard"
TRACKERS = "trackers.json"
STATUS = "status.jsonl"
LOGS = "logs"
RECORD_DIR = "record"
CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
PARTIAL_PREFIX = ".tmp_step_"  # a checkpoint being written; left behind only by a kill
_NAME = re.compile(r"step_(\d+)")


def traceback_file(run_dir: Path, actor: str) -> Path:
    """Where actor ``actor`` (``KIND-INDEX``) writes the traceback it died with."""
    return Path(run_dir) / LOGS / f"{actor}.traceback"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step}"


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint as ``(step, folder)``, oldest first."""
    found = []
    for path in (Path(run_dir) / CHECKPOINTS).glob("step_*"):
        m = _NAME.fullmatch(path.name)
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = checkpoints(run_dir)
    return found[-1][1] if found else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state (``step``, ``version``, ``kl_coef``) saved with ``checkpoint``."""
    return json.loads((checkpoint / STATE_FILE).read_text())


def checkpoint_position(run_dir: Path) -> tuple[int, int]:
    """``(step, version)`` of the run directory's latest checkpoint (the one the learner
    resumes from), ``(0, 0)`` without one."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return 0, 0
    state = read_state(ckpt)
    return int(state["step"]), int(state.get("version", state["step"]))


def prune_checkpoints(run_dir: Path, keep: int, final_step: int) -> list[Path]:
    """Remove all but the ``keep`` newest checkpoints, not counting the final one (the
    checkpoint of ``final_step``, the run's last step, which is always kept); returns what was
    removed. Called after a new checkpoint is complete, so the newest one is never at risk."""
    others = [(step, path) for step, path in checkpoints(run_dir) if step != final_step]
    stale = [path for _, path in others[: max(0, len(others) - keep)]]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def remove_partial(run_dir: Path) -> None:
    """Drop the temp folders of checkpoint writes killed half-way: never checkpoints."""
    for half in (Path(run_dir) / CHECKPOINTS).glob(f"{PARTIAL_PREFIX}*"):
        shutil.rmtree(half, ignore_errors=True)


def remove_stale_sockets(run_dir: Path, current: Path) -> None:
    """Remove the socket folder a killed earlier runner of this run directory left in /tmp.

    Only a folder the runner made itself (``/tmp/flowrl-*``, sockets only) and not this run's.
    """
    try:
        previous = Path(msgspec.json.decode((run_dir / TOPOLOGY).read_bytes())
                        ["run"]["socket_dir"])
    except (OSError, msgspec.DecodeError, KeyError, TypeError):
        return
    if (previous == current or previous.parent != Path("/tmp")
            or not previous.name.startswith("flowrl-") or not previous.is_dir()):
        return
    if all(entry.is_socket() for entry in previous.iterdir()):
        shutil.rmtree(previous, ignore_errors=True)
