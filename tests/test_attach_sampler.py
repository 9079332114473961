"""A sampler attached to a running job by hand (``runner.py attach sampler --to RUN_DIR``), then
detached, on a tiny random llama with real processes and sockets.

It loads the job's current weights, takes prompts under the replay buffer's admission control,
shows in the runner's status as attached, and its groups are trained on. Detached (SIGTERM, with
``sampler.drain_grace_s = 0`` while its scoring is held up, so it surely holds prompts) it hands
them back: the replay buffer issues them again, every issued prompt has at most one accepted
group, and issued = trained + dropped + in flight holds at every step and at the end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from actors.runtime.ranks import free_port
from actors.runtime.recording import read_table
from tests.jobs import (
    ROOT,
    actor_pids,
    alive,
    balanced,
    command,
    metrics,
    pids_of,
    reap,
    status_lines,
    wait_for_steps,
)

HELD_REWARD = '''
import time
from pathlib import Path

from actors.scoring.rules import repeat_letter_score

FLAG = Path({flag!r})


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """While FLAG exists every call waits for it to go (scoring held up, not failed)."""
    while FLAG.exists():
        time.sleep(0.05)
    return repeat_letter_score(data_source, solution_str, ground_truth, extra_info)
'''


def wait_status(run_dir: Path, what: str, ok, procs: list[subprocess.Popen], limit_s: float):
    """The first ``status.jsonl`` line for which ``ok(line)`` holds (the processes alive)."""
    deadline = time.monotonic() + limit_s
    while True:
        for line in reversed(status_lines(run_dir)):
            if ok(line):
                return line
        for p in procs:
            assert p.poll() is None, f"{p.args[:4]} ended ({p.returncode}) waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {limit_s}s"
        time.sleep(0.2)


def samples_per_s(lines: list[dict], names: list[str], n: int) -> float:
    """Samples the named samplers sent per second over ``lines`` (their ``groups`` counters)."""
    if len(lines) < 2:
        return 0.0
    sent = [sum(line.get(s, {}).get("groups", 0) for s in names) * n for line in lines]
    return (sent[-1] - sent[0]) / max(lines[-1]["time"] - lines[0]["time"], 1e-9)


@pytest.mark.parametrize("to", ["run_dir", pytest.param("runner_address", marks=pytest.mark.slow)])
def test_attached_sampler_works_then_hands_back_its_prompts_on_detach(tiny_model, tmp_path, to):
    """``to``: the run directory, or (as from another machine) the runner's tcp address, which
    sends the job's topology."""
    flag = tmp_path / "hold"
    (tmp_path / "held_reward.py").write_text(HELD_REWARD.format(flag=str(flag)))
    topology = tmp_path / "topology.toml"
    topology.write_text((ROOT / "topology.toml").read_text()
                        + f'\n[[reward.functions]]\npath = "{tmp_path / "held_reward.py"}"\n')
    run_dir, log, attach_log = tmp_path / "run", tmp_path / "runner.log", tmp_path / "attach.log"
    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    cmd = command(tiny_model, run_dir, "run.status_interval=1", "run.heartbeat_interval=0.5",
                  "learner.total_steps=400", "reward.timeout_s=120",
                  *([f'control_address="{address}"'] if to == "runner_address" else []))
    cmd[2] = str(topology)
    n = 4  # algorithm.n of topology.toml
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    worker = None
    try:
        wait_for_steps(run_dir, 3, proc, timeout=180)
        one_from = len(status_lines(run_dir))
        start = status_lines(run_dir)[-1]["time"]  # one sampler alone for 6 s of the job's record
        wait_status(run_dir, "6 s of status", lambda line: line["time"] > start + 6, [proc], 60)
        one = status_lines(run_dir)[one_from:]
        with attach_log.open("w") as out:
            worker = subprocess.Popen(
                [sys.executable, str(ROOT / "runner.py"), "attach", "sampler", "--to",
                 str(run_dir) if to == "run_dir" else address, "sampler.drain_grace_s=0"],
                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True)
        name = f"sampler-attached-{worker.pid}"
        wait_status(run_dir, f"{name} ready", lambda line: line.get(name, {}).get("ready"),
                    [proc, worker], 120)
        working = wait_status(run_dir, f"{name} groups",
                              lambda line: line.get(name, {}).get("groups", 0) >= 8,
                              [proc, worker], 180)
        two_from = status_lines(run_dir).index(working)
        wait_status(run_dir, "more groups", lambda line: line.get(name, {}).get("groups", 0) >= 20,
                    [proc, worker], 180)
        two = status_lines(run_dir)[two_from:]
        assert working[name]["version"] >= 1  # it took the job's current weights, not step 0's
        flag.touch()  # scoring is held up: its generated batches wait, so it holds prompts
        held_from = time.time() + 2  # (a batch being scored as the flag came may still finish)
        wait_status(run_dir, f"{name} holding prompts in scoring",
                    lambda line: line["time"] > held_from and line.get(name, {}).get("scoring", 0)
                    >= 1, [proc, worker], 120)
        worker.send_signal(signal.SIGTERM)  # detach, with no grace: everything held goes back
        assert worker.wait(timeout=60) == 0, attach_log.read_text()
        flag.unlink()
        left = re.search(r"(\d+) prompts unfinished, the replay buffer issues (\d+) again",
                         attach_log.read_text())
        assert left, attach_log.read_text()[-3000:]
        unfinished, requeued = int(left[1]), int(left[2])
        assert unfinished >= 1 and requeued >= unfinished
        steps = len(metrics(run_dir))
        wait_for_steps(run_dir, steps + 3, proc, timeout=180)  # the job goes on without it
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=150) == 130, log.read_text()[-3000:]
    finally:
        flag.unlink(missing_ok=True)
        reap(worker, proc)
    assert "Traceback" not in attach_log.read_text()
    assert not alive(worker.pid) and not actor_pids(run_dir)
    status = status_lines(run_dir)
    events = [(line["event"], line.get("actor")) for line in status]
    assert ("attached", name) in events and ("detached", name) in events
    assert not [line for line in status if line["event"] == "exited"]
    replay = status[-1]["replay-0"]
    assert replay["samplers_left"] == 1 and replay["handed_back"] == requeued
    assert replay["rejected"] == 0  # no group came for a prompt not in flight (none twice)
    assert replay["issued"] == replay["trained"] + replay["dropped"] + replay["in_flight"]
    rows = metrics(run_dir)
    assert rows and all(balanced(r) for r in rows)
    # the recording: at most one accepted group per prompt, each trained at most once
    groups = read_table(run_dir, "groups", ["group_id", "sampler"]).to_pylist()
    ids = [g["group_id"] for g in groups]
    assert len(ids) == len(set(ids))
    assert any(g["sampler"] == name for g in groups)  # its groups were taken
    fates = read_table(run_dir, "fates", ["group_id", "fate", "served"]).to_pylist()
    firsts = [f["group_id"] for f in fates if f["fate"] == "trained" and f["served"] == 1]
    assert len(firsts) == len(set(firsts)) and set(firsts) <= set(ids)
    # in the same run: samples/s of the job's samplers with one (6 s before the attach), then
    # two (while the attached one sent its groups 8 to 20); no assert on times: for the note
    samplers = ["sampler-0", name]
    print(f"\nsamples/s: one sampler {samples_per_s(one, samplers, n):.2f}, "
          f"two samplers {samples_per_s(two, samplers, n):.2f} "
          f"(attached alone {samples_per_s(two, [name], n):.2f})")


