"""Every run is a recording: append-only parquet tables under ``RUN_DIR/record/``.

Each table is a directory of part files, ``record/<table>/part-<incarnation>-<seq>-<crc>.parquet``;
each part holds the rows of one flush as one row group and is written to a temporary name and
renamed, so a run killed at any moment leaves only whole parts: the table reads back up to the
last flush. ``incarnation`` is the writing process's start time in nanoseconds (zero-padded),
so parts sort in the order they were written across restarts and resumes. ``crc`` is the whole
file's CRC-32: parquet checksums its pages but not its footer, where a changed bit can read
back as other rows without an error (parts named without one, from before, are read by their
page checksums alone).

Tables (who writes them, when they are flushed):

- ``prompts`` (replay buffer, before each batch it serves and at exit): every prompt issued —
  ``prompt_id``, dataset ``row``, ``dataset`` name.
- ``groups`` (replay buffer, same flushes): every scored group accepted — readable columns
  (prompt text, completions, rewards, reward errors, token ids, behaviour log-probs, policy
  versions, sampler, timings) and ``message``, the group's exact msgspec encoding, from which
  an offline rerun rebuilds the learner's input bit for bit.
- ``fates`` (replay buffer, same flushes): what happened to each group — ``trained`` at
  ``step`` (``position`` in that batch, ``served`` = how many times it has now been served; with
  ``replay.reuse > 1`` a group has one such row per serve, its first with ``served = 1``),
  ``dropped`` with a ``reason`` (``stale``, ``filtered``: all rewards equal, ``score_failed``:
  no reward worker answered), or ``retired``
  (reason ``stale``: a trained group that went stale before its last serve).
- ``batches`` and ``metrics`` (learner: rows appended by the thread that took the step, flushed
  in the background while the next batch is fetched, before each checkpoint and at exit): the
  group ids of each step's batch, and the step's metrics.

- ``validation`` and ``validation_metrics`` (replay buffer, when a validation round is complete,
  before it is reported): each validation prompt's samples of the round of ``step`` (texts,
  rewards, extracted answers, lengths, policy versions), and the round's metrics and wall time.

The replay buffer's three tables are its write-ahead log: a resumed run rebuilds the buffer from
them (``actors/replay/resume.py``, which says why any kill leaves them consistent).

Readers take the last record of a key when a resumed run wrote it again (steps after the
checkpoint it resumed from are trained again).
"""

from __future__ import annotations

import os
import re
import threading
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from actors.runtime.rundir import RECORD_DIR, DiskFull, out_of_space
from messages.rollout import ScoredGroup

INCARNATION = f"{time.time_ns():020d}"  # this process's parts sort after any earlier process's


def _new_incarnation() -> None:
    """A forked process is another incarnation than the one it was forked from (an actor forked
    by the fork server, restarted or of another job, writes parts of its own)."""
    global INCARNATION
    INCARNATION = f"{time.time_ns():020d}"


os.register_at_fork(after_in_child=_new_incarnation)

_str, _i64, _f64 = pa.string(), pa.int64(), pa.float64()

