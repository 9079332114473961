"""Chaos on a live job, real processes over real sockets, on a tiny random llama.

A reward worker killed with SIGKILL mid-run is restarted by the runner and what it had in flight
is re-sent, so the job finishes with every step's batch complete; a second reward worker attached
by hand (``runner.py attach reward --to RUN_DIR``) gets work, shows in the router's status and,
on Ctrl-C, says bye, answers what it has and exits 0 while the job goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import (
    FAST,
    ROOT,
    actor_pids,
    alive,
    balanced,
    command,
    metrics,
    pids_of,
    start_job,
    status_lines,
)

BLOCKING_REWARD = '''
import os
import time
from pathlib import Path
from pathlib import Path

from actors.scoring.rules import repeat_letter_score

FLAG = Path({flag!r})


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """While FLAG exists, every call says it is in flight and waits for FLAG to go."""
    if FLAG.exists():
        (FLAG.parent / f"in_flight-{{os.getpid()}}").touch()
        while FLAG.exists():
            time.sleep(0.05)
    return repeat_letter_score(data_source, solution_str, ground_truth, extra_info)
'''


def test_killed_reward_worker_is_restarted_and_no_request_is_lost(tiny_model, tmp_path):
    """The worker is killed while it holds a request (its scoring function is blocked on a
    flag): the router takes the request back and re-sends it, so every step's batch comes."""
    flag = tmp_path / "block"
    flag.touch()
    (tmp_path / "blocking_reward.py").write_text(BLOCKING_REWARD.format(flag=str(flag)))
    topology = tmp_path / "topology.toml"
    topology.write_text((ROOT / "topology.toml").read_text() + f'''
[[reward.functions]]
path = "{tmp_path / 'blocking_reward.py'}"
''')
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    cmd = command(tiny_model, run_dir, *FAST, "learner.total_steps=10", "reward.capacity=1")
    cmd[2] = str(topology)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("in_flight-*")):  # a request is held by reward-0 now
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        reward = pids_of(run_dir, "reward")
        assert len(reward) == 1
        os.kill(reward[0], signal.SIGKILL)
        flag.unlink()  # the restarted worker scores as usual
        proc.wait(timeout=150)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()[-4000:]
    status = status_lines(run_dir)
    (exited,) = [line for line in status if line["event"] == "exited"]
    assert exited["actor"] == "reward-0" and exited["returncode"] == -signal.SIGKILL
    assert exited["restart"] and status[-1]["reward-0"]["restarts"] == 1
    assert status[-1]["router-0"]["resent"] >= 1  # what it held went to the new worker
    rows = metrics(run_dir)
    # a lost scoring request would stall its sampler: every step's batch came complete
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(balanced(r) for r in rows)
    assert rows[-1]["replay/dropped_score_failed"] == 0
    assert not actor_pids(run_dir)


def router_workers(run_dir: Path) -> list[dict]:
    """The router's per-worker records at each recorded step."""
    return [line["router-0"] for line in status_lines(run_dir) if line["event"] == "step"]


# by address as from another machine: a variant of the run_dir one, behind -m slow (run by CI)
@pytest.mark.parametrize("to", ["run_dir", pytest.param("address", marks=pytest.mark.slow)])
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
        deadline = time.monotonic() + 60
        # the router's recorded status lists it, with work done
        while not any(w.get(f"worker/{name}", {}).get("done", 0) > 0 for w in router_workers(run_dir)):
            assert worker.poll() is None, attach_log.read_text()
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        (seen,) = [w[f"worker/{name}"] for w in router_workers(run_dir) if f"worker/{name}" in w][-1:]
        assert seen["capacity"] == 2 and seen["pool"] == "reward"
        steps_at_detach = len(metrics(run_dir))
        worker.send_signal(signal.SIGINT)  # Ctrl-C: detach
        assert worker.wait(timeout=30) == 0, attach_log.read_text()
        assert "Traceback" not in attach_log.read_text()
        assert not alive(worker.pid)
        detached_at = len(status_lines(run_dir))
        proc.wait(timeout=150)
    finally:
        if worker is not None:
            worker.kill()
            worker.wait(timeout=30)
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()[-4000:]
    assert steps_at_detach < total  # it left while the job ran, and the job went on without it
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert all(balanced(r) for r in rows)
    status = status_lines(run_dir)
    # once its bye is through, the router drops it: the last recorded steps do not list it
    after = [line["router-0"] for line in status[detached_at:] if line["event"] == "step"]
    assert after and f"worker/{name}" not in after[-1], after[-1]
    # nothing in the job died or was restarted
    assert not [line for line in status if line["event"] == "exited"]
    assert status[-1]["outcome"] == "finished"
    assert all(status[-1][a]["restarts"] == 0 for a in status[-1]["returncodes"])
    assert not actor_pids(run_dir)


BAD_REWARD = '''
import time
from pathlib import Path

from actors.scoring.rules import repeat_letter_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A user function that hangs, raises or allocates without bound on some prompts."""
    kind = extra_info["index"] % 4
    if kind == 0:
        while True:
            time.sleep(1)
    if kind == 1:
        raise RuntimeError("the judge is down")
    if kind == 2:
        hoard = [bytearray(1 << 30)]  # past reward.memory_mb at once: no race with the timeout
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
                  "reward.memory_mb=512", "reward.processes=2",
                  # most items fail here on purpose: the bound on a step's failures
                  # (tests/test_bad_input.py) is lifted to see that each costs its sample only
                  "reward.max_error_share=1")
    cmd[2] = str(topology)
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(balanced(r) for r in rows)
    assert not actor_pids(run_dir)

    from actors.runtime.recording import read_table
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
    reward = [line for line in status_lines(run_dir) if line["event"] == "step"][-1]["reward-0"]
    assert reward["score_errors"] >= 1 and reward["score_timeouts"] >= 1