@pytest.mark.slow  # a variant of the above by address (the fast suite keeps the run_dir one)
def test_a_sampler_attaches_to_a_secured_job_by_the_runners_address_only_with_an_authorized_key(
        tiny_model, tmp_path):
    """As from another machine: the runner's tcp address, the job's public key and a key of
    ``security.authorized_keys``; an unknown key is refused at once (status 1, no topology)."""
    for who in ("alice", "mallory"):
        subprocess.run([sys.executable, "runner.py", "keygen", str(tmp_path / who)], cwd=ROOT,
                       check=True, capture_output=True)
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    cmd = command(tiny_model, run_dir, "run.status_interval=1", "run.heartbeat_interval=0.5",
                  "learner.total_steps=400", "security.curve=true",
                  f'security.authorized_keys="{tmp_path / "alice.key"}"',
                  f'control_address="{address}"')
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    worker = None
    try:
        wait_for_steps(run_dir, 2, proc, timeout=180)
        server_key = msgspec.json.decode((run_dir / "topology.json").read_bytes())[
            "security"]["server_key"]

        def attach(who: str) -> subprocess.Popen:
            out = (tmp_path / f"{who}.log").open("w")
            return subprocess.Popen(
                [sys.executable, str(ROOT / "runner.py"), "attach", "sampler", "--to", address,
                 f"--server-key={server_key}", "--key", str(tmp_path / f"{who}.key_secret")],
                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True)

        refused = attach("mallory")
        assert refused.wait(timeout=30) == 1
        said = (tmp_path / "mallory.log").read_text()
        assert "refused this client's CURVE key" in said and "Traceback" not in said, said
        worker = attach("alice")
        name = f"sampler-attached-{worker.pid}"
        wait_status(run_dir, f"{name} groups", lambda line: line.get(name, {}).get("groups", 0) >= 4,
                    [proc, worker], 180)
        worker.send_signal(signal.SIGTERM)  # detach, with the default grace: it finishes first
        assert worker.wait(timeout=60) == 0, (tmp_path / "alice.log").read_text()
        assert "prompts unfinished, the replay buffer issues" in (tmp_path / "alice.log").read_text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=150) == 130, log.read_text()[-3000:]
    finally:
        reap(worker, proc)
    status = status_lines(run_dir)
    assert ("detached", name) in [(line["event"], line.get("actor")) for line in status]
    replay = status[-1]["replay-0"]
    assert replay["samplers_left"] == 1 and replay["rejected"] == 0
    assert all(balanced(r) for r in metrics(run_dir))
    assert not actor_pids(run_dir)


