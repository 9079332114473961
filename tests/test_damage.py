"""Damage on disk, found: a checkpoint's files against the checksums written with it, and a
jsonl record's last line cut by a kill."""

from __future__ import annotations

import json

import pytest

from actors.runtime.recording import (
    RecordingDamaged,
    TableWriter,
    damaged_parts,
    parts,
    read_part,
    read_table,
)
from actors.runtime.rundir import (
    CHECKSUMS,
    STATE_FILE,
    cut_torn_line,
    damage,
    set_aside_damaged,
    write_checksums,
)


def checkpoint(path, step: int):
    (path / "optimizer").mkdir(parents=True)
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (path / "optimizer" / "__0_0.distcp").write_bytes(b"state" * 100)
    (path / STATE_FILE).write_text(json.dumps({"step": step, "checksums": CHECKSUMS}))
    write_checksums(path)
    return path


def test_each_kind_of_damage_is_named(tmp_path):
    ckpt = checkpoint(tmp_path / "step_2", 2)
    assert damage(ckpt) is None
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 1  # one bit
    weights.write_bytes(bytes(data))
    assert damage(ckpt) == "model.safetensors is not what was written (its checksum differs)"
    weights.write_bytes(bytes(data[:100]))
    assert damage(ckpt) == "model.safetensors holds 100 bytes where 16,384 were written"
    data[1000] ^= 1
    weights.write_bytes(bytes(data))
    assert damage(ckpt) is None
    (ckpt / "optimizer" / "__0_0.distcp").unlink()
    assert damage(ckpt) == "optimizer/__0_0.distcp is missing"
    (ckpt / CHECKSUMS).write_text("{not json")
    assert damage(ckpt).startswith(f"{CHECKSUMS} cannot be read")
    (ckpt / CHECKSUMS).unlink()  # its state file names the checksums written with it
    assert damage(ckpt) == f"{CHECKSUMS} is missing"
    (ckpt / STATE_FILE).write_text("{not json")
    assert damage(ckpt).startswith(f"{STATE_FILE} cannot be read")
    (ckpt / STATE_FILE).write_text(json.dumps({"step": 2}))  # from before checksums: the state
    assert damage(ckpt) is None
    (ckpt / STATE_FILE).unlink()
    assert damage(ckpt) == f"{STATE_FILE} is missing"


def test_the_damaged_newest_are_set_aside_down_to_a_whole_one(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 4, 6):
        checkpoint(root / f"step_{step}", step)
    (root / "step_6" / "model.safetensors").write_bytes(b"")
    (root / "step_4" / STATE_FILE).unlink()
    (root / "step_1" / "optimizer" / "__0_0.distcp").write_bytes(b"")  # under a whole one
    lines = set_aside_damaged(tmp_path)
    assert lines == [
        "checkpoint step_6 is damaged: model.safetensors holds 0 bytes where 16,384 were "
        "written; set aside as step_6.damaged",
        "checkpoint step_4 is damaged: trainer_state.json is missing; set aside as "
        "step_4.damaged"]
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2", "step_4.damaged",
                                                      "step_6.damaged"]


def test_a_torn_last_line_is_cut_and_whole_ones_are_kept(tmp_path):
    path = tmp_path / "status.jsonl"
    assert not cut_torn_line(path)  # none yet
    path.write_text('{"a": 1}\n{"b": 2}\n')
    assert not cut_torn_line(path) and path.read_text() == '{"a": 1}\n{"b": 2}\n'
    path.write_text('{"a": 1}\n{"b": 2}\n{"c": ' + "x" * (3 << 20))  # longer than a read
    assert cut_torn_line(path) and path.read_text() == '{"a": 1}\n{"b": 2}\n'
    path.write_text('{"only": "cut')
    assert cut_torn_line(path) and path.read_text() == ""


def test_a_recording_part_cut_short_or_changed_is_named_never_read_wrong(tmp_path):
    """A part cut short is named; so is one with any byte changed, the footer's too (parquet
    checksums its pages only: a changed bit there could read back as other rows)."""
    writer = TableWriter(tmp_path, "metrics")
    for step in (1, 2):
        writer.append({"step": step, "metrics": {"loss": 0.5 * step, "kl": 0.01}})
        writer.flush()
    assert read_table(tmp_path, "metrics")["step"].to_pylist() == [1, 2]
    first, second = parts(tmp_path, "metrics")
    whole = second.read_bytes()
    written = read_part(second)
    found = 0
    for at in range(len(whole)):  # each byte in turn, one bit of it flipped
        changed = bytearray(whole)
        changed[at] ^= 1 << (at % 8)
        second.write_bytes(bytes(changed))
        try:
            assert read_part(second).equals(written), f"byte {at} changed what is read"
        except RecordingDamaged as exc:
            assert str(exc).startswith(f"record/metrics/{second.name} is damaged (")
            found += 1
    assert found == len(whole)
    second.write_bytes(whole)
    first.write_bytes(first.read_bytes()[:300])  # cut short
    assert damaged_parts(tmp_path) == [
        next(line for line in damaged_parts(tmp_path) if first.name in line)]
    with pytest.raises(RecordingDamaged, match=f"record/metrics/{first.name} is damaged"):
        read_table(tmp_path, "metrics")
