"""Model-pool workers join and leave a running job like reward workers: ``runner.py attach
reward --pool NAME`` adds a replica of a ``[[reward.models]]`` entry (its model, its pool name at
the router), ``runner.py attach teacher`` adds a teacher worker; both take routed work, show in
the job's status as attached, and detach (SIGTERM) with nothing lost: every step whole, the
counters balanced, no score or teacher failure."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import ROOT, actor_pids, balanced, metrics, start_job, status_lines, wait_for_steps
from tests.test_pools_job import router_worker
from tests.tiny_model import build_tiny_reward_model


def attach(tmp_path: Path, run_dir: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"attach-{args[0]}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "runner.py"), "attach", *args,
                                 "--to", str(run_dir)], cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    return proc, log


def test_a_pool_replica_and_a_teacher_attach_work_and_detach(tiny_model, tmp_path):
    rm = build_tiny_reward_model(tmp_path / "rm")
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    # a job that outlasts the test, stopped by Ctrl-C once its workers have left: one that ended
    # first would stop them itself, and the detach under test would not happen
    proc = start_job(tiny_model, run_dir, log, "learner.total_steps=100000",
                     f'reward.models=[{{kind="reward_model", name="rm", path="{rm}", replicas=1, '
                     'capacity=1}]',
                     f"teacher.path={tiny_model}", "teacher.capacity=1")
    workers: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 180  # a bound on waiting: six actors start on 2 cores
        while not metrics(run_dir):  # the job runs: its first step is recorded
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        replica, replica_log = attach(tmp_path, run_dir, "reward", "--pool", "rm")
        teacher, teacher_log = attach(tmp_path, run_dir, "teacher", "teacher.capacity=2")
        workers += [replica, teacher]
        names = {f"reward-attached-{replica.pid}": "rm", f"teacher-attached-{teacher.pid}": "teacher"}
        deadline = time.monotonic() + 180
        while not all(router_worker(run_dir, n).get("done", 0) > 0 for n in names):
            for w, wlog in ((replica, replica_log), (teacher, teacher_log)):
                assert w.poll() is None, wlog.read_text()[-4000:]
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        for name, pool in names.items():  # each serves its pool
            assert router_worker(run_dir, name)["pool"] == pool
        for w, wlog in ((replica, replica_log), (teacher, teacher_log)):
            w.send_signal(signal.SIGTERM)  # detach: a drain
            assert w.wait(timeout=60) == 0, wlog.read_text()[-4000:]
            assert "Traceback" not in wlog.read_text() and "detached" in wlog.read_text()
        steps_at_detach = len(metrics(run_dir))
        wait_for_steps(run_dir, steps_at_detach + 3, proc, timeout=180)  # it goes on without them
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=150) == 130, log.read_text()[-4000:]
    finally:
        for w in workers:
            w.kill()
            w.wait(timeout=30)
        proc.kill()
        proc.wait(timeout=30)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert len(rows) >= steps_at_detach + 3
    assert all(balanced(r) for r in rows)
    assert rows[-1]["replay/dropped_score_failed"] == 0  # no group lost its score or teacher
    status = status_lines(run_dir)
    events = [(line["event"], line.get("actor", "")) for line in status]
    for name in names:  # the runner showed them as attached, then detached
        assert ("attached", name) in events and ("detached", name) in events, events[-20:]
    assert not [line for line in status if line["event"] == "exited"]
    assert status[-1]["outcome"] == "interrupted"
    assert not actor_pids(run_dir)


def test_attach_pool_names_a_pool_of_the_job(tiny_model, tmp_path):
    """``--pool NAME``: the first replica index of that pool; any other name, or a kind that
    serves no model pool, is an error naming ``--pool`` and what the job has."""
    from actors.job.attach import attached_index
    from actors.job.config.load import apply_overrides, decode_topology
    from actors.runtime.config import ConfigError, model_replica

    rm = build_tiny_reward_model(tmp_path / "rm")
    topology = decode_topology(apply_overrides({}, [
        f"model.path={tiny_model}", "reward.count=2",
        f'reward.models=[{{kind="reward_model", name="a", path="{rm}", replicas=3}}, '
        f'{{kind="judge", name="b", path="{rm}"}}]']))
    assert attached_index(topology, "reward", "") == -1  # a rule worker
    assert attached_index(topology, "reward", "a") == 2
    assert attached_index(topology, "reward", "b") == 5
    assert model_replica(topology.reward, 5)[0].name == "b"
    with pytest.raises(ConfigError, match=r"--pool c: the job has no such model pool \(its "
                                          r"reward.models: a, b\)"):
        attached_index(topology, "reward", "c")
    with pytest.raises(ConfigError, match="--pool a: only reward workers serve model pools"):
        attached_index(topology, "teacher", "a")
