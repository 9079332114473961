"""Jobs placed and started by Ray (``run.launcher = "ray"``, ``runner.py --ray``).

The fast tests check the launcher's keys and the command line without a cluster. The ``ray``
ones start Ray's own multi-node test cluster (``ray.cluster_utils.Cluster``: a head and worker
nodes as separate raylets on this machine, custom resources standing for hosts), run the job
through it as a user would (``runner.py topology.toml --ray ADDRESS``), and remove a node
mid-job. Ray is kept small: few CPUs, an 80 MB object store per node, no dashboard, and its
temp directory a fresh short folder (Ray's socket paths must stay under ~100 bytes) removed
after.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from actors.job.config.load import load_topology
from actors.job.launchers.table import LAUNCHERS
from actors.runtime.config import ConfigError, RunConfig
from runner import main
from tests.jobs import (
    ROOT,
    actor_pids,
    balanced,
    command,
    metrics,
    placed_on,
    reap,
    status_lines,
)

STORE = 80 * 2**20  # bytes of object store per test node (flowrl's messages never use it)


def test_the_launcher_key_lists_exactly_the_table():
    """``run.launcher``'s values are declared on the field (the schema, which every actor
    reads, cannot import the runner's table): they are the table's rows, no more, no fewer."""
    assert get_args(get_type_hints(RunConfig)["launcher"]) == tuple(LAUNCHERS)


@pytest.mark.parametrize(("overrides", "key"), [
    (['hosts={a="10.0.0.1"}'], "hosts"),
    (['ray.address="ray://nohost"'], "ray.address"),
    (['replay.address="ipc:///tmp/x"'], "replay.address"),
    (["learner.nnodes=2", "learner.node_rank=1", "run.dir=runs/x"], "learner.node_rank"),
    (["learner.nnodes=2", 'learner.host=["a", "b", "c"]'], "learner.host"),
    (["sampler.count=2", 'sampler.host=["a"]'], "sampler.host"),
    (['reward.host="bad name"'], "reward.host"),
    (['run.host="a"'], "run.host"),
])
def test_a_bad_ray_key_is_named(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
        load_topology(ROOT / "topology.toml", ['run.launcher="ray"', *overrides])


def test_under_ray_the_weights_go_by_zmq_and_the_host_names_a_resource():
    pytest.importorskip("ray", reason="needs Ray: pip install 'flowrl[ray]'")
    topology = load_topology(ROOT / "topology.toml", [
        'run.launcher="ray"', "sampler.count=2", 'sampler.host=["gen1", "gen2"]'])
    assert topology.learner.weights_transport == "zmq"  # the samplers may be on other nodes
    assert load_topology(ROOT / "topology.toml").learner.weights_transport == "shm"


def test_under_ray_one_runner_starts_every_learner_node_with_the_per_node_runners_env():
    """A learner over two nodes: the Ray runner starts both nodes' ranks, each with the torchrun
    variables the runner of its own node (``[hosts]``, SLURM) gives it, less that runner's own
    topology file (every rank reports to the one runner)."""
    pytest.importorskip("ray", reason="needs Ray: pip install 'flowrl[ray]'")
    from actors.job.processes import learner_ranks

    nodes = ["learner.nnodes=2", "learner.nproc_per_node=2", "learner.master_port=29500",
             'learner.master_addr="10.0.0.5"', "run.dir=runs/x"]
    ray = learner_ranks(load_topology(ROOT / "topology.toml", ['run.launcher="ray"', *nodes]),
                        Path("run"))
    per_node = [p for k in (0, 1) for p in learner_ranks(
        load_topology(ROOT / "topology.toml", [*nodes, f"learner.node_rank={k}"]), Path("run"))]
    assert [p.name for p in ray] == ["learner-0", "learner-0.rank1", "learner-0.rank2",
                                     "learner-0.rank3"]
    assert [p.env for p in ray] == [
        {k: v for k, v in p.env.items() if k != "FLOWRL_TOPOLOGY"} for p in per_node]
    assert [(p.env["GROUP_RANK"], p.env["LOCAL_RANK"]) for p in ray] == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]


def test_the_bundles_on_a_made_up_cluster_of_gpu_nodes():
    """A learner over two nodes of two GPU ranks each: one bundle per node with its ranks' CPUs
    and GPUs, the nodes spread; a sampler's share of a GPU is a Ray fraction of one, a sampler
    over two GPUs takes them whole; a host adds a share of its resource, and a host the cluster
    lacks is refused naming the key."""
    from actors.job.launchers.ray_plan import HOST_SHARE, plan_bundles
    from actors.runtime.config import PlacedProcess

    t = load_topology(ROOT / "topology.toml", [
        'run.launcher="ray"', "learner.nnodes=2", "learner.nproc_per_node=2", "sampler.count=2",
        'sampler.host="gen"', 'learner.host=["t0", "t1"]'])
    ranks = ["learner-0", "learner-0.rank1", "learner-0.rank2", "learner-0.rank3"]
    names = ["replay-0", "router-0", *ranks, "sampler-0", "sampler-1", "reward-0"]
    placed = {n: PlacedProcess(n, gpus=[str(i)]) for i, n in enumerate(ranks)}
    placed["sampler-0"] = PlacedProcess("sampler-0", gpus=["4"], memory_share=0.45)
    placed["sampler-1"] = PlacedProcess("sampler-1", gpus=["5", "6"])
    have = {"CPU": 32.0, "GPU": 16.0, "gen": 2.0, "t0": 1.0, "t1": 1.0}
    plan = plan_bundles(t, names, placed, have)
    (spread, learner), (pack, others) = plan.groups
    assert (spread, pack) == ("STRICT_SPREAD", "PACK")
    assert learner == [
        (ranks[:2], {"CPU": 2.0, "GPU": 2.0, "t0": 2 * HOST_SHARE}),
        (ranks[2:], {"CPU": 2.0, "GPU": 2.0, "t1": 2 * HOST_SHARE})]
    assert others == [(["replay-0"], {"CPU": 1.0}), (["router-0"], {"CPU": 1.0}),
                      (["sampler-0"], {"CPU": 1.0, "GPU": 0.45, "gen": HOST_SHARE}),
                      (["sampler-1"], {"CPU": 1.0, "GPU": 2.0, "gen": HOST_SHARE}),
                      (["reward-0"], {"CPU": 1.0})]
    assert plan.needs["learner-0.rank3"] == {"CPU": 1.0, "GPU": 1.0, "t1": HOST_SHARE}
    with pytest.raises(ConfigError, match=r"^sampler.host: no node of the Ray cluster has the "
                                          r"resource 'gen'"):
        plan_bundles(t, names, placed, {k: v for k, v in have.items() if k != "gen"})


def test_a_process_sees_the_gpus_ray_assigned_it():
    """The keeper's variables: Ray's GPU ids (this node's numbering) replace the runner's
    placement's (the cluster's as one machine), the device the first of them; a memory share
    and the torchrun variables carry over; a process without GPUs keeps the placement's cpu."""
    from actors.job.launchers.ray_host import device_env
    from actors.runtime.config import DEVICE_ENV, PlacedProcess
    from actors.runtime.config.gpus import SHARE_ENV

    rank1 = {**PlacedProcess("learner-0.rank1", gpus=["1"], visible=["0", "1"]).env(), "RANK": "1"}
    assert rank1[DEVICE_ENV] == "cuda:1"  # the runner's own: the second of its node's GPUs
    assert device_env([3], rank1) == {"CUDA_VISIBLE_DEVICES": "3", DEVICE_ENV: "cuda:0",
                                      "RANK": "1"}
    assert device_env(["2", "5"], PlacedProcess("sampler-1", gpus=["5", "6"]).env()) == {
        "CUDA_VISIBLE_DEVICES": "2,5", DEVICE_ENV: "cuda:0"}
    shared = device_env([0], PlacedProcess("sampler-0", gpus=["4"], memory_share=0.45).env())
    assert (shared["CUDA_VISIBLE_DEVICES"], shared[SHARE_ENV]) == ("0", "0.45")
    cpu = PlacedProcess("reward-0").env()
    assert device_env([], cpu) == cpu == {"CUDA_VISIBLE_DEVICES": "", DEVICE_ENV: "cpu"}


