"""Whole jobs whose learner is a group of two CPU ranks (FSDP2 over gloo), through ``runner.py``.

The group learns as one learner does, its checkpoint (HF weights gathered to rank 0, optimizer
state sharded by both ranks) resumes on one rank, and a rank killed mid-run stops the whole job
with every process reaped; the run then resumes from its recording.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.jobs import ROOT, actor_pids, balanced, command, metrics, pids_of, status_lines

RANKS = ["learner.nproc_per_node=2"]


def rank_pids(run_dir: Path) -> dict[str, int]:
    """The live learner ranks of a run, by rank (as the runner's status records their pids)."""
    live = set(pids_of(run_dir, "learner"))
    last = status_lines(run_dir)[-1]
    return {name.partition(".rank")[2] or "0": row["pid"] for name, row in last.items()
            if name.startswith("learner-0") and row.get("pid") in live}


def test_two_ranks_learn_and_resume_on_one(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run(command(tiny_model, run_dir, "learner.total_steps=30", *RANKS),
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    rewards = [r["critic/score/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.15, f"reward did not go up: first 5 steps {first:.3f}, last 5 {last:.3f}"
    assert all(balanced(r) for r in rows)
    assert all(r["timing_s/weight_publish"] > 0 for r in rows)
    assert not actor_pids(run_dir)
    stopped = status_lines(run_dir)[-1]
    assert stopped["outcome"] == "finished"
    assert stopped["returncodes"] == {"replay-0": 0, "router-0": 0, "learner-0": 0,
                                      "learner-0.rank1": 0, "reward-0": 0, "sampler-0": 0}
    assert stopped["learner-0.rank1"]["rank"] == 1 and stopped["learner-0"]["ranks"] == 2
    ckpt = run_dir / "checkpoints" / "step_30"
    assert json.loads((ckpt / "trainer_state.json").read_text())["ranks"] == 2
    assert sorted(p.name for p in (ckpt / "optimizer").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own shard
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    # an offline rerun of a step the two ranks took, on one rank from their checkpoint of step 20:
    # the same computation with sums in another order (measured: a few 1e-7 relative)
    from actors.offline.rerun import rerun
    report = io.StringIO()
    rerun(run_dir, 21, out=report)
    text = report.getvalue()
    assert "rebuilt from checkpoint" in text and "step_20" in text and "had 2 ranks" in text
    table = [line.split() for line in text.splitlines()
             if line.startswith(("critic/", "actor/", "rollout_corr/"))]
    assert len(table) > 20
    far = [row for row in table if abs(float(row[1]) - float(row[2])) > 1e-5 * max(1.0, abs(float(row[1])))]
    assert not far, far

    # the 2-rank checkpoint resumes on one rank: its weights, optimizer state and step
    res = subprocess.run(command(tiny_model, run_dir, "learner.total_steps=32"), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows][30:] == [31, 32]
    assert status_lines(run_dir)[-1]["learner-0"]["resumed_from"] == "step_30"
    assert "learner-0.rank1" not in status_lines(run_dir)[-1]
    assert json.loads((run_dir / "checkpoints" / "step_32" / "trainer_state.json").read_text()
                      )["ranks"] == 1
    assert not actor_pids(run_dir)


def test_a_killed_rank_stops_the_job_and_the_run_resumes(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    cmd = command(tiny_model, run_dir, "learner.total_steps=1000", "learner.save_every=2", *RANKS)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while len(metrics(run_dir)) < 3 or not (run_dir / "checkpoints" / "step_2").is_dir():
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "no 3 steps and a checkpoint in 300 s"
            time.sleep(0.2)
        ranks = rank_pids(run_dir)
        assert sorted(ranks) == ["0", "1"], ranks
        os.kill(ranks["1"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, out[-4000:]
    assert "actor learner-0.rank1" in out and "killed by signal SIGKILL" in out
    assert not actor_pids(run_dir)
    status = status_lines(run_dir)
    assert status[-1]["outcome"] == "failed: actor learner-0.rank1 exited with status -9"
    assert status[-1]["returncodes"]["learner-0"] == -signal.SIGKILL  # ended with its group

    done = len(metrics(run_dir))
    res = subprocess.run(command(tiny_model, run_dir, f"learner.total_steps={done + 2}", *RANKS),
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert rows[-1]["step"] == done + 2 and all(balanced(r) for r in rows)
    assert not actor_pids(run_dir)


@pytest.mark.slow  # the fast suite keeps the same two-node learner placed by [hosts] (test_hosts)
def test_a_learner_over_two_nodes(tiny_model, tmp_path):
    """Two runners, as on two machines (here both on this one, rendezvous on 127.0.0.1): node 0
    runs the job with learner rank 0, node 1 only learner rank 1; they share the run directory."""
    from actors.runtime.ranks import free_port

    run_dir = tmp_path / "run"
    nodes = ["learner.nnodes=2", f"learner.master_port={free_port()}", "learner.total_steps=4",
             "learner.save_every=2"]
    logs = [(tmp_path / f"node{k}.log").open("w") for k in (0, 1)]
    procs = [subprocess.Popen(command(tiny_model, run_dir, *nodes, f"learner.node_rank={k}"),
                              cwd=ROOT, stdout=logs[k], stderr=subprocess.STDOUT)
             for k in (0, 1)]
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = [(tmp_path / f"node{k}.log").read_text() for k in (0, 1)]
    assert [p.returncode for p in procs] == [0, 0], out[0][-3000:] + out[1][-3000:]
    assert "learner ranks of node 1 of 2 only" in out[1]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    node1 = [json.loads(line) for line in
             (run_dir / "nodes" / "node1" / "status.jsonl").read_text().splitlines()]
    assert node1[-1]["outcome"] == "finished" and node1[-1]["returncodes"] == {"learner-0.rank1": 0}
    assert "learner-0.rank1" not in status_lines(run_dir)[-1]  # node 0's runner: its own ranks
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_4" / "optimizer").glob("*.distcp")
                  ) == ["__0_0.distcp", "__1_0.distcp"]
    assert not actor_pids(run_dir)


def test_ctrl_c_stops_every_rank_at_the_same_micro_batch_and_checkpoints(tiny_model, tmp_path):
    """Rank 0's stop is every rank's: the step in progress is abandoned on both at the same
    micro-batch (or finished on both), then both write the final checkpoint and exit 0."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command(tiny_model, run_dir, "learner.total_steps=1000",
                                    "learner.save_every=1000", *RANKS),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while len(metrics(run_dir)) < 3:
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "no 3 steps in 300 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: runner and ranks alike
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out[-4000:]
    assert not actor_pids(run_dir)
    stopped = status_lines(run_dir)[-1]
    assert stopped["outcome"] == "interrupted"
    assert set(stopped["returncodes"].values()) == {0}, stopped["returncodes"]
    done = len(metrics(run_dir))
    ckpt = run_dir / "checkpoints" / f"step_{done}"
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == done
    assert len(list((ckpt / "optimizer").glob("*.distcp"))) == 2