SCHEMAS: dict[str, pa.Schema] = {
    "prompts": pa.schema([
        ("prompt_id", _i64), ("row", _i64), ("dataset", _str), ("time", _f64),
        ("incarnation", _str),
    ]),
    "groups": pa.schema([
        ("group_id", _i64), ("time", _f64), ("data_source", _str), ("prompt", _str),
        ("ground_truth", _str), ("sampler", _str), ("version_min", _i64), ("version_max", _i64),
        ("completions", pa.list_(_str)), ("rewards", pa.list_(_f64)),
        ("reward_errors", pa.list_(_str)), ("finish_reasons", pa.list_(_str)),
        ("policy_versions", pa.list_(_i64)), ("response_ids", pa.list_(pa.list_(pa.int32()))),
        ("behaviour_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("baseline_reward", _f64), ("generate_seconds", _f64), ("score_seconds", _f64),
        ("message", pa.binary()), ("incarnation", _str),
    ]),
    "fates": pa.schema([
        ("group_id", _i64), ("fate", _str), ("reason", _str), ("step", _i64),
        ("position", _i64), ("served", _i64), ("version", _i64), ("time", _f64),
        ("incarnation", _str),
    ]),
    "batches": pa.schema([
        ("step", _i64), ("group_ids", pa.list_(_i64)), ("version", _i64), ("time", _f64),
        ("incarnation", _str),
        # the learner's thread counts in the step, run-length encoded (null: not borrowing)
        ("threads", pa.list_(_i64)),
    ]),
    "metrics": pa.schema([
        ("step", _i64), ("metrics", pa.map_(_str, _f64)), ("time", _f64), ("incarnation", _str),
    ]),
    "validation": pa.schema([
        ("step", _i64), ("prompt_id", _i64), ("data_source", _str), ("prompt", _str),
        ("ground_truth", _str), ("sampler", _str), ("completions", pa.list_(_str)),
        ("rewards", pa.list_(_f64)), ("answers", pa.list_(_str)),
        ("reward_errors", pa.list_(_str)), ("finish_reasons", pa.list_(_str)),
        ("response_lengths", pa.list_(_i64)), ("policy_versions", pa.list_(_i64)),
        ("generate_seconds", _f64), ("score_seconds", _f64), ("time", _f64),
        ("incarnation", _str),
    ]),
    "validation_metrics": pa.schema([
        ("step", _i64), ("metrics", pa.map_(_str, _f64)), ("seconds", _f64), ("time", _f64),
        ("incarnation", _str),
    ]),
}

_group_encoder = msgspec.msgpack.Encoder()
_group_decoder = msgspec.msgpack.Decoder(ScoredGroup)


def _bulk(t: pa.DataType) -> bool:
    """Bytes, or numbers in lists: data too varied for a dictionary to pay."""
    while pa.types.is_list(t):
        t = t.value_type
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            return True
    return pa.types.is_binary(t)


class TableWriter:
    """Buffers rows of one table and writes them as one whole part file per ``flush``."""

    def __init__(self, run_dir: Path, table: str) -> None:
        if table not in SCHEMAS:
            raise ValueError(f"unknown recording table {table!r}; tables: {sorted(SCHEMAS)}")
        self.table = table
        self.schema = SCHEMAS[table]
        self.dir = Path(run_dir) / RECORD_DIR / table
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.lock = threading.Lock()  # rows may be appended by one thread and flushed by another
        self.writing = threading.Lock()  # one flush at a time: parts are numbered in order
        # dictionary-encode the names and labels only: token ids, log-probs and encoded
        # messages are all but unique, so a dictionary of them only slows the write
        self.dictionary = [f.name for f in self.schema if not _bulk(f.type)]
        self.seq = 0
        self.written = 0  # rows flushed so far

    def append(self, row: dict[str, Any]) -> None:
        row = {"time": time.time(), "incarnation": INCARNATION, **row}
        with self.lock:
            self.rows.append(row)

    def flush(self) -> Path | None:
        """Write the buffered rows (if any) as one part: temp name, fsync, rename.

        Rows appended (by any thread) while this writes go to the next part.
        """
        with self.writing:
            with self.lock:
                rows, self.rows = self.rows, []
            try:
                return self._write(rows) if rows else None
            except Exception:
                with self.lock:  # kept for a flush once there is room: none is lost here
                    self.rows[:0] = rows
                raise

    def _write(self, rows: list[dict[str, Any]]) -> Path:
        table = pa.Table.from_pylist(rows, schema=self.schema)
        tmp = self.dir / f".part-{INCARNATION}-{self.seq:06d}.parquet.tmp"
        data, name = part_file(table, INCARNATION, self.seq, self.dictionary)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except Exception as exc:
            tmp.unlink(missing_ok=True)
            if out_of_space(exc, self.dir):
                raise DiskFull(self.dir, f"the recording's {self.table} table",
                               table.nbytes) from exc
            raise
        final = self.dir / name
        os.replace(tmp, final)
        self.seq += 1
        self.written += len(rows)
        return final


def part_file(table: pa.Table, incarnation: str, seq: int,
              dictionary: bool | list[str] = True) -> tuple[pa.Buffer, str]:
    """A part's bytes (parquet, each page checksummed; one row group) and its file name,
    which carries their CRC-32 (``read_part`` checks it)."""
    sink = pa.BufferOutputStream()  # in memory first: its CRC-32 goes in its name
    pq.write_table(table, sink, row_group_size=max(1, table.num_rows),
                   use_dictionary=dictionary, write_page_checksum=True)
    data = sink.getvalue()
    return data, f"part-{incarnation}-{seq:06d}-{zlib.crc32(data):08x}.parquet"


class Recorder:
    """The writers one actor owns; ``flush`` writes them all (in the order they were opened)."""

    def __init__(self, run_dir: Path, tables: Iterable[str], enabled: bool = True) -> None:
        self.enabled = enabled
        self.writers = {t: TableWriter(run_dir, t) for t in tables} if enabled else {}

    def append(self, table: str, row: dict[str, Any]) -> None:
        if self.enabled:
            self.writers[table].append(row)

    def flush(self, tables: Iterable[str] | None = None) -> None:
        """Write every table's buffered rows (or only ``tables``'), in the order they were opened."""
        only = None if tables is None else set(tables)
        for name, w in self.writers.items():
            if only is None or name in only:
                w.flush()


def group_row(group: ScoredGroup) -> dict[str, Any]:
    """A ``groups`` row: readable columns plus the exact encoded message."""
    versions = [s.policy_version for s in group.samples]
    prompt = "\n".join(f"{m.role}: {m.content}" for m in group.prompt.messages)
    return {
        "group_id": group.prompt.prompt_id,
        "data_source": group.prompt.data_source,
        "prompt": prompt,
        "ground_truth": group.prompt.ground_truth,
        "sampler": group.sampler,
        "version_min": min(versions, default=0),
        "version_max": max(versions, default=0),
        "completions": [s.text for s in group.samples],
        "rewards": [s.reward for s in group.samples],
        "reward_errors": [s.reward_error for s in group.samples],
        "finish_reasons": [s.finish_reason for s in group.samples],
        "policy_versions": versions,
        # numpy views, not lists: pyarrow copies them in bulk, where tolist and a list
        # conversion would run per element in the replay buffer's event loop
        "response_ids": [np.frombuffer(s.response_ids.data, dtype=np.int32)
                         for s in group.samples],
        "behaviour_logprobs": [np.frombuffer(s.behaviour_logprobs.data, dtype=np.float32)
                               for s in group.samples],
        "baseline_reward": group.baseline_reward,
        "generate_seconds": group.generate_seconds,
        "score_seconds": group.score_seconds,
        "message": _group_encoder.encode(group),
    }


def decode_group(message: bytes) -> ScoredGroup:
    """The exact ``ScoredGroup`` a ``groups`` row recorded."""
    return _group_decoder.decode(message)


def parts(run_dir: Path, table: str) -> list[Path]:
    """The whole part files of ``table``, in the order they were written."""
    return sorted((Path(run_dir) / RECORD_DIR / table).glob("part-*.parquet"))


class RecordingDamaged(ValueError):
    """A part file of the recording that cannot be read whole: cut short, or bytes changed on
    disk since it was written (the whole file's CRC-32 is in its name, each page carries its
    own)."""


NAMED_CRC = re.compile(r"part-\d+-\d+-([0-9a-f]{8})\.parquet")


def read_part(path: Path, columns: list[str] | None = None) -> pa.Table:
    """One part file, checked against the CRC-32 in its name and its pages against theirs;
    RecordingDamaged names it."""
    name = f"{RECORD_DIR}/{path.parent.name}/{path.name}"
    schema = SCHEMAS.get(path.parent.name)
    named = NAMED_CRC.fullmatch(path.name)
    source: Path | pa.BufferReader = path
    if named is not None:  # read once: checked whole, then parsed from memory
        data = path.read_bytes()
        if zlib.crc32(data) != int(named.group(1), 16):
            raise RecordingDamaged(f"{name} is damaged (not what was written: its CRC-32 "
                                   "differs from the one in its name)")
        source = pa.BufferReader(data)
    try:
        table = pq.read_table(source, columns=columns, page_checksum_verification=True)
        # the footer's schema carries no checksum: a changed name or type is damage too
        wrong = [f for f in table.schema if schema is not None and (
            schema.get_field_index(f.name) < 0 or schema.field(f.name).type != f.type)]
    except (pa.ArrowException, OSError, ValueError) as exc:  # (names that are not UTF-8)
        raise RecordingDamaged(f"{name} is damaged ({str(exc).splitlines()[0][:160]})") from None
    if wrong:
        raise RecordingDamaged(f"{name} is damaged (a column {wrong[0].name!r} of type "
                               f"{wrong[0].type} that the table does not have)")
    return table


def damaged_parts(run_dir: Path) -> list[str]:
    """One line for each part file of the recording that cannot be read whole."""
    found = []
    for table in sorted(SCHEMAS):
        for path in parts(run_dir, table):
            try:
                read_part(path)
            except RecordingDamaged as exc:
                found.append(str(exc))
    return found


def read_table(run_dir: Path, table: str, columns: list[str] | None = None) -> pa.Table:
    """All flushed rows of ``table`` (an empty table with the schema when nothing was recorded)."""
    if table not in SCHEMAS:
        raise ValueError(f"unknown recording table {table!r}; tables: {sorted(SCHEMAS)}")
    schema = SCHEMAS[table]
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    tables = [read_part(p, columns) for p in parts(run_dir, table)]
    if not tables:
        return schema.empty_table()
    # parts written before a column was added have none: null there
    return pa.concat_tables(tables, promote_options="default")


def last_by(table: pa.Table, key: str) -> dict[Any, dict[str, Any]]:
    """``{key value: row}`` keeping the last row written for each key (a resumed run's rewrite)."""
    out: dict[Any, dict[str, Any]] = {}
    for row in table.to_pylist():
        out[row[key]] = row
    return out
