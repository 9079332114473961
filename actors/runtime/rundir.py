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
the step, the policy version and the KL coefficient, and ``CHECKSUMS`` every other file's size
and CRC-32 as written. A checkpoint damaged on disk since (cut short, bytes changed, a file
gone) is found when a run resumes (``set_aside_damaged``: renamed ``step_N.damaged``, never
resumed from), and the run resumes from the newest whole one.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import zlib
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
CHECKSUMS = "checksums.json"  # in a checkpoint: each other file's [size, CRC-32]
DAMAGED = ".damaged"  # the suffix of a checkpoint set aside as damaged
PARTIAL_PREFIX = ".tmp_step_"  # a checkpoint being written; left behind only by a killed runner
_NAME = re.compile(r"step_(\d+)")


EXIT_DISK_FULL = 3  # an actor's exit status when the run directory's disk is full


class DiskFull(OSError):
    """A write under the run directory found no space left. Its message is the one line the
    runner shows; the actor exits with ``EXIT_DISK_FULL`` and the job stops (a restart would
    find no more room), and the same command resumes once space is freed."""

    def __init__(self, folder: Path, what: str, needed: int | None) -> None:
        free = shutil.disk_usage(folder).free if folder.exists() else 0
        need = f"it needs about {_amount(needed)}, " if needed is not None else ""
        super().__init__(f"no space left in {folder} for {what} ({need}{_amount(free)} are "
                         f"free): free some and run the same command again to resume")


def _amount(size: int) -> str:
    """Bytes as a person reads them: MiB from one up, KiB below."""
    return f"{size / 2**20:,.1f} MiB" if size >= 2**20 else f"{size / 2**10:,.0f} KiB"


def out_of_space(exc: BaseException, folder: Path) -> bool:
    """Whether ``exc``, raised while writing under ``folder``, came of a full disk: an ENOSPC
    anywhere in its chain, or (libraries that wrap it in errors of their own: safetensors,
    torch's archive writer) a filesystem with under a MiB left."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen) or "StorageFull" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(folder).free < 2**20
    except OSError:
        return False


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


def file_checksums(folder: Path) -> dict[str, list[int]]:
    """Every file under ``folder`` but ``CHECKSUMS``, by its path in it: ``[size, CRC-32]``."""
    found = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name == CHECKSUMS:
            continue
        crc, size = 0, 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                crc, size = zlib.crc32(chunk, crc), size + len(chunk)
        found[name] = [size, crc]
    return found


def write_checksums(folder: Path) -> None:
    """Write ``CHECKSUMS`` for a checkpoint folder whose every other file is written."""
    (Path(folder) / CHECKSUMS).write_text(json.dumps(file_checksums(folder), indent=0))


def damage(checkpoint: Path) -> str | None:
    """What is wrong with ``checkpoint`` on disk, in a few words (the first file found
    wrong), or None when each file is as it was written. A checkpoint without ``CHECKSUMS``
    is checked for its state file, which names the checksums file where one was written with
    it (a checkpoint written before there were any names none)."""
    listed = Path(checkpoint) / CHECKSUMS
    if not listed.exists():
        state = Path(checkpoint) / STATE_FILE
        if not state.is_file():
            return f"{STATE_FILE} is missing"
        try:
            named = json.loads(state.read_text()).get("checksums")
        except (OSError, ValueError, AttributeError) as exc:
            return f"{STATE_FILE} cannot be read ({exc})"
        return f"{CHECKSUMS} is missing" if named else None
    try:
        written = json.loads(listed.read_text())
    except (OSError, ValueError) as exc:
        return f"{CHECKSUMS} cannot be read ({exc})"
    found = file_checksums(checkpoint)
    for name, (size, crc) in written.items():
        if name not in found:
            return f"{name} is missing"
        if found[name][0] != size:
            return f"{name} holds {found[name][0]:,} bytes where {size:,} were written"
        if found[name][1] != crc:
            return f"{name} is not what was written (its checksum differs)"
    return None


def set_aside_damaged(run_dir: Path) -> list[str]:
    """Check the run's checkpoints newest first until one is whole, renaming each damaged one
    ``step_N.damaged`` (kept to look at, never resumed from); one line for each set aside."""
    lines = []
    for _, path in reversed(checkpoints(run_dir)):
        why = damage(path)
        if why is None:
            break
        aside = path.with_name(path.name + DAMAGED)
        shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(path, aside)
        except FileNotFoundError:  # set aside by another runner of the run (its hosts)
            continue
        lines.append(f"checkpoint {path.name} is damaged: {why}; set aside as {aside.name}")
    return lines


def cut_torn_line(path: Path) -> bool:
    """Cut a last line a kill left half-written off a jsonl file that is appended to (the
    next record would be glued to it); True when one was cut."""
    try:
        with open(path, "rb+") as f:
            end = f.seek(0, os.SEEK_END)
            if end == 0:
                return False
            f.seek(end - 1)
            if f.read(1) == b"\n":
                return False
            keep, at = 0, end
            while at > 0:  # back to the last whole line's end
                step = min(1 << 20, at)
                f.seek(at - step)
                newline = f.read(step).rfind(b"\n")
                if newline >= 0:
                    keep = at - step + newline + 1
                    break
                at -= step
            f.truncate(keep)
            return True
    except FileNotFoundError:
        return False


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