def test_without_ray_the_flag_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # how Python marks a module unavailable
    assert main(["topology.toml", "--ray", "learner.total_steps=2"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: bad topology: run.launcher: ray: Ray is not installed: "
                   "pip install 'flowrl[ray]'\n")


def test_a_ray_jobs_topology_reads_without_ray(monkeypatch):
    """Only the runner needs Ray: a worker attached from a machine without it reads the job's
    topology (``run.launcher = "ray"``) as it is."""
    monkeypatch.setitem(sys.modules, "ray", None)
    assert load_topology(ROOT / "topology.toml", ['run.launcher="ray"']).run.launcher == "ray"


@pytest.mark.parametrize("argv", [
    ["topology.toml", "--ray", 'hosts={a="10.0.0.1"}'],  # a bare --ray before an override
    ["topology.toml", "--ray", "auto", 'hosts={a="10.0.0.1"}'],
    ["topology.toml", 'hosts={a="10.0.0.1"}', "--ray=ray://head:10001"],
])
def test_the_ray_flag_sets_the_launcher_and_keeps_the_overrides(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("error: bad topology: hosts: not used under "
                                              "run.launcher = ray")


def test_a_bad_ray_address_on_the_command_line_is_named(capsys):
    assert main(["topology.toml", "--ray", "nohost"]) == 2
    assert capsys.readouterr().err.startswith("error: bad topology: ray.address: 'nohost'")


# -- jobs on Ray's multi-node test cluster ----------------------------------------------------


@contextlib.contextmanager
def local_cluster(monkeypatch, **head):
    """Ray's test cluster, its head alone (tests add worker nodes; ``head``: more of the head's
    arguments); its temp dir is removed and no Ray process of it is left after."""
    from ray.cluster_utils import Cluster

    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
    (temp / "ray").mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(temp))  # where the cluster writes its address
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 3, "resources": {"main": 1}, "object_store_memory": STORE,
            "include_dashboard": False, "temp_dir": str(temp / "ray"), **head})
        yield cluster
    finally:
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    assert not ray_processes(temp)


