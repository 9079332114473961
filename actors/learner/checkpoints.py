"""The checkpoints of a run directory, read without torch (the replay buffer and the offline
tools need them too, and must stay light).

``RUN_DIR/checkpoints/step_N/`` is written whole by ``Trainer.save_checkpoint``: into a
``.tmp_step_N_PID`` folder first, then renamed, so every ``step_N`` folder is complete; ``STATE_FILE``
in it holds the step, the policy version and the KL coefficient.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
PARTIAL_PREFIX = ".tmp_step_"  # a checkpoint being written; left behind only by a kill
_NAME = re.compile(r"step_(\d+)")


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint as ``(step, folder)``, oldest first."""
    found = []
    for path in (Path(run_dir) / "checkpoints").glob("step_*"):
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


def remove_partial(run_dir: Path) -> None:
    """Drop the temp folders of checkpoint writes killed half-way: never checkpoints."""
    for half in (Path(run_dir) / "checkpoints").glob(f"{PARTIAL_PREFIX}*"):
        shutil.rmtree(half, ignore_errors=True)
