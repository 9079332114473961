"""Crash-proof resume of the replay buffer: the recording is its write-ahead log.

``read_recording`` reads what the buffer must become; ``ReplayState.restore`` applies it.

When a job is started again in a run directory that holds a recording (``learner.resume`` on),
the replay buffer rebuilds its state from ``record/{prompts,groups,fates}`` and the step ``S``
of the latest checkpoint (``checkpoints/step_S/trainer_state.json``; ``S = 0`` without one,
since the learner then starts from the base model):

- groups trained at a step ``<= S`` of the run's lineage stay trained; with ``replay.reuse``
  one served fewer times than allowed by step ``S`` waits for its next serve again (ordered by
  its last serve), unless it was retired at a version ``<= S``;
- groups trained at a step ``> S`` (those steps' weights were lost) are held again, first, in
  their original (step, position) order, so step ``S+1`` trains on the same batch as before;
- accepted groups neither trained nor dropped are held, in the order they were accepted;
- dropped groups stay dropped, with their reason;
- prompts issued whose groups never came back are issued again (requeued, same prompt id);
- ``issued`` and the dataset position continue after the last recorded prompt, and the
  version is the checkpoint's.

So ``issued = trained + dropped + in_flight`` holds at once, and each counter continues from
where the lineage's last recorded batch left it.

The lineage of step ``s`` is the ``trained`` fates that the latest replay incarnation wrote for
``s``: each incarnation starts by rewinding to the latest checkpoint, and redoes every step
after it, so a later incarnation's record of a step replaces an earlier one's.

Why this is right whatever moment the job was killed at (``kill -9`` of every process):

1. Part files are whole (temp name, fsync, rename). Flushes run one at a time, and each
   writes its tables in a fixed order: ``prompts``, then ``groups``, then ``fates`` (the one
   before each batch writes all three; one when groups come in writes ahead the first two). A
   groups row's prompt is issued before the group is accepted, so it is in the same flush or
   an earlier one; likewise a fates row's group. A kill between two parts therefore leaves
   prompts without their groups (they are requeued) or groups without their fates (they are
   held): both are states the buffer really passed through, never a fate without its group.
2. The fates of a batch are flushed before the batch is sent, so every step the learner ever
   trained is in ``fates``. A kill between the flush and the send, or during the step, loses a
   step ``> S``, which is redone anyway. A drop lost with an unfinished flush is a group held
   again; it is dropped again if it is still stale.
3. What happened after the last flush (prompts issued, groups accepted, drops) reached no
   durable place: batches, metrics and checkpoints only ever contain flushed groups. Those
   prompt ids were never written, so issuing them again repeats no id in the recording.
4. Nothing recorded is issued or accepted twice: a recorded prompt id is either held (its group
   is recorded), requeued (it is not) or done, and new prompts start after the largest
   recorded id.

The replay buffer and the learner resume together: ``restart = "on-failure"`` is refused for
both, since a replay buffer restarted alone would rewind to the checkpoint while the live
learner is past it (and its batch request died with the old process), and a learner restarted
alone would rewind while the buffer has served the lost steps' groups. When either dies the job
stops; starting it again resumes both from the same checkpoint.

This module reads parquet only (no torch), so the replay process stays light.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from actors.runtime.recording import decode_group, parts, read_part, read_table
from actors.runtime.rundir import checkpoint_position
from messages.rollout import ScoredGroup


@dataclass(frozen=True)
class Recovered:
    """What the replay buffer was, as of checkpoint step ``step``, read from its recording."""

    step: int  # the checkpoint's step S; the next batch served is for step S + 1
    version: int
    issued: int  # prompt ids 0..issued-1 were issued
    next_rows: dict[str, int]  # dataset -> the row after the last one drawn
    trained: int
    reused: int
    retired: int
    dropped: collections.Counter[str]  # reasons of the accepted groups dropped
    held: list[ScoredGroup]  # in the order they are served again
    reusable: list[tuple[ScoredGroup, int]]  # (group, serves so far), next serve first
    requeued: list[tuple[str, int, int]]  # (dataset, row, prompt id) of prompts to issue again
    redone: int  # groups trained at steps > S, held again to be trained at the same steps
    missing_steps: tuple[int, ...]  # lineage steps <= S with no recorded batch (should be none)


def _groups_by_id(run_dir: Path, wanted: set[int]) -> dict[int, ScoredGroup]:
    """The recorded groups of ``wanted`` ids, decoded (messages are read only from the parts
    that hold one of them)."""
    out: dict[int, ScoredGroup] = {}
    if not wanted:
        return out
    for part in parts(run_dir, "groups"):
        ids = read_part(part, ["group_id"])["group_id"]
        hit = pc.is_in(ids, value_set=pa.array(sorted(wanted), ids.type))
        if not pc.any(hit).as_py():
            continue
        table = read_part(part, ["group_id", "message"]).filter(hit)
        for gid, message in zip(table["group_id"].to_pylist(), table["message"].to_pylist(),
                                strict=True):
            out[gid] = decode_group(message)
    return out


def read_recording(run_dir: Path, reuse: int = 1, step: int | None = None,
                   version: int | None = None) -> Recovered | None:
    """The replay buffer's state as of checkpoint ``step`` (default: the latest checkpoint's),
    read from the recording in ``run_dir``; None when nothing was recorded (a fresh run, or one
    with ``run.record = false``). ``reuse`` is ``replay.reuse`` (serves a group may get)."""
    prompts = read_table(run_dir, "prompts", columns=["prompt_id", "row", "dataset"]).to_pylist()
    if not prompts:
        return None
    if step is None or version is None:
        step, version = checkpoint_position(run_dir)
    where = {p["prompt_id"]: (p["dataset"], p["row"]) for p in prompts}
    accepted = list(dict.fromkeys(
        read_table(run_dir, "groups", columns=["group_id"])["group_id"].to_pylist()))

    lineage, dropped, retired = _fates(run_dir)
    serves = _serves(lineage)
    trained, reused, n_retired, reusable, redo = _tally(serves, dropped, retired, step, version,
                                                        reuse)
    redo.sort()
    reusable.sort()
    trained_ids = {gid for gid, ss in serves.items() if ss[0][0] <= step}
    out = trained_ids | set(dropped) | {gid for _, gid in redo}
    held_ids = [gid for _, gid in redo] + [gid for gid in accepted if gid not in out]
    groups = _groups_by_id(run_dir, set(held_ids) | {gid for _, gid, _ in reusable})

    accepted_set = set(accepted)
    next_rows: dict[str, int] = {}
    for dataset, row in where.values():
        next_rows[dataset] = max(next_rows.get(dataset, 0), row + 1)
    return Recovered(
        step=step, version=version, issued=max(where) + 1, next_rows=next_rows,
        trained=trained, reused=reused, retired=n_retired,
        dropped=collections.Counter(r for gid, r in dropped.items() if gid not in trained_ids),
        held=[groups[gid] for gid in held_ids],
        reusable=[(groups[gid], n) for _, gid, n in reusable],
        requeued=[(*where[pid], pid) for pid in sorted(where) if pid not in accepted_set],
        redone=len(redo), missing_steps=tuple(s for s in range(1, step + 1) if s not in lineage))


Lineage = dict[int, tuple[str, list[tuple[int, int]]]]  # step -> (incarnation, [(position, group id)])


def _fates(run_dir: Path) -> tuple[Lineage, dict[int, str], dict[int, int]]:
    """The recorded fates: the lineage (for each step, the trained fates of the latest
    incarnation that served it), the dropped groups with their reasons, and the retired ones
    with the version each was retired at."""
    lineage: Lineage = {}
    dropped: dict[int, str] = {}
    retired: dict[int, int] = {}  # group id -> version it was retired at
    for f in read_table(run_dir, "fates", columns=["group_id", "fate", "reason", "step",
                                                   "position", "version",
                                                   "incarnation"]).to_pylist():
        if f["fate"] == "dropped":
            dropped[f["group_id"]] = f["reason"]
        elif f["fate"] == "retired":
            retired[f["group_id"]] = f["version"]
        elif f["fate"] == "trained":
            inc, rows = lineage.get(f["step"], ("", []))
            if inc != f["incarnation"]:
                rows = []
                lineage[f["step"]] = (f["incarnation"], rows)
            rows.append((f["position"], f["group_id"]))
    return lineage, dropped, retired


def _serves(lineage: Lineage) -> dict[int, list[tuple[int, int]]]:
    """Group id -> its (step, position)s in the lineage, in order."""
    serves: dict[int, list[tuple[int, int]]] = {}
    for s in sorted(lineage):
        for pos, gid in sorted(lineage[s][1]):
            serves.setdefault(gid, []).append((s, pos))
    return serves


def _tally(serves: dict[int, list[tuple[int, int]]], dropped: dict[int, str],
           retired: dict[int, int], step: int, version: int, reuse: int
           ) -> tuple[int, int, int, list[tuple[tuple[int, int], int, int]],
                      list[tuple[tuple[int, int], int]]]:
    """As of checkpoint ``step`` (``version``): the groups trained, their extra serves, those
    retired, those that may be served again ((last serve, group id, serves)) and those whose
    every serve was lost ((first serve, group id): trained again)."""
    trained = reused = n_retired = 0
    reusable: list[tuple[tuple[int, int], int, int]] = []  # (last serve, group id, serves)
    redo: list[tuple[tuple[int, int], int]] = []  # (first serve, group id) of lost steps only
    for gid, ss in serves.items():
        done = [sp for sp in ss if sp[0] <= step]
        if done:
            trained += 1
            reused += len(done) - 1
            if gid in retired and retired[gid] <= version:
                n_retired += 1
            elif len(done) < reuse:  # retired after the checkpoint: it will be again if stale
                reusable.append((done[-1], gid, len(done)))
        elif gid not in dropped:
            redo.append((ss[0], gid))
    return trained, reused, n_retired, reusable, redo