@pytest.fixture
def ray_cluster(monkeypatch):
    pytest.importorskip("ray", reason="needs Ray: pip install 'flowrl[ray]'")
    with local_cluster(monkeypatch) as cluster:
        yield cluster


def ray_processes(temp: Path) -> list[int]:
    """Live processes whose command line names the cluster's temp dir (raylets, workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(temp).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def worker_node(cluster, name: str):
    """A worker node of two CPUs carrying the custom resource ``name`` (a host)."""
    return cluster.add_node(num_cpus=2, resources={name: 1}, object_store_memory=STORE)


def ray_job(model: Path, run_dir: Path, cluster, *overrides: str) -> list[str]:
    base = random.randrange(21000, 32000, 20)  # tests beside this one may hold other ports
    # (a learner importing torch on a loaded 2-core machine can be silent for minutes)
    return [*command(model, run_dir, "run.heartbeat_interval=0.5", "run.status_interval=1",
                     "run.heartbeat_timeout=600",
                     f"run.base_port={base}", 'replay.host="main"', 'router.host="main"',
                     'learner.host="main"', "--ray", cluster.address, *overrides)]


def run_losing(cmd: list[str], log: Path, run_dir: Path, steps: int, lose) -> tuple[int, str]:
    """Start the job; once ``steps`` steps are recorded call ``lose(proc)`` (which removes
    nodes); wait for the job's end: its exit code and what the runner said."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while len(metrics(run_dir)) < steps:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        lose(proc)
        proc.wait(timeout=400)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    return proc.returncode, log.read_text()


