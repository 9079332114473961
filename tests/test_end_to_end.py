"""The whole job, every actor in its own process over real sockets, on a tiny random llama.

These run ``runner.py`` exactly as a user does and check what a user would: reward goes up,
the replay counters balance, Ctrl-C leaves a final checkpoint and no process behind, a killed
sampler is restarted without losing a prompt, and a stopped run resumes where it left off.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import (
    ACTORS,
    ROOT,
    actor_pids,
    balanced,
    command,
    kill_the_sampler,
    metrics,
    status_lines,
    wait_for_steps,
)

ESTIMATORS = {
    "grpo": [],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "gae": ["algorithm.adv_estimator=gae", "learner.critic_lr=3e-3", "algorithm.adv_estimator.lam=0.95"],
}


# rloo takes grpo's path with another estimator kernel (each kernel: tests/test_kernels_*.py):
# behind -m slow (run by CI); gae, with its critic, stays in the fast suite
@pytest.mark.parametrize("estimator", [pytest.param(e, marks=pytest.mark.slow) if e == "rloo" else e
                                       for e in ESTIMATORS])
def test_job_learns_and_counters_balance(tiny_model, tmp_path, estimator):
    run_dir = tmp_path / "run"
    # a profiled learner step and sampler batch (learner.profile_steps, sampler.profile_batches)
    # train and generate as any other: the curve below is the job's own
    res = subprocess.run(command(tiny_model, run_dir, "learner.total_steps=40", *ESTIMATORS[estimator],
                                 "learner.profile_steps=[2]", "sampler.profile_batches=[3]"),
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    # the kinds it runs, none it does not (no teacher×0)
    assert "=== actors: replay×1, router×1, learner×1, reward×1, sampler×1;" in res.stdout, \
        res.stdout[:2000]
    # the console and the actors' logs say only what a user should read: no library warning
    # the project could avoid, and no memory table on a CPU far from its memory
    said = [res.stdout, res.stderr, *(p.read_text() for p in (run_dir / "logs").glob("*"))]
    warned = [line for text in said for line in text.splitlines() if "warn" in line.lower()]
    assert not warned, warned[:5]
    assert "memory estimate" not in res.stdout + res.stderr
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))
    rewards = [r["critic/score/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.15, f"reward did not go up: first 5 steps {first:.3f}, last 5 {last:.3f}"
    assert all(balanced(r) for r in rows)
    assert max(r["staleness/max"] for r in rows) <= 1  # max_staleness = 1 is enforced
    assert not actor_pids(run_dir)
    # the runner's record: started once every actor was ready, one line per step, the outcome
    status = status_lines(run_dir)
    assert status[0]["event"] == "started" and all(status[0][a]["ready"] for a in ACTORS)
    steps = [line for line in status if line["event"] == "step"]
    assert [line["step"] for line in steps] == list(range(1, 41))
    assert status[-1]["event"] == "stopped" and status[-1]["outcome"] == "finished"
    assert set(status[-1]["returncodes"].values()) == {0}

    # the recording: every step's batch, the groups it trained on and their fates agree
    from actors.runtime.recording import decode_group, read_table
    batches = read_table(run_dir, "batches").to_pylist()
    assert [b["step"] for b in batches] == list(range(1, 41))
    groups = {r["group_id"]: r for r in read_table(run_dir, "groups").to_pylist()}
    trained = {(f["step"], f["position"]): f["group_id"]
               for f in read_table(run_dir, "fates").to_pylist() if f["fate"] == "trained"}
    for b in batches:
        assert [trained[(b["step"], i)] for i in range(len(b["group_ids"]))] == b["group_ids"]
        for gid in b["group_ids"]:
            assert decode_group(groups[gid]["message"]).prompt.prompt_id == gid
    recorded = {r["step"]: dict(r["metrics"]) for r in read_table(run_dir, "metrics").to_pylist()}
    assert recorded[40]["critic/score/mean"] == rows[-1]["critic/score/mean"]
    issued = read_table(run_dir, "prompts")["prompt_id"].to_pylist()  # flushed at exit too
    # the runner's per-step status record: the router's per-worker statistics among it
    worker = steps[-1]["router-0"]["worker/reward-0"]
    assert worker["pool"] == "reward" and worker["done"] >= 1 and worker["failed"] == 0
    assert worker["p99_ms"] >= worker["p50_ms"] > 0 and not worker["leaving"]
    assert steps[-1]["sampler-0"]["score_failed"] == 0
    assert issued == list(range(len(issued))) and len(issued) >= rows[-1]["replay/issued"]

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_40")
    assert model.config.vocab_size > 0

    # the profiles: an op table, the ops dispatched and a trace a browser opens, for each
    # profiled step
    for name, step, fact in (("learner-0", 2, "samples"), ("sampler-0", 3, "decode_steps")):
        where = run_dir / "profiles" / name
        assert sorted(p.name for p in where.iterdir()) == \
            [f"step_{step}.json", f"step_{step}.trace.json", f"step_{step}.txt"]
        table = (where / f"step_{step}.txt").read_text()
        assert table.startswith(f"step {step}: torch.profiler") and "aten::mm" in table
        events = json.loads((where / f"step_{step}.trace.json").read_text())["traceEvents"]
        assert any(e.get("name") == "aten::mm" for e in events)
        counts = json.loads((where / f"step_{step}.json").read_text())
        assert counts[fact] > 0 and counts["ops"] == sum(counts["ops_by_name"].values()) > 100
        assert counts["ops_by_name"]["aten::linear"] > 0  # the model's projections, from Python


def test_ctrl_c_checkpoints_stops_everything_and_resumes(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command(tiny_model, run_dir, "learner.total_steps=1000",
                                    "learner.save_every=1000"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for_steps(run_dir, 3, proc)
        assert len(actor_pids(run_dir)) == 5
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: runner and actors alike
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-4000:]
    assert not actor_pids(run_dir)
    stopped = status_lines(run_dir)[-1]
    assert stopped["event"] == "stopped" and stopped["outcome"] == "interrupted"
    assert set(stopped["returncodes"].values()) == {0}, stopped["returncodes"]  # no actor died
    assert not list((run_dir / "logs").glob("*.traceback"))
    done = len(metrics(run_dir))
    ckpt = run_dir / "checkpoints" / f"step_{done}"
    assert ckpt.is_dir(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == done
    half = run_dir / "checkpoints" / ".tmp_step_99_12345"  # as a checkpoint write killed half-way
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half")

    # the command the runner printed, as printed (its python is this one), for 2 more steps
    (line,) = [x for x in out.splitlines() if x.startswith("    resume with: python runner.py ")]
    again = [sys.executable, *shlex.split(line.split(": ", 1)[1])[1:]]
    assert again[-1] == f"run.dir={run_dir}", line
    res = subprocess.run([*again, f"learner.total_steps={done + 2}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert f"=== resuming from step_{done} ({ckpt})\n" in res.stdout
    assert not half.exists()
    assert [r["step"] for r in metrics(run_dir)][done:] == [done + 1, done + 2]
    assert not actor_pids(run_dir)
    (more,) = [x for x in res.stdout.splitlines() if x.startswith("    continue it for more ")]
    assert more.endswith(f" run.dir={run_dir} learner.total_steps={2 * (done + 2)}"), more


def test_killed_sampler_is_restarted_and_no_prompt_is_lost(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command(tiny_model, run_dir, "learner.total_steps=12"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_the_sampler(run_dir, proc, after_steps=3)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(balanced(r) for r in rows)
    assert not actor_pids(run_dir)


def test_bad_topology_names_the_key(tmp_path):
    res = subprocess.run([sys.executable, "runner.py", "topology.toml", "learner.total_stepz=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "learner.total_stepz: unknown key" in res.stderr


# after the second checkpoint: a variant of the kill after the first, behind -m slow (run by CI)
@pytest.mark.parametrize("kill_after", [4, pytest.param(7, marks=pytest.mark.slow)])
def test_kill_9_everything_and_resume_from_the_recording(tiny_model, tmp_path, kill_after):
    """Crash-proof resume: kill -9 the runner and every actor mid-run, start the same command.

    Checkpoints every 3 steps; the kill comes a step or two after one, mid-step."""
    from actors.runtime.recording import read_table
    from actors.runtime.rundir import checkpoint_position

    run_dir = tmp_path / "run"
    cmd = command(tiny_model, run_dir, "learner.total_steps=10", "learner.save_every=3")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        wait_for_steps(run_dir, kill_after - 1, proc)
        assert len(actor_pids(run_dir)) == 5
        while len(metrics(run_dir)) < kill_after:  # polled closely: the kill comes mid-step
            assert proc.poll() is None
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and its actors, at once, mid-step
        proc.wait(timeout=30)
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while actor_pids(run_dir):
        assert time.monotonic() < deadline, "actors outlived kill -9"
        time.sleep(0.1)
    step, version = checkpoint_position(run_dir)  # 3 * (kill_after // 3) unless the test lagged
    assert step >= 3 and step % 3 == 0 and version == step
    killed = read_table(run_dir, "fates").to_pylist()
    killed_batch = {}  # step -> group ids in position order, as the killed run served them
    for f in sorted((f for f in killed if f["fate"] == "trained"), key=lambda f: f["position"]):
        killed_batch.setdefault(f["step"], []).append(f["group_id"])
    killed_rows = metrics(run_dir)
    assert max(killed_batch) >= step

    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert not actor_pids(run_dir)

    rows = metrics(run_dir)
    assert all(balanced(r) for r in rows)  # on every row, before the kill and after
    # the steps trained again replaced the killed run's lines of them: each step once
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert rows[:step] == killed_rows[:step]
    resumed = rows[step:]
    # continuous with before: the redone step counts what the killed run counted for it
    before = {r["step"]: r for r in killed_rows}
    if step + 1 in before:
        assert resumed[0]["replay/trained"] == before[step + 1]["replay/trained"]
    assert resumed[0]["replay/issued"] >= max(r["replay/issued"] for r in killed_rows)

    # the final lineage: each step's batch as the latest incarnation recorded it
    lineage = {b["step"]: b["group_ids"] for b in read_table(run_dir, "batches").to_pylist()}
    assert sorted(lineage) == list(range(1, 11))
    trained_at = {}
    for s, gids in lineage.items():
        for gid in gids:
            assert gid not in trained_at, f"group {gid} trained at steps {trained_at[gid]} and {s}"
            trained_at[gid] = s
    if step + 1 in killed_batch:  # served before the kill: redone on the same batch
        assert lineage[step + 1] == killed_batch[step + 1]
    for s in range(1, step + 1):
        assert lineage[s] == killed_batch[s]

    fates = read_table(run_dir, "fates").to_pylist()
    final = [f for f in fates[len(killed):] if f["fate"] == "trained"]
    assert {f["step"] for f in final} == set(range(step + 1, 11))
    dropped = {f["group_id"]: f["reason"] for f in fates if f["fate"] == "dropped"}
    assert all(reason for reason in dropped.values())
    assert not set(dropped) & set(trained_at)

    # no id repeats, and nothing accepted is lost: trained, dropped, or held at the end
    prompts = read_table(run_dir, "prompts")["prompt_id"].to_pylist()
    assert prompts == list(range(len(prompts)))
    accepted = read_table(run_dir, "groups")["group_id"].to_pylist()
    assert len(accepted) == len(set(accepted)) and set(accepted) <= set(prompts)
    killed_accepted = {f["group_id"] for f in killed} | set(killed_batch.get(step + 1, []))
    assert killed_accepted <= set(accepted)
    held_at_end = set(accepted) - set(trained_at) - set(dropped)
    assert len(trained_at) + len(dropped) + len(held_at_end) == len(accepted)
    # the recording at the end agrees with the replay buffer's own counters at step 10
    from actors.data.sources import make_task
    from actors.replay.state import ReplayState
    from actors.runtime.config import TaskConfig

    end = ReplayState(task=make_task(TaskConfig(name="repeat_letter"), seed=0), groups_per_step=4,
                      max_staleness=1, capacity=64)
    end.restore(run_dir, step=10, version=10)
    assert {g.prompt.prompt_id for g in end.held} == held_at_end
    assert end.trained == len(trained_at) == rows[-1]["replay/trained"]
    c = end.counters()
    assert c["issued"] == c["trained"] + c["dropped"] + c["in_flight"] >= rows[-1]["replay/issued"]


def test_a_second_runner_on_the_same_run_dir_is_refused(tiny_model, tmp_path):
    """(On the tiny model: the embedded one's first use converts it, half a minute on its own.)"""
    import fcntl
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".runner.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live runner holds it
        res = subprocess.run(command(tiny_model, run_dir), cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert res.returncode == 2 and "another runner is using" in res.stderr
    assert not (run_dir / "topology.json").exists()


def test_a_killed_runners_socket_folder_is_removed_on_the_next_start(tmp_path):
    import socket
    import tempfile

    from actors.runtime.rundir import remove_stale_sockets
    old = Path(tempfile.mkdtemp(prefix="flowrl-", dir="/tmp"))
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(old / "replay"))  # left behind by a killed run
    (tmp_path / "topology.json").write_text(json.dumps({"run": {"socket_dir": str(old)}}))
    remove_stale_sockets(tmp_path, old)  # the same folder is this run's: kept
    assert old.is_dir()
    remove_stale_sockets(tmp_path, Path("/tmp/flowrl-new"))
    assert not old.exists()
    mine = tmp_path / "sockets"  # not a runner-made folder: never touched
    mine.mkdir()
    (tmp_path / "topology.json").write_text(json.dumps({"run": {"socket_dir": str(mine)}}))
    remove_stale_sockets(tmp_path, Path("/tmp/flowrl-new"))
    assert mine.is_dir()
