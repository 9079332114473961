"""Model pools in a live job: a tiny-model job scored by the rule workers, a reward-model pool
and a judge pool (two replicas each, real processes over real sockets), with one replica of
each pool killed while it holds a request. Nothing is lost (every step's batch comes whole, the
counters balance, no group fails scoring) and nothing is scored twice (no reply reaches the
router for a request already answered, every group is recorded once).

The judge is the tiny random llama, so its answers are noise: its parser is a user function
(run in the replica's sandboxed child) that reads any answer (its length). The first answer it
reads it holds while a flag file exists, so the test knows which replica holds a request when it
kills it; every other answer goes through, so the job goes on around the held one. The
reward-model replica is stopped (SIGSTOP) until the router shows a request at it, then killed.
The parser's and the router's timeouts are longer than the test holds anything: every re-send
comes from a death, so a late second answer (a duplicate) can only be a bug.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from actors.runtime.recording import read_table
from tests.jobs import ROOT, actor_pids, args_of, balanced, command, metrics, status_lines
from tests.tiny_model import build_tiny_reward_model

PARSER = '''
import os
import time
from pathlib import Path

FLAG = Path({flag!r})


def parse_score(judge_answer, data_source, solution_str, ground_truth, extra_info):
    """The answer's length / 10. The first answer read while FLAG exists is held until FLAG goes,
    and a file says which replica holds it."""
    if FLAG.exists():
        try:
            os.close(os.open(FLAG.parent / "claimed", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return len(judge_answer) / 10
        (FLAG.parent / f"judge_in_flight-{{os.getppid()}}").touch()
        while FLAG.exists():
            time.sleep(0.05)
    return len(judge_answer) / 10
'''


def reward_pid(run_dir: Path, index: int) -> int:
    """The pid of process ``reward-INDEX`` of this run."""
    for pid in actor_pids(run_dir):
        if args_of(pid)[-2:] == [b"reward", str(index).encode()]:
            return pid
    raise AssertionError(f"no reward-{index} process")


def router_worker(run_dir: Path, name: str) -> dict:
    """The router's last recorded view of worker ``name``."""
    for line in reversed(status_lines(run_dir)):
        worker = line.get("router-0", {}).get(f"worker/{name}")
        if worker is not None:
            return worker
    return {}


def wait(what: str, ready, proc: subprocess.Popen, log: Path, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not ready():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"{what}: not within {limit_s} s\n" + log.read_text()[-4000:]
        time.sleep(0.1)


def test_pools_with_a_killed_replica_each_lose_nothing_and_score_nothing_twice(tiny_model,
                                                                               tmp_path):
    rm = build_tiny_reward_model(tmp_path / "rm")
    flag = tmp_path / "block"
    flag.touch()
    (tmp_path / "parse.py").write_text(PARSER.format(flag=str(flag)))
    topology = tmp_path / "topology.toml"
    topology.write_text((ROOT / "topology.toml").read_text() + f'''
[[reward.models]]
kind = "reward_model"
name = "rm"
path = "{rm}"
replicas = 2
capacity = 2
weight = 0.5

[[reward.models]]
kind = "judge"
name = "judge"
path = "{tiny_model}"
replicas = 2
capacity = 2
parser = "function"
function_path = "{tmp_path / 'parse.py'}"
max_tokens = 6
weight = 0.1
''')
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    steps = 8
    # heartbeats every 2 s: the router drops the stopped replica after 10 s (5 heartbeats), long
    # enough for the test to see the request it holds in the status (every second)
    cmd = command(tiny_model, run_dir, "run.status_interval=1", "run.heartbeat_interval=2",
                  "reward.timeout_s=600", "router.request_timeout=900",
                  f"learner.total_steps={steps}")
    cmd[2] = str(topology)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        # reward-0: the rule worker; reward-1, reward-2: the rm pool; reward-3, reward-4: judges
        wait("a judge replica holding a request", lambda: bool(list(tmp_path.glob(
            "judge_in_flight-*"))), proc, log)
        holder = int(next(tmp_path.glob("judge_in_flight-*")).name.rsplit("-", 1)[1])
        judges = {reward_pid(run_dir, 3): "reward-3", reward_pid(run_dir, 4): "reward-4"}
        assert holder in judges
        victim = reward_pid(run_dir, 1)
        os.kill(victim, signal.SIGSTOP)  # it takes requests and answers none
        wait("a request at the stopped rm replica",
             lambda: router_worker(run_dir, "reward-1").get("in_flight", 0) >= 1, proc, log)
        os.kill(victim, signal.SIGKILL)
        os.kill(holder, signal.SIGKILL)
        flag.unlink()
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    status = status_lines(run_dir)
    exited = {line["actor"]: line for line in status if line["event"] == "exited"}
    assert set(exited) == {"reward-1", judges[holder]}, exited
    assert all(e["returncode"] == -signal.SIGKILL and e["restart"] for e in exited.values())
    last = status[-1]
    router = last["router-0"]
    assert router["resent"] >= 2  # what the killed replicas held went to the others
    assert router["failed"] == 0 and router["duplicates"] == 0  # none answered twice
    # (over the run: the router's last report comes as it stops, after workers said bye)
    pools = {w["pool"] for line in status for k, w in line.get("router-0", {}).items()
             if k.startswith("worker/")}
    assert pools == {"reward", "rm", "judge"}
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(balanced(r) for r in rows)
    assert rows[-1]["replay/dropped_score_failed"] == 0
    assert last["sampler-0"]["score_failed"] == 0 and last["sampler-0"]["score_errors"] == 0
    groups = read_table(run_dir, "groups", ["group_id", "reward_errors"]).to_pylist()
    ids = [g["group_id"] for g in groups]
    assert len(ids) == len(set(ids)) >= steps * 4  # every group recorded once
    assert not any(e for g in groups for e in g["reward_errors"])
    for name in ("reward-3", "reward-4"):  # both judges served, in batches
        judge = last[name]
        assert judge["pool"] == "judge" and judge["model"] == "judge"
    assert sum(last[n]["batches"] for n in ("reward-1", "reward-2", "reward-3", "reward-4")) > 0
    print({"router": {k: router[k] for k in ("answered", "resent", "duplicates", "failed")},
           "workers": {k: (w["pool"], w["done"], w["failed"]) for k, w in router.items()
                       if k.startswith("worker/")},
           "replicas": {n: {k: last[n].get(k) for k in ("pool", "requests_done", "batches",
                                                           "batch_requests_max", "restarts")}
                        for n in ("reward-1", "reward-2", "reward-3", "reward-4")}})
    assert not actor_pids(run_dir)