@pytest.mark.ray
def test_a_job_runs_with_its_actors_on_three_nodes(ray_cluster, tiny_model, tmp_path):
    nodes = {"main": ray_cluster.head_node, "gen1": worker_node(ray_cluster, "gen1"),
             "gen2": worker_node(ray_cluster, "gen2")}
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    cmd = ray_job(tiny_model, run_dir, ray_cluster, "learner.total_steps=2", "sampler.count=2",
                  "reward.count=2", 'sampler.host=["gen1", "gen2"]', 'reward.host=["gen1", "gen2"]')
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=400)
    said = log.read_text()
    assert proc.returncode == 0, said[-4000:]
    print(f"2-step job through Ray on 3 nodes: {time.monotonic() - started:.1f}s")
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(balanced(r) for r in rows)
    topo = json.loads((run_dir / "topology.json").read_text())
    assert topo["run"]["launcher"] == "ray"
    assert topo["replay"]["address"].startswith("tcp://")
    assert topo["learner"]["weights_transport"] == "zmq"
    status = status_lines(run_dir)
    assert status[-1]["event"] == "stopped" and status[-1]["outcome"] == "finished"
    # each on the node carrying the resource its host names
    ids = {name: node.node_id[:8] for name, node in nodes.items()}
    placed = placed_on(said)
    assert {p: placed[p] for p in ("replay-0", "router-0", "learner-0")} == dict.fromkeys(
        ("replay-0", "router-0", "learner-0"), ids["main"])
    assert placed["sampler-0"] == placed["reward-0"] == ids["gen1"]
    assert placed["sampler-1"] == placed["reward-1"] == ids["gen2"]
    assert not actor_pids(run_dir)


