"""Chaos on a live job, real processes over real sockets, on a tiny random llama.

A reward worker killed with SIGKILL mid-run is restarted by the runner and what it had in flight
is re-sent, so the job finishes with every step's batch complete; a second reward worker attached
by hand (``runner.py attach reward --to RUN_DIR``) gets work, shows in the router's status and,
on Ctrl-C, says bye, answers what it has and exits 0 while the job goes on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_end_to_end import (
    ROOT,
    actor_pids,
    balanced,
    command,
    metrics,
    tiny_model,
    wait_for_steps,
)

__all__ = ["tiny_model"]  # the fixture, shared with the end-to-end tests

FAST = ["run.status_interval=1", "run.heartbeat_interval=0.5"]


def start_job(model: Path, run_dir: Path, log: Path, *overrides: str) -> subprocess.Popen:
    with log.open("w") as out:  # a file, not a pipe: the status tables never block the runner
        return subprocess.Popen(command(model, run_dir, *FAST, *overrides), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, text=True)


def pids_of(run_dir: Path, kind: str) -> list[int]:
    out = []
    for pid in actor_pids(run_dir):
        try:
            if kind.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                out.append(pid)
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def last_router_status(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip().startswith("router-0")]
    return lines[-1] if lines else ""


def test_killed_reward_worker_is_restarted_and_no_request_is_lost(tiny_model, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    proc = start_job(tiny_model, run_dir, log, "learner.total_steps=10", "reward.capacity=1")
    try:
        wait_for_steps(run_dir, 2, proc)
        reward = pids_of(run_dir, "reward")
        assert len(reward) == 1
        os.kill(reward[0], signal.SIGKILL)
        proc.wait(timeout=150)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert "actor reward-0" in out and "killed by signal SIGKILL" in out
    assert "restarting reward-0" in out
    rows = metrics(run_dir)
    # a lost scoring request would stall its sampler for good: every step's batch came complete
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(balanced(r) for r in rows)
    assert "duplicates=" in last_router_status(out)
    assert not actor_pids(run_dir)


@pytest.mark.parametrize("to", ["run_dir", "address"])
def test_attached_reward_worker_gets_work_and_detaches_cleanly(tiny_model, tmp_path, to):
    run_dir, log, attach_log = tmp_path / "run", tmp_path / "runner.log", tmp_path / "attach.log"
    total = 80
    proc = start_job(tiny_model, run_dir, log, f"learner.total_steps={total}", "reward.capacity=1")
    worker = None
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "topology.json").is_file():  # written before any actor starts
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        target = str(run_dir)
        if to == "address":  # as from another machine: only the router's worker address
            target = json.loads((run_dir / "topology.json").read_text())["router"]["worker_address"]
        with attach_log.open("w") as out:
            worker = subprocess.Popen(
                [sys.executable, str(ROOT / "runner.py"), "attach", "reward", "--to", target,
                 "reward.capacity=2"], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True)
        name = f"reward-attached-{worker.pid}"
        busy = re.compile(rf"{name}=\d+/2 done=[1-9]")
        deadline = time.monotonic() + 60
        while not busy.search(log.read_text()):  # the router's status lists it, with work done
            assert worker.poll() is None, attach_log.read_text()
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        steps_at_detach = len(metrics(run_dir))
        worker.send_signal(signal.SIGINT)  # Ctrl-C: detach
        assert worker.wait(timeout=30) == 0, attach_log.read_text()
        said = attach_log.read_text()
        done = re.search(rf"=== {name} detached: (\d+) requests done", said)
        assert done and int(done.group(1)) > 0, said
        assert "Traceback" not in said, said
        assert not alive(worker.pid)
        detached_at = len(log.read_text())
        proc.wait(timeout=150)
    finally:
        if worker is not None:
            worker.kill()
            worker.wait(timeout=30)
        proc.kill()
        proc.wait(timeout=30)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert steps_at_detach < total  # it left while the job ran, and the job went on without it
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert all(balanced(r) for r in rows)
    after = out[detached_at:]
    if after.count("--- status at") >= 2:  # the router's status, updated since the bye, drops it
        assert name not in last_router_status(after), after[-2000:]
    assert "!!!" not in out, out[-4000:]  # nothing in the job died or was restarted
    assert not actor_pids(run_dir)


BAD_REWARD = '''
import time

from actors.tasks import repeat_letter_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A user function that hangs, raises or allocates without bound on some prompts."""
    kind = extra_info["index"] % 4
    if kind == 0:
        while True:
            time.sleep(1)
    if kind == 1:
        raise RuntimeError("the judge is down")
    if kind == 2:
        hoard = []
        while True:
            hoard.append(bytearray(64 << 20))
    return repeat_letter_score(data_source, solution_str, ground_truth, extra_info)
'''


def test_reward_functions_that_hang_raise_or_hoard_memory_cost_their_samples_not_the_job(
        tiny_model, tmp_path):
    """The job finishes every step; each failure is a 0.0 score with its error kept with the
    sample in the recording, and counted by the reward worker."""
    (tmp_path / "bad_reward.py").write_text(BAD_REWARD)
    topology = tmp_path / "topology.toml"
    topology.write_text((ROOT / "topology.toml").read_text() + f'''
[[reward.functions]]
path = "{tmp_path / 'bad_reward.py'}"
''')
    run_dir = tmp_path / "run"
    cmd = command(tiny_model, run_dir, *FAST, "learner.total_steps=4", "reward.timeout_s=0.5", "algorithm.n=4",
                  "reward.memory_mb=512", "reward.processes=2")
    cmd[2] = str(topology)
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(balanced(r) for r in rows)
    assert not actor_pids(run_dir)

    from actors.recording import read_table
    by_kind: dict[str, list[float]] = {"hang": [], "raise": [], "memory": [], "ok": []}
    for g in read_table(run_dir, "groups").to_pylist():
        said = " ".join(g["reward_errors"])
        if "timed out" in said:
            by_kind["hang"] += g["rewards"]
        elif "the judge is down" in said:
            by_kind["raise"] += g["rewards"]
        elif "MemoryError" in said or "killed" in said:
            by_kind["memory"] += g["rewards"]
        else:
            assert set(g["reward_errors"]) == {""}
            by_kind["ok"] += g["rewards"]
    for kind, rewards in by_kind.items():
        assert rewards, f"no group of kind {kind} was recorded"
        if kind != "ok":
            assert set(rewards) == {0.0}, kind
    assert re.search(r"score_errors=[1-9]", res.stdout) and re.search(r"score_timeouts=[1-9]", res.stdout)
