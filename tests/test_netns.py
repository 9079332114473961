"""Faults across hosts, on one machine: each host a network namespace with its own address
(``tests/netns.py``), the job's runners started in them with ``--host``, tcp between them and
CURVE on. A cut link is a cable pulled at the switch: the cut-off processes keep running and
hear nothing, nobody is told, and the job must find out by itself.

- reward host cut off: the router re-sends its work to the live worker, the late replies that
  arrive when the link is mended are discarded, every step's batch comes complete;
- sampler host cut off: the replay buffer issues its prompts again after
  ``replay.sampler_timeout_s``; whatever it sends back late is accepted once or not at all;
- learner host lost: both runners stop with an error naming what was lost; running both
  commands again resumes the job from its checkpoint, and it finishes;
- CURVE over tcp from another namespace: an unauthorized key is refused, an authorized one
  attaches and gets work.

Needs root (``ip netns``); skipped with the reason where it is not permitted.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from actors.runtime.recording import last_by, read_table
from tests.jobs import ROOT, actor_pids, balanced, command, metrics, status_lines
from tests.netns import Hosts, log_tail, netns_problem

pytestmark = pytest.mark.netns

SLOW_REWARD = '''
import time

from actors.scoring.rules import repeat_letter_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.1)  # so that a worker always has requests in flight
    return repeat_letter_score(data_source, solution_str, ground_truth, extra_info)
'''


@pytest.fixture(scope="module")
def net():
    problem = netns_problem()
    if problem is not None:
        pytest.skip(f"network namespaces: {problem}")
    with Hosts(["a", "b", "c"]) as hosts:
        yield hosts


class Job:
    """The runners of one job, one per host, each in its host's namespace."""

    def __init__(self, net: Hosts, model: Path, tmp: Path, port: int, *overrides: str) -> None:
        self.net, self.model, self.tmp = net, model, tmp
        self.run_dir = tmp / "run"
        (tmp / "slow.py").write_text(SLOW_REWARD)  # steps of a second, not of milliseconds
        self.overrides = [f'reward.functions=[{{path = "{tmp / "slow.py"}"}}]',*(f'hosts.{h}="{net.address(h)}"' for h in net.names),
                          "security.curve=true", f"run.base_port={port}",
                          "run.heartbeat_timeout=60", *overrides]
        self.procs: dict[str, subprocess.Popen] = {}
        self.round = 0

    def start(self, *hosts: str) -> None:
        self.round += 1
        for host in hosts:
            cmd = self.net.command(host, [*command(self.model, self.run_dir, *self.overrides),
                                          "--host", host])
            with self.log(host).open("w") as out:
                self.procs[host] = subprocess.Popen(cmd, cwd=ROOT, stdout=out,
                                                    stderr=subprocess.STDOUT, text=True)

    def log(self, host: str) -> Path:
        return self.tmp / f"{host}-{self.round}.log"

    def wait_until(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        """Until ``ready()``, every runner of the job still running."""
        deadline = time.monotonic() + timeout
        while not ready():
            for host, p in self.procs.items():
                assert p.poll() is None, f"{host} ended: {log_tail(self.log(host))}"
            assert time.monotonic() < deadline, f"{what} not within {timeout}s"
            time.sleep(0.1)

    def wait_steps(self, steps: int, timeout: float = 120) -> None:
        self.wait_until(lambda: len(metrics(self.run_dir)) >= steps, f"{steps} steps", timeout)

    def wait_count(self, actor: str, key: str, at_least: int, timeout: float = 60,
                   key_in: str = "") -> None:
        """Until ``actor``'s last reported status has ``key`` >= ``at_least`` (``key_in``: the
        entry ``key_in`` of the table ``key``)."""
        def count() -> int:
            value = last_status(self.run_dir, actor).get(key, {} if key_in else 0)
            return value.get(key_in, 0) if key_in else value

        self.wait_until(lambda: count() >= at_least,
                        f"{actor}: {key}{'.' + key_in if key_in else ''} >= {at_least}", timeout)

    def wait(self, host: str, timeout: float = 180) -> int:
        try:
            return self.procs[host].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{host} still running: {log_tail(self.log(host))}") from None

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def last_status(run_dir: Path, actor: str) -> dict:
    return status_lines(run_dir)[-1][actor]


def trained_groups(run_dir: Path) -> list[int]:
    """The groups of every step's batch in the final lineage (a redone step's last batch)."""
    batches = last_by(read_table(run_dir, "batches"), "step")
    return [g for s in sorted(batches) for g in batches[s]["group_ids"]]


def assert_complete(run_dir: Path, steps: int) -> None:
    rows = metrics(run_dir)
    assert sorted({r["step"] for r in rows}) == list(range(1, steps + 1))
    assert all(balanced(r) for r in rows)
    groups = trained_groups(run_dir)
    assert len(groups) == len(set(groups)) == steps * 4  # no group trained twice
    assert not actor_pids(run_dir)


STEPS = 20  # of the reward host cut-off job


def test_reward_host_cut_off_its_work_goes_to_the_live_worker(net, tiny_model, tmp_path):
    # steps enough that the job still runs when the mended link carries reward-1's answers:
    # TCP sends them again on its own backed-off timer, seconds after the link is back
    job = Job(net, tiny_model, tmp_path, 27400, f"learner.total_steps={STEPS}", "reward.count=2",
              'reward.host=["a", "c"]', "router.request_timeout=3")
    job.start("a", "c")
    try:
        job.wait_steps(3)
        # reward-1 serves before its host is cut off (its runner may start after the job does)
        job.wait_count("router-0", "worker/reward-1", 1, key_in="done")
        net.cut("c")
        cut_at = len(metrics(job.run_dir))
        job.wait_steps(cut_at + 3)  # the job goes on with the worker of host a alone
        job.wait_count("router-0", "resent", 1)  # what reward-1 held, sent to reward-0
        net.mend("c")
        job.wait_count("router-0", "duplicates", 1)  # reward-1's answers, late: discarded
        assert job.wait("a") == 0, log_tail(job.log("a"))
        assert job.wait("c") == 0, log_tail(job.log("c"))
    finally:
        net.mend("c")
        job.kill()
    router = last_status(job.run_dir, "router-0")
    assert router["resent"] >= 1  # what reward-1 held when its host was cut off
    assert router["duplicates"] >= 1  # its answers, through when the link came back: discarded
    assert metrics(job.run_dir)[-1]["replay/dropped_score_failed"] == 0
    assert "the owner host a ended the job: finished" in job.log("c").read_text()
    assert_complete(job.run_dir, STEPS)


@pytest.mark.slow  # about 40 s: the fast suite keeps the reward host cut off
def test_sampler_host_cut_off_its_prompts_are_issued_again(net, tiny_model, tmp_path):
    job = Job(net, tiny_model, tmp_path, 27420, "learner.total_steps=12", "sampler.count=2",
              'sampler.host=["a", "b"]', "replay.sampler_timeout_s=2")
    job.start("a", "b")
    try:
        job.wait_steps(3)
        net.cut("b")
        deadline = time.monotonic() + 30
        while last_status(job.run_dir, "replay-0").get("reissued_silent", 0) < 1:
            assert time.monotonic() < deadline, log_tail(job.log("a"))
            time.sleep(0.2)
        job.wait_steps(len(metrics(job.run_dir)) + 2)  # sampler-0 alone carries the job
        net.mend("b")
        assert job.wait("a") == 0, log_tail(job.log("a"))
        assert job.wait("b") == 0, log_tail(job.log("b"))
    finally:
        net.mend("b")
        job.kill()
    replay = last_status(job.run_dir, "replay-0")
    assert replay["reissued_silent"] >= 1 and replay["samplers_silent"] == 0
    assert replay["issued"] == replay["trained"] + replay["dropped"] + replay["in_flight"]
    assert_complete(job.run_dir, 12)


@pytest.mark.slow  # about 65 s: the fast suite keeps the reward host cut off
def test_learner_host_lost_stops_the_job_and_both_commands_resume_it(net, tiny_model, tmp_path):
    job = Job(net, tiny_model, tmp_path, 27440, "learner.total_steps=10", 'learner.host="c"',
              "learner.save_every=2", "run.heartbeat_timeout=15")
    job.overrides.remove("run.heartbeat_timeout=60")  # (the one given last would win anyway)
    job.start("a", "c")
    try:
        job.wait_steps(4)
        net.cut("c")
        assert job.wait("a", timeout=60) == 1, log_tail(job.log("a"))
        assert job.wait("c", timeout=60) == 1, log_tail(job.log("c"))
        net.mend("c")
        lost_at = len(metrics(job.run_dir))
        job.start("a", "c")  # every host's command again, as after a crash
        assert job.wait("a") == 0, log_tail(job.log("a"))
        assert job.wait("c") == 0, log_tail(job.log("c"))
    finally:
        net.mend("c")
        job.kill()
    owner_log = (tmp_path / "a-1.log").read_text()
    assert "job failed: learner-0 on host c silent for" in owner_log
    assert "run every host's command again with the same run.dir to resume" in owner_log
    assert "job failed: lost the owner host a: silent for" in (tmp_path / "c-1.log").read_text()
    assert lost_at < 10
    learner = last_status(job.run_dir, "learner-0")
    assert learner["resumed_from"].startswith("step_")
    assert_complete(job.run_dir, 10)


@pytest.mark.slow  # about 30 s: the fast suite keeps the reward host cut off
def test_curve_over_tcp_refuses_an_unknown_key_and_lets_an_authorized_one_attach(
        net, tiny_model, tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("alice", "mallory"):
        subprocess.run([sys.executable, "runner.py", "keygen", str(tmp_path / name)], cwd=ROOT,
                       check=True, capture_output=True)
    (tmp_path / "alice.key").rename(keys / "alice.key")
    job = Job(net, tiny_model, tmp_path, 27460, "learner.total_steps=200",
              f'security.authorized_keys="{keys}"')
    job.start("a")
    worker = None
    try:
        job.wait_steps(1)
        server_key = __import__("json").loads((job.run_dir / "topology.json").read_text())[
            "security"]["server_key"]
        attach = [sys.executable, str(ROOT / "runner.py"), "attach", "reward", "--to",
                  f"tcp://{net.address('a')}:27462", f"--server-key={server_key}", "--key"]
        refused = subprocess.run(net.command("b", [*attach, str(tmp_path / "mallory.key_secret")]),
                                 cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1
        assert "refused this client's CURVE key" in refused.stderr
        with (tmp_path / "attach.log").open("w") as out:
            worker = subprocess.Popen(net.command("b", [*attach, str(tmp_path / "alice.key_secret"),
                                                        "--name", "alice-b"]),
                                      cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while last_status(job.run_dir, "router-0").get("worker/alice-b", {}).get("done", 0) < 1:
            assert worker.poll() is None, (tmp_path / "attach.log").read_text()
            assert time.monotonic() < deadline, log_tail(job.log("a"))
            time.sleep(0.2)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
        job.procs["a"].send_signal(signal.SIGINT)
        assert job.wait("a", timeout=120) == 130
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)
        job.kill()
    assert last_status(job.run_dir, "router-0")["auth_refused"] >= 1
    assert not actor_pids(job.run_dir)