@pytest.mark.ray
def test_a_learner_over_two_ray_nodes(ray_cluster, tiny_model, tmp_path):
    """``learner.nnodes = 2``, one CPU rank per node: each node's rank on a Ray node of its
    own, the rendezvous at rank 0's node, gloo between them; the job trains the steps the
    one-node job trains (the accounting of ``test_per_host_runners_and_ray_train_the_same_steps``)
    and both ranks write their shards of the checkpoint."""
    b = ray_cluster.add_node(num_cpus=3, resources={"b": 1}, object_store_memory=STORE)
    run_dir = tmp_path / "run"
    done = subprocess.run(ray_job(tiny_model, run_dir, ray_cluster, "learner.total_steps=2",
                                  "learner.nnodes=2", 'learner.host=["main", "b"]',
                                  'sampler.host="b"', 'reward.host="b"'),
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    placed = placed_on(done.stdout)
    assert (placed["learner-0"], placed["learner-0.rank1"]) == (
        ray_cluster.head_node.node_id[:8], b.node_id[:8])
    rows = metrics(run_dir)
    assert all(balanced(r) for r in rows)
    assert [(r["step"], r["replay/trained"]) for r in rows] == [(1, 4), (2, 8)]
    topo = json.loads((run_dir / "topology.json").read_text())
    assert topo["learner"]["master_addr"] == ray_cluster.head_node.node_ip_address
    assert status_lines(run_dir)[-1]["returncodes"]["learner-0.rank1"] == 0
    (ckpt,) = (run_dir / "checkpoints").glob("step_2")
    assert sorted(p.name for p in (ckpt / "optimizer").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    assert not actor_pids(run_dir)


@pytest.mark.ray
def test_three_node_losses_cost_no_restart_and_no_step(ray_cluster, tiny_model, tmp_path):
    """Nodes go one after another: the sampler's, then the node its replacement landed on,
    then one holding a reward worker (a fresh node joins after each loss, as an autoscaler
    would add one: the cluster always has room). Each lost process waits for Ray to move its
    reservation to a live node, restarts there, and its restarts count as a lost node's, not
    against ``max_restarts`` (one, here: three losses would have used it up); every step comes
    once with the counters balanced."""
    nodes = {name: worker_node(ray_cluster, name) for name in ("b", "c", "d")}  # d: the spare
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    steps = 100  # (each loss stalls the job; enough steps that the third comes mid-job)
    cmd = ray_job(tiny_model, run_dir, ray_cluster, f"learner.total_steps={steps}",
                  "reward.count=2", 'ray.strategy="SPREAD"', "replay.sampler_timeout_s=10",
                  "router.request_timeout=10", "sampler.max_restarts=1", "reward.max_restarts=1")

    def holding(kind: str) -> str:  # a live node holding a process of ``kind``, by name
        placed = placed_on(log.read_text())
        return next(n for n, node in nodes.items() for k, v in placed.items()
                    if k.startswith(kind) and v == node.node_id[:8])

    def lose(proc: subprocess.Popen, name: str, added: str) -> list[str]:
        """Remove node ``name`` (adding node ``added``); wait until what it held is placed
        again; the processes lost."""
        ids = {k for k, v in placed_on(log.read_text()).items()
               if v == nodes[name].node_id[:8]}
        nodes[added] = worker_node(ray_cluster, added)
        ray_cluster.remove_node(nodes.pop(name))
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "the job ended early:\n" + log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            placed = placed_on(log.read_text())
            if all(placed[k] in {n.node_id[:8] for n in nodes.values()} for k in ids):
                return sorted(ids)
            time.sleep(0.2)

    gone: list[str] = []

    def three(proc: subprocess.Popen) -> None:
        gone.extend(lose(proc, holding("sampler"), "e"))
        gone.extend(lose(proc, holding("sampler"), "f"))
        gone.extend(lose(proc, holding("reward"), "g"))

    rc, said = run_losing(cmd, log, run_dir, 1, three)
    assert rc == 0, said[-6000:]
    assert "not counted against" in said and "(1/1)" not in said
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(balanced(r) for r in rows)
    assert rows[-1]["replay/dropped_score_failed"] == 0
    exited = [line for line in status_lines(run_dir) if line["event"] == "exited"]
    assert sorted(line["actor"] for line in exited) == sorted(gone)
    assert all(line["restart"] and line["cause"] == "node lost" for line in exited)
    last = status_lines(run_dir)[-1]
    n = sum(line["actor"] == "sampler-0" for line in exited)  # 2, or 3 if the reward
    assert n >= 2  # worker's node held it too
    assert last["sampler-0"]["restarts"] == n
    assert last["sampler-0"]["restarts_by_cause"] == {"node lost": n}
    assert "    restarts: " in said and f"sampler-0 {n} (node lost {n})" in said
    assert not actor_pids(run_dir)


@pytest.mark.ray
def test_a_lost_node_with_no_room_left_stops_the_job_naming_what_is_missing(
        ray_cluster, tiny_model, tmp_path):
    """The only node carrying a reward worker's resource is lost and none comes back: the
    runner says what no live node has, the job stops the normal way (exit 1, the resume
    command printed), and nothing is restarted in a loop."""
    gen = worker_node(ray_cluster, "gen")
    worker_node(ray_cluster, "s")
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    cmd = ray_job(tiny_model, run_dir, ray_cluster, "learner.total_steps=200",
                  'reward.host="gen"', 'sampler.host="s"', "ray.reserve_timeout_s=5")
    rc, said = run_losing(cmd, log, run_dir, 1, lambda proc: ray_cluster.remove_node(gen))
    assert rc == 1, said[-4000:]
    assert re.search(r"reward-0 cannot be started again: no live node has room for its "
                     r"reservation .* missing \{'gen': [\d.]+\} on one node", said), said[-4000:]
    assert "resume with: " in said
    exited = [line for line in status_lines(run_dir) if line["event"] == "exited"]
    assert [(line["cause"], line["restart"]) for line in exited] == [
        ("node lost", True), ("no room", False)]
    assert not actor_pids(run_dir)


@pytest.mark.ray
def test_a_lost_learner_node_stops_the_job_and_the_same_command_resumes_it(
        ray_cluster, tiny_model, tmp_path):
    """The learner's state cannot be remade elsewhere: losing its node stops the job (every
    other process reaped), and the same command, once a node with its resource is back,
    resumes from the last checkpoint and finishes every step once."""
    trainer = ray_cluster.add_node(num_cpus=1, resources={"t": 1}, object_store_memory=STORE)
    worker_node(ray_cluster, "gen")
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    cmd = ray_job(tiny_model, run_dir, ray_cluster, "learner.total_steps=6",
                  "learner.save_every=2", 'learner.host="t"')
    # step 2's checkpoint is written before step 3
    rc, said = run_losing(cmd, log, run_dir, 3, lambda proc: ray_cluster.remove_node(trainer))
    assert rc == 1, said[-4000:]
    assert "job failed: actor learner-0 exited with status -9" in said
    assert not actor_pids(run_dir)
    killed = metrics(run_dir)

    ray_cluster.add_node(num_cpus=1, resources={"t": 1}, object_store_memory=STORE)
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))  # each step once
    assert all(balanced(r) for r in rows)
    assert rows[:2] == killed[:2]  # up to the checkpoint, as the lost run trained them
    assert status_lines(run_dir)[-1]["learner-0"]["resumed_from"] in ("step_2", "step_4")
    assert not actor_pids(run_dir)


