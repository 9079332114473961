"""A disk that fills up under a running job: the run directory on a small tmpfs (mounting one
needs root; skipped, saying so, elsewhere), filled while the job is stopped so that the next
checkpoint cannot fit. The job stops with one line naming the folder and the space needed, the
last good checkpoint intact and no half-written one left; once space is freed the same command
resumes and trains every step once."""

from __future__ import annotations

import subprocess

import pytest

from actors.runtime.rundir import damage
from tests.jobs import ROOT, command, metrics
from tests.tiny_model import build_tiny_model


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a small tmpfs needs root: {done.stderr.strip()[:200]}")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk, leave: int) -> None:
    """Fill ``disk`` up to ``leave`` bytes free."""
    import shutil

    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


@pytest.mark.slow  # three tiny jobs each, a minute and a half
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_full_disk_stops_the_job_in_one_line_and_the_same_command_resumes(small_disk,
                                                                             tmp_path, ranks):
    """With two ranks too (a sharded learner: the optimizer's state written by both): an
    older checkpoint is removed before the next is written, so the ranks never have to agree
    mid-write."""
    model = build_tiny_model(tmp_path / "model")
    run = small_disk / "run"
    job = command(model, run, "learner.total_steps=4", "learner.save_every=2",
                  f"learner.nproc_per_node={ranks}")
    first = subprocess.run([*job, "learner.total_steps=2"], cwd=ROOT,  # (the last one wins)
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    whole = run / "checkpoints" / "step_2"
    size = sum(f.stat().st_size for f in whole.rglob("*") if f.is_file())
    fill(small_disk, size // 3)  # room for the recording of two steps, not a checkpoint
    full = subprocess.run(job, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = full.stdout + full.stderr
    assert full.returncode != 0, out[-3000:]
    assert f"no space left in {run}/" in out and "are free): free some and run the same " \
           "command again to resume" in out, out[-3000:]
    assert "!!! restarting" not in out  # a restart would find no more room
    lines = {line for line in out.splitlines() if "no space left in" in line}
    print("\n".join(sorted(lines)))
    assert any(line.startswith("error: [") for line in lines), lines  # the actor's one line
    assert damage(whole) is None  # the last good checkpoint, intact
    assert not list((run / "checkpoints").glob(".tmp_step_*"))  # nothing half-written left
    (small_disk / "filler").unlink()
    again = subprocess.run(job, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming from step_2" in again.stdout
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    assert damage(run / "checkpoints" / "step_4") is None
    # full again, with an older checkpoint than the newest: it goes to make room, and the job
    # trains on, saying so
    fill(small_disk, size // 3)
    more = subprocess.run([*job, "learner.total_steps=6"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert (f"no space left in {run}/checkpoints for step_6: removed step_2 to make room "
            "(fewer than learner.keep_checkpoints") in more.stdout + more.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_4", "step_6"]


@pytest.mark.slow  # three tiny jobs and two stopped ones, under a minute
def test_a_disk_full_before_a_checkpoint_is_due_stops_the_job_and_the_same_command_resumes(
        small_disk, tmp_path):
    """No checkpoint due: a disk full at the job's start stops the runner in one line; one
    with room for the start alone stops the job at the first write that finds none (a
    recording's flush, a record); neither restarts anything nor prints a traceback, and once
    room is freed the same command resumes from the last checkpoint, every step recorded once."""
    model = build_tiny_model(tmp_path / "model")
    run = small_disk / "run"
    job = command(model, run, "learner.total_steps=4", "learner.save_every=2")
    first = subprocess.run([*job, "learner.total_steps=2"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for leave in (0, 64 << 10):
        fill(small_disk, leave)
        full = subprocess.run(job, cwd=ROOT, capture_output=True, text=True, timeout=300)
        out = full.stdout + full.stderr
        lines = sorted({line for line in out.splitlines() if "no space left in" in line})
        print(leave, "\n".join(lines))
        assert full.returncode != 0, out[-3000:]
        assert any(line.startswith("error: ") and f"no space left in {run}" in line and
                   line.endswith("free some and run the same command again to resume")
                   for line in lines), out[-3000:]
        assert "!!! restarting" not in out and "Traceback" not in out, out[-3000:]
        assert damage(run / "checkpoints" / "step_2") is None
        (small_disk / "filler").unlink()
    again = subprocess.run(job, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming from step_2" in again.stdout
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    from actors.runtime.recording import last_by, read_table
    assert sorted(last_by(read_table(run, "metrics"), "step")) == [1, 2, 3, 4]


def test_a_recording_flush_on_a_full_disk_says_so_and_loses_no_row(small_disk):
    """The recording's writer on a full disk: one line naming its table's folder and the space
    needed, no half-written part, the rows kept; the next flush, once there is room, writes
    them (the actor exits with that line on it, as the learner does for a checkpoint)."""
    from actors.runtime.recording import TableWriter, read_table
    from actors.runtime.rundir import RECORD_DIR, DiskFull

    run = small_disk / "run"
    writer = TableWriter(run, "metrics")
    writer.append({"step": 1, "metrics": {"loss": 1.0}})
    writer.flush()
    fill(small_disk, 0)
    writer.append({"step": 2, "metrics": {"loss": 2.0, "kl": 0.5}})
    with pytest.raises(DiskFull) as caught:
        writer.flush()
    assert str(caught.value).startswith(
        f"no space left in {run / RECORD_DIR / 'metrics'} for the recording's metrics table "
        "(it needs about ")
    assert [p.name for p in (run / RECORD_DIR / "metrics").iterdir()
            if not p.name.startswith("part-")] == []  # no temp file left
    assert read_table(run, "metrics")["step"].to_pylist() == [1]
    (small_disk / "filler").unlink()
    writer.flush()
    assert read_table(run, "metrics")["step"].to_pylist() == [1, 2]
