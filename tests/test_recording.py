"""The parquet recording: parts are whole, read back in order, and keep the exact group."""

from __future__ import annotations

import pytest

from actors.runtime.recording import (
    RECORD_DIR,
    Recorder,
    TableWriter,
    decode_group,
    group_row,
    last_by,
    parts,
    read_table,
)
from tests.helpers import sample_group


def test_groups_round_trip_exactly(tmp_path):
    group = sample_group()
    rec = Recorder(tmp_path, ["groups"])
    rec.append("groups", group_row(group))
    rec.flush()
    rows = read_table(tmp_path, "groups").to_pylist()
    assert len(rows) == 1
    row = rows[0]
    assert decode_group(row["message"]) == group
    assert row["group_id"] == 7 and row["rewards"] == [1.0, 1.0]
    assert row["response_ids"] == [[1, 2, 3], [1, 2, 3]]
    assert row["behaviour_logprobs"][0] == [-0.5, -1.0, -2.0]
    assert row["prompt"] == "system: s\nuser: 1 + 2" and row["version_min"] == 4


def test_each_flush_is_one_whole_part_and_empty_flushes_write_nothing(tmp_path):
    w = TableWriter(tmp_path, "metrics")
    assert w.flush() is None
    for step in (1, 2):
        w.append({"step": step, "metrics": {"loss": float(step)}})
        w.flush()
    w.append({"step": 3, "metrics": {"loss": 3.0}})  # buffered, never flushed: a kill here
    # a temp file left by a write that was killed half-way is not a part
    (w.dir / ".part-x.parquet.tmp").write_bytes(b"PAR1 half a file")
    assert len(parts(tmp_path, "metrics")) == 2
    table = read_table(tmp_path, "metrics")
    assert table["step"].to_pylist() == [1, 2]
    assert dict(table["metrics"][1].as_py()) == {"loss": 2.0}


def test_missing_table_reads_empty_and_unknown_table_is_refused(tmp_path):
    assert read_table(tmp_path, "batches").num_rows == 0
    assert read_table(tmp_path, "batches").schema.names[0] == "step"
    with pytest.raises(ValueError, match="unknown recording table 'batch'"):
        read_table(tmp_path, "batch")
    with pytest.raises(ValueError, match="unknown recording table"):
        TableWriter(tmp_path, "nope")


def test_last_by_keeps_a_resumed_runs_rewrite(tmp_path):
    rec = Recorder(tmp_path, ["batches"])
    rec.append("batches", {"step": 1, "group_ids": [0, 1], "version": 0})
    rec.append("batches", {"step": 2, "group_ids": [2, 3], "version": 1})
    rec.append("batches", {"step": 2, "group_ids": [4, 5], "version": 1})
    rec.flush()
    by_step = last_by(read_table(tmp_path, "batches"), "step")
    assert by_step[2]["group_ids"] == [4, 5] and by_step[1]["group_ids"] == [0, 1]


def test_disabled_recorder_writes_nothing(tmp_path):
    rec = Recorder(tmp_path, ["groups"], enabled=False)
    rec.append("groups", group_row(sample_group()))
    rec.flush()
    assert not (tmp_path / "record").exists()


def test_parts_written_before_a_column_was_added_read_with_nulls_there(tmp_path):
    """A run resumed by a newer flowrl: its older parts lack the batches' ``threads``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = pa.schema([f for f in TableWriter(tmp_path, "batches").schema if f.name != "threads"])
    old_part = tmp_path / RECORD_DIR / "batches" / f"part-{0:020d}-000000.parquet"  # earlier
    assert old_part.parent.is_dir()
    pq.write_table(pa.Table.from_pylist([{"step": 1, "group_ids": [0], "version": 0,
                                          "time": 0.0, "incarnation": "a"}], schema=old), old_part)
    w = TableWriter(tmp_path, "batches")
    w.append({"step": 2, "group_ids": [1], "version": 1, "threads": [2, 3, 1, 6]})
    w.flush()
    rows = read_table(tmp_path, "batches").to_pylist()
    assert [(r["step"], r["threads"]) for r in rows] == [(1, None), (2, [2, 3, 1, 6])]


def test_a_forked_process_is_an_incarnation_of_its_own():
    """Actors are forked from a fork server that imported this module once: a restarted
    actor, or one of another job forked from the same server, must not write parts under its
    predecessor's names (it would replace them)."""
    import os

    from actors.runtime import recording

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, recording.INCARNATION.encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child and child != recording.INCARNATION and child > recording.INCARNATION