def test_a_ray_address_where_nothing_answers_is_refused_at_once(tiny_model, tmp_path, capsys):
    pytest.importorskip("ray", reason="needs Ray: pip install 'flowrl[ray]'")
    argv = ["topology.toml", "--ray", "127.0.0.1:1", f"model.path={tiny_model}",
            f"run.dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(
        "error: bad topology: ray.address: nothing answers at 127.0.0.1:1")
    assert not (tmp_path / "run").exists()


@pytest.mark.ray
def test_per_host_runners_and_ray_train_the_same_steps(ray_cluster, tiny_model, tmp_path):
    """The same topology (sampler and reward worker on one host, the rest on another), run by
    one runner per host as ``srun`` starts them and then through Ray: both train every step
    once, with the same batches' accounting and the counters balanced."""
    from tests.test_hosts import host_command, start, stop

    worker_node(ray_cluster, "b")
    steps, base = "learner.total_steps=3", random.randrange(21000, 32000, 20)
    hosts_run = tmp_path / "hosts"
    runners = [start(host_command(tiny_model, hosts_run, h, steps, f"run.base_port={base}"),
                     tmp_path / f"{h}.log") for h in ("a", "b")]
    try:
        for h, p in zip(("a", "b"), runners, strict=True):
            assert p.wait(timeout=400) == 0, (tmp_path / f"{h}.log").read_text()[-3000:]
    finally:
        stop(*runners)
    ray_run = tmp_path / "ray"
    done = subprocess.run(ray_job(tiny_model, ray_run, ray_cluster, steps, 'sampler.host="b"',
                                  'reward.host="b"'),
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    def accounting(run_dir: Path) -> list[tuple[int, int]]:
        rows = metrics(run_dir)
        assert all(balanced(r) for r in rows)
        return [(r["step"], r["replay/trained"]) for r in rows]

    assert accounting(hosts_run) == accounting(ray_run) == [(1, 4), (2, 8), (3, 12)]
    assert not actor_pids(hosts_run) and not actor_pids(ray_run)


@pytest.mark.ray
def test_ctrl_c_under_a_ray_of_the_jobs_own_leaves_no_process_and_no_temp_dir(
        tiny_model, tmp_path):
    """``--ray`` without an address starts a Ray for the job; Ctrl-C stops the job as on one
    machine (final checkpoint, status 130), then that Ray and its temp directory go too."""
    pytest.importorskip("ray", reason="needs Ray: pip install 'flowrl[ray]'")
    before = set(Path("/tmp").glob("flowrl-ray-*"))
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    cmd = command(tiny_model, run_dir, "learner.total_steps=200", "run.heartbeat_interval=0.5",
                  f"run.base_port={random.randrange(21000, 32000, 20)}", "--ray")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while len(metrics(run_dir)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=200) == 130, log.read_text()[-4000:]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert (run_dir / "checkpoints").is_dir()
    assert not actor_pids(run_dir)
    assert set(Path("/tmp").glob("flowrl-ray-*")) <= before
    assert not ray_processes(Path("/tmp/flowrl-ray-"))


@pytest.mark.ray
def test_ray_job_submit_runs_the_job_from_its_working_dir(monkeypatch, tiny_model, tmp_path):
    """The docs' ``ray job submit --working-dir . -- python runner.py topology.toml --ray auto``
    on a cluster with Ray's job server (its dashboard, from ``ray[default]``): the tree is
    uploaded, the runner runs as the job's driver, and the keepers on another node start the
    actors from the uploaded tree there; the job succeeds with every step."""
    pytest.importorskip("ray.dashboard.optional_deps",
                        reason="needs Ray's job server: pip install 'ray[default]==2.60.0'")
    from actors.runtime.ranks import free_port

    page = (ROOT / "docs" / "ray.md").read_text()
    (line,) = [ln for ln in page.splitlines() if ln.startswith("ray job submit ")]
    words = line.split("#")[0].split()
    assert words[words.index("--") + 1:] == ["python", "runner.py", "topology.toml", "--ray",
                                            "auto"]
    # the job's `python` is the one running the tests, as a user's is their environment's
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    port = free_port()
    with local_cluster(monkeypatch, include_dashboard=True, dashboard_host="127.0.0.1",
                      dashboard_port=port, num_cpus=4) as cluster:
        # the nodes of this one-machine cluster share a session directory: the worker's copy
        # of the uploaded tree goes to a folder of its own, as on a machine of its own (in one
        # folder for both, one node's Ray removes and unpacks again the files the runner on
        # the other is importing from)
        cluster.add_node(num_cpus=2, resources={"b": 1}, object_store_memory=STORE,
                         runtime_env_dir_name="runtime_resources_b")
        run_dir = tmp_path / "run"
        job = [*words[words.index("--") + 1:], *command(tiny_model, run_dir)[3:],
               "learner.total_steps=2", "run.heartbeat_timeout=600",
               f"run.base_port={random.randrange(21000, 32000, 20)}", 'sampler.host="b"',
               'reward.host="b"']
        cli = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit",
               "--address", f"http://127.0.0.1:{port}", "--working-dir", str(ROOT), "--", *job]
        done = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "succeeded" in done.stdout + done.stderr
    rows = metrics(run_dir)
    assert [(r["step"], r["replay/trained"]) for r in rows] == [(1, 4), (2, 8)]
    assert all(balanced(r) for r in rows)
    assert "=== ray: joined" in done.stdout  # the runner's own lines, as the job's output
    assert not actor_pids(run_dir)