def test_a_job_sampler_told_its_machine_goes_away_hands_back_and_is_restarted(tiny_model,
                                                                             tmp_path):
    """SIGTERM to the job's own sampler with a short grace (``sampler.drain_grace_s = 1``) while
    its scoring is held up: it cannot finish, so it hands its prompts back and exits 0; the
    runner, still running the job, restarts it, and nothing is lost or taken twice."""
    flag = tmp_path / "hold"
    (tmp_path / "held_reward.py").write_text(HELD_REWARD.format(flag=str(flag)))
    topology = tmp_path / "topology.toml"
    topology.write_text((ROOT / "topology.toml").read_text()
                        + f'\n[[reward.functions]]\npath = "{tmp_path / "held_reward.py"}"\n')
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    cmd = command(tiny_model, run_dir, "run.status_interval=1", "run.heartbeat_interval=0.5",
                  "learner.total_steps=400", "reward.timeout_s=120", "sampler.drain_grace_s=1")
    cmd[2] = str(topology)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(run_dir, 3, proc, timeout=180)
        flag.touch()
        held_from = time.time() + 2
        wait_status(run_dir, "sampler-0 holding prompts in scoring",
                    lambda line: line["time"] > held_from
                    and line.get("sampler-0", {}).get("scoring", 0) >= 1, [proc], 120)
        (pid,) = pids_of(run_dir, "sampler")
        os.kill(pid, signal.SIGTERM)  # the spot machine's notice
        wait_status(run_dir, "sampler-0 exited", lambda line: line["event"] == "exited", [proc], 60)
        flag.unlink()
        steps = len(metrics(run_dir))
        wait_for_steps(run_dir, steps + 3, proc, timeout=180)  # the restarted sampler works
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=150) == 130, log.read_text()[-3000:]
    finally:
        flag.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    left = re.search(r"\[sampler-0\] left after \d+ groups; (\d+) prompts unfinished, the replay "
                     r"buffer issues (\d+) again", log.read_text())
    assert left and 1 <= int(left[1]) <= int(left[2]), log.read_text()[-3000:]
    status = status_lines(run_dir)
    (exited,) = [line for line in status if line["event"] == "exited"]
    assert exited["actor"] == "sampler-0" and exited["returncode"] == 0 and exited["restart"]
    replay = status[-1]["replay-0"]
    assert replay["samplers_left"] == 1 and replay["handed_back"] == int(left[2])
    assert replay["rejected"] == 0
    assert replay["issued"] == replay["trained"] + replay["dropped"] + replay["in_flight"]
    assert all(balanced(r) for r in metrics(run_dir))
    ids = read_table(run_dir, "groups", ["group_id"]).column("group_id").to_pylist()
    assert len(ids) == len(set(ids))
    assert not actor_pids(run_dir)


@pytest.mark.slow  # a variant by another host's runner
def test_a_sampler_attached_at_another_hosts_runner_shows_in_the_owners_status(tiny_model,
                                                                              tmp_path):
    """Hosts a (owner) and b: the sampler attaches by host b's runner address; b relays it, so
    the owner's record lists it (attached, its groups, detached)."""
    two = ['hosts.a="127.0.0.1"', 'hosts.b="127.0.0.2"', 'sampler.host="b"', 'reward.host="b"',
           "learner.total_steps=400", "run.base_port=27300", "run.status_interval=1",
           "run.heartbeat_interval=0.5"]
    run_dir = tmp_path / "run"
    runners = {h: subprocess.Popen([*command(tiny_model, run_dir, *two), "--host", h], cwd=ROOT,
                                   stdout=(tmp_path / f"{h}.log").open("w"),
                                   stderr=subprocess.STDOUT, text=True) for h in ("a", "b")}
    worker = None
    try:
        wait_for_steps(run_dir, 2, runners["a"], timeout=180)
        with (tmp_path / "attach.log").open("w") as out:
            worker = subprocess.Popen(
                [sys.executable, str(ROOT / "runner.py"), "attach", "sampler", "--to",
                 "tcp://127.0.0.2:27311"],  # host b's runner: base_port + 10 + its index
                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True)
        name = f"sampler-attached-{worker.pid}"
        seen = wait_status(run_dir, f"{name} at the owner",
                           lambda line: line.get(name, {}).get("groups", 0) >= 4,
                           [*runners.values(), worker], 180)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, (tmp_path / "attach.log").read_text()
        wait_status(run_dir, f"{name} detached at the owner",
                    lambda line: (line["event"], line.get("actor")) == ("detached", name),
                    list(runners.values()), 60)
        runners["a"].send_signal(signal.SIGINT)
        assert runners["a"].wait(timeout=150) == 130, (tmp_path / "a.log").read_text()[-3000:]
        runners["b"].wait(timeout=60)
    finally:
        reap(worker, *runners.values())
    assert seen[name]["ready"]
    events = [(line["event"], line.get("actor")) for line in status_lines(run_dir)]
    assert ("attached", name) in events
    assert status_lines(run_dir)[-1]["replay-0"]["samplers_left"] == 1
    assert all(balanced(r) for r in metrics(run_dir))
    assert not actor_pids(run_dir)