# ``runner.py ...`` on a machine without Ray (Python's mark of a module that is unavailable)
WITHOUT_RAY = ("import sys; sys.modules['ray'] = None; from runner import main; "
               "sys.exit(main(sys.argv[1:]))")


@pytest.mark.ray
def test_a_reward_worker_attaches_to_a_job_under_ray_from_a_machine_without_ray(
        monkeypatch, tiny_model, tmp_path):
    """``runner.py attach reward --to RUN_DIR`` outside Ray (no Ray importable): it reads the
    job's topology (the nodes' tcp addresses), joins the router, reports to the runner (the
    status shows it attached, as the live panel does), takes work, and detaches on SIGTERM;
    the job goes on whole and stops on Ctrl-C."""
    pytest.importorskip("ray", reason="needs Ray: pip install 'flowrl[ray]'")
    from tests.test_pools_job import router_worker

    with local_cluster(monkeypatch, num_cpus=5) as cluster:
        run_dir, log, attach_log = tmp_path / "run", tmp_path / "runner.log", tmp_path / "attach.log"
        with log.open("w") as out:
            proc = subprocess.Popen(ray_job(tiny_model, run_dir, cluster, "learner.total_steps=400",
                                            "reward.capacity=1"),
                                    cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        worker = None
        try:
            deadline = time.monotonic() + 300
            while not metrics(run_dir):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.2)
            with attach_log.open("w") as out:
                worker = subprocess.Popen([sys.executable, "-c", WITHOUT_RAY, "attach", "reward",
                                           "--to", str(run_dir)],
                                          cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            name = f"reward-attached-{worker.pid}"
            deadline = time.monotonic() + 180
            while router_worker(run_dir, name).get("done", 0) == 0:
                assert worker.poll() is None, attach_log.read_text()[-4000:]
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.2)
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=60) == 0, attach_log.read_text()[-4000:]
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=200) == 130, log.read_text()[-4000:]
        finally:
            reap(worker, proc)
    assert "Traceback" not in attach_log.read_text()
    status = status_lines(run_dir)
    events = [(line["event"], line.get("actor", "")) for line in status]
    assert ("attached", name) in events and ("detached", name) in events, events[-20:]
    assert not [line for line in status if line["event"] == "exited"]
    rows = metrics(run_dir)
    assert rows and all(balanced(r) for r in rows)
    assert not actor_pids(run_dir)
