"""A job over several hosts: the ``[hosts]`` table, ``--host NAME``, and the runners of two hosts
running one job. On one machine the two hosts are two loopback addresses (127.0.0.1 and
127.0.0.2; no network namespaces needed): each runner binds on its own, so the job's traffic
crosses tcp between them as it would between machines (``tests/test_netns.py`` cuts real links).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.job.config.hosts import local_actors, owner, placement, resolve_addresses
from actors.job.config.load import load_topology
from actors.runtime.config import ConfigError
from tests.jobs import ROOT, actor_pids, balanced, command, jsonl, metrics

TWO = ['hosts.a="127.0.0.1"', 'hosts.b="127.0.0.2"', 'sampler.host="b"', 'reward.host="b"']


def topo(*overrides: str):
    return load_topology(ROOT / "topology.toml", ["run.dir=runs/x", *overrides])


def test_placement_and_addresses():
    t = topo(*TWO, "sampler.count=2", 'sampler.host=["a", "b"]', "run.host=b")
    assert owner(t) == "a" and placement(t, "sampler") == ["a", "b"]
    assert placement(t, "learner") == ["a"]  # no host: the replay buffer's
    assert local_actors(t) == [("reward", 0), ("sampler", 1)]
    r = resolve_addresses(t)
    assert r.replay.address == "tcp://127.0.0.1:27100"
    assert (r.router.address, r.router.worker_address) == ("tcp://127.0.0.1:27101",
                                                           "tcp://127.0.0.1:27102")
    assert r.learner.weights_address == "tcp://127.0.0.1:27103"
    assert r.control_address == "tcp://127.0.0.2:27111"  # this runner's own: host b, the 2nd
    moved = resolve_addresses(topo(*TWO, 'learner.host="b"', "run.base_port=50000"))
    assert moved.learner.weights_address == "tcp://127.0.0.2:50003"
    assert moved.control_address == "tcp://127.0.0.1:50010"  # no run.host: the owner's


def test_a_learner_over_two_hosts_is_one_node_per_host():
    nodes = [*TWO, "learner.nnodes=2", 'learner.host=["a", "b"]', 'sampler.host="a"',
             'reward.host="a"']
    node1 = resolve_addresses(topo(*nodes, "run.host=b"))
    assert node1.learner.node_rank == 1  # --host b: this runner is node 1
    assert (node1.learner.master_addr, node1.learner.master_port) == ("127.0.0.1", 27104)
    assert node1.control_address == "tcp://127.0.0.2:27111"
    assert local_actors(node1) == []  # not the learner's process: node 1 runs only its ranks
    assert resolve_addresses(topo(*nodes, "run.host=a")).learner.node_rank == 0


@pytest.mark.parametrize(("overrides", "message"), [
    (['sampler.host="a"'], "sampler.host: needs a [hosts] table naming the hosts"),
    (["run.host=a"], "run.host: --host needs a [hosts] table"),
    ([*TWO, 'sampler.host="c"'], "sampler.host: 'c' is not a host of [hosts] (a, b)"),
    ([*TWO, "sampler.count=2", 'sampler.host=["a"]'],
     "sampler.host: lists 1 hosts for sampler.count = 2 processes"),
    ([*TWO, 'teacher.path="default"', "teacher.replicas=2", 'teacher.host=["a"]'],
     "teacher.host: lists 1 hosts for teacher.replicas = 2 processes"),
    ([*TWO, "run.host=c"], "run.host: --host 'c' is not a host of [hosts] (a, b)"),
    ([*TWO, "run.dir=runs/{time}"], "run.dir: every host's runner must name the same run"),
    ([*TWO, 'hosts.c="tcp://10.0.0.1:5"'], "hosts.c: 'tcp://10.0.0.1:5' is not an IP address"),
    ([*TWO, 'router.address="ipc:///tmp/r"'], "router.address: 'ipc:///tmp/r' cannot be reached"),
    ([*TWO, 'control_address="tcp://127.0.0.1:9"'], "control_address: must be auto with [hosts]"),
    ([*TWO, "run.base_port=65530"], "run.base_port: must leave room"),
    ([*TWO, 'hosts.c="8.8.8.8"'], "security.curve: hosts c = '8.8.8.8' are not private addresses"),
    (["replay.sampler_timeout_s=-1"], "replay.sampler_timeout_s: must be >= 0"),
    ([*TWO, "learner.nnodes=2", 'learner.host=["a"]'],
     "learner.host: lists 1 hosts for learner.nnodes = 2 nodes"),
    ([*TWO, "learner.nnodes=2", 'learner.host=["a", "b"]'],
     "learner.host: 'b' runs learner node 1: its runner starts only the learner's ranks"),
    ([*TWO, "learner.nnodes=2", "learner.node_rank=1", "learner.master_port=5000"],
     "learner.node_rank: is set by --host with [hosts]"),
])
def test_bad_placements_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        topo(*overrides)


def test_public_hosts_run_with_curve_or_when_allowed_explicitly():
    assert topo(*TWO, 'hosts.c="8.8.8.8"', "security.curve=true").hosts["c"] == "8.8.8.8"
    assert topo(*TWO, 'hosts.c="8.8.8.8"', "security.allow_insecure=true")


def host_command(model: Path, run_dir: Path, host: str, *overrides: str) -> list[str]:
    return [*command(model, run_dir, *TWO, *overrides), "--host", host]


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env=env)


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def test_two_hosts_run_one_job_and_a_second_runner_for_a_host_is_refused(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    steps = "learner.total_steps=6 run.base_port=27200".split()
    a = start(host_command(tiny_model, run_dir, "a", *steps), tmp_path / "a.log")
    b = start(host_command(tiny_model, run_dir, "b", *steps), tmp_path / "b.log")
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "hosts" / "b" / "topology.json").exists():
            assert time.monotonic() < deadline and b.poll() is None, (tmp_path / "b.log").read_text()
            time.sleep(0.1)
        twice = subprocess.run(host_command(tiny_model, run_dir, "b", *steps), cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        assert twice.returncode == 2
        assert "another runner is using" in twice.stderr and "(host b)" in twice.stderr
        # on separate disks there is no shared lock: the host's bound port refuses it
        elsewhere = subprocess.run(host_command(tiny_model, tmp_path / "other", "b", *steps),
                                   cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert elsewhere.returncode == 2
        assert "cannot listen on tcp://127.0.0.2:27211" in elsewhere.stderr
        assert "Address already in use" in elsewhere.stderr
        assert a.wait(timeout=180) == 0, (tmp_path / "a.log").read_text()[-3000:]
        assert b.wait(timeout=60) == 0, (tmp_path / "b.log").read_text()[-3000:]
    finally:
        stop(a, b)
    log_b = (tmp_path / "b.log").read_text()
    assert "actors: reward-0, sampler-0 on host b" in log_b
    assert "the owner host a ended the job: finished" in log_b
    status = jsonl(run_dir / "status.jsonl")  # the owner's record holds every host's actors
    (started,) = [s for s in status if s["event"] == "started"]
    assert all(started[n]["ready"] for n in ("replay-0", "router-0", "learner-0", "reward-0",
                                             "sampler-0"))
    assert status[-1]["event"] == "stopped" and status[-1]["outcome"] == "finished"
    assert status[-1]["sampler-0"]["groups"] >= 6 * 4  # the sampler's own status, relayed
    assert status[-1]["returncodes"]["sampler-0"] is None  # not this runner's process
    own = jsonl(run_dir / "hosts" / "b" / "status.jsonl")  # host b's runner: its actors only
    assert {k for k in own[-1] if k.endswith("-0")} == {"reward-0", "sampler-0"}
    assert own[-1]["returncodes"] == {"reward-0": 0, "sampler-0": 0}
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(balanced(r) for r in rows)
    assert not actor_pids(run_dir)


def test_a_host_that_never_comes_is_waited_for_by_name_then_the_job_stops(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(host_command(tiny_model, run_dir, "a", "run.host_wait_s=4",
                                       "run.base_port=27220"), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "=== waiting for reward-0 (host b), sampler-0 (host b)" in done.stdout
    assert ("not ready after run.host_wait_s = 4s: reward-0 (host b), sampler-0 (host b) "
            "(is `runner.py ... --host NAME` running there?)") in done.stdout
    lonely = subprocess.run(host_command(tiny_model, tmp_path / "run2", "b", "run.host_wait_s=3",
                                         "run.base_port=27240"),
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert lonely.returncode == 1
    assert "waiting for the owner host a (its runner at tcp://127.0.0.1:27250" in lonely.stdout
    assert "did not answer within run.host_wait_s = 3s" in lonely.stdout
    assert not actor_pids(run_dir) and not actor_pids(tmp_path / "run2")


def test_a_topology_with_hosts_needs_host_and_the_host_must_be_this_machine(tiny_model, tmp_path):
    cmd = command(tiny_model, tmp_path / "run", *TWO, "run.base_port=27280")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "places actors on hosts a, b: start one runner on each with --host NAME" in done.stderr
    away = subprocess.run(command(tiny_model, tmp_path / "run", *TWO, 'hosts.b="192.0.2.7"',
                                  "run.base_port=27280")
                          + ["--host", "b"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert away.returncode == 2
    assert "cannot listen on tcp://192.0.2.7:27291" in away.stderr
    assert "not one of this machine's?" in away.stderr


def test_a_learner_over_two_hosts(tiny_model, tmp_path):
    """Host b is the learner's node 1: `--host b` starts only its rank there, and it finishes
    with the job (the rendezvous at host a's address, the checkpoint's shards of both ranks)."""
    run_dir = tmp_path / "run"
    nodes = ["learner.nnodes=2", 'learner.host=["a", "b"]', 'sampler.host="a"', 'reward.host="a"',
             "learner.total_steps=4", "learner.save_every=2", "run.base_port=27500"]
    procs = [start(host_command(tiny_model, run_dir, h, *nodes), tmp_path / f"{h}.log")
             for h in ("a", "b")]
    try:
        for h, p in zip(("a", "b"), procs, strict=True):
            assert p.wait(timeout=600) == 0, (tmp_path / f"{h}.log").read_text()[-3000:]
    finally:
        stop(*procs)
    assert "learner ranks of node 1 of 2 only" in (tmp_path / "b.log").read_text()
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    node1 = jsonl(run_dir / "nodes" / "node1" / "status.jsonl")
    assert node1[-1]["outcome"] == "finished" and node1[-1]["returncodes"] == {"learner-0.rank1": 0}
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_4" / "optimizer").glob("*.distcp")
                  ) == ["__0_0.distcp", "__1_0.distcp"]
    assert not actor_pids(run_dir)


def srun_line() -> str:
    """The command of the SLURM example (docs/scaling.md): what ``srun`` runs once on every node."""
    page = (ROOT / "docs" / "scaling.md").read_text()
    (line,) = [ln for ln in page.splitlines() if ln.startswith("srun ")]
    return shlex.split(line)[-1]


def test_the_readme_srun_line_starts_one_runner_per_node(tiny_model, tmp_path):
    """srun starts the same command on each node with SLURMD_NODENAME set to the node's name:
    here the two nodes are the two loopback hosts, the command is the docs', word for word."""
    hosts = tmp_path / "hosts.toml"
    hosts.write_text((ROOT / "topology.toml").read_text())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "RUN_DIR": str(tmp_path / "run"), "TOPOLOGY": str(hosts),
           "FLOWRL_ARGS": " ".join(a.replace('"', "") for a in [  # words, as a user writes them
               *command(tiny_model, tmp_path / "run", *TWO, "learner.total_steps=2",
                       "run.base_port=27260")[3:]])}
    nodes = [start(["bash", "-c", srun_line()], tmp_path / f"{n}.log",
                   env={**env, "SLURMD_NODENAME": n}) for n in ("a", "b")]
    try:
        for n, p in zip(("a", "b"), nodes, strict=True):
            assert p.wait(timeout=180) == 0, (tmp_path / f"{n}.log").read_text()[-3000:]
    finally:
        stop(*nodes)
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]


@pytest.mark.anyio
async def test_a_silent_samplers_prompts_are_issued_again_and_its_late_group_counts_once(sockets):
    """Sampler A takes prompts and goes silent (its host cut off: no keep-alive, no exit); after
    replay.sampler_timeout_s they go to sampler B, which keeps itself alive. A's late group for
    one of them is accepted, B's copy of the same prompt is rejected: one group per prompt."""
    import anyio
    import msgspec
    import zmq

    from actors.replay.actor import replay_actor
    from actors.runtime.actor import serve_actor
    from actors.runtime.zmq_bridge import make_socket
    from messages.codec import Codec, encode
    from messages.rollout import FromReplay, GroupsDone, PromptBatch, PromptRequest, SamplerAlive
    from tests.helpers import actor_context, live_topology, sample_group, wait_for

    topo = live_topology(sockets, "replay.sampler_timeout_s=1.0")
    zctx = zmq.Context()
    ctx = actor_context("replay", topo, zctx)
    codec = Codec(FromReplay)

    def group_for(prompt):
        return msgspec.structs.replace(sample_group(), prompt=prompt)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(serve_actor, ctx, replay_actor, None)
            a = make_socket(zctx, zmq.DEALER, connect=topo.replay.address, identity=b"sampler-0")
            b = make_socket(zctx, zmq.DEALER, connect=topo.replay.address, identity=b"sampler-1")
            with a, b:
                await a.send_multipart([encode(PromptRequest(2, "a"))])
                taken = codec.decode((await a.recv_multipart())[-1])
                assert isinstance(taken, PromptBatch) and len(taken.prompts) == 2

                async def keep_b_alive():
                    while True:
                        await b.send_multipart([encode(SamplerAlive("b"))])
                        await anyio.sleep(0.2)

                tg.start_soon(keep_b_alive)
                got: list = []
                while not {p.prompt_id for p in taken.prompts} <= {p.prompt_id for p in got}:
                    await b.send_multipart([encode(PromptRequest(2, "b"))])
                    batch = codec.decode((await b.recv_multipart())[-1])
                    assert isinstance(batch, PromptBatch)
                    got += batch.prompts
                await wait_for("A reported silent", lambda: ctx.status.get("samplers_silent") == 1)
                assert ctx.status["reissued_silent"] == 2
                first = taken.prompts[0]
                await a.send_multipart([encode(GroupsDone(groups=[group_for(first)]))])  # late
                await b.send_multipart([encode(GroupsDone(groups=[group_for(first)]))])
                await wait_for("B's copy rejected", lambda: ctx.status.get("rejected") == 1)
                assert ctx.status["samplers_silent"] == 0  # A spoke: it is alive again
                assert ctx.status["issued"] == ctx.status["in_flight"] + ctx.status["dropped"] \
                    + ctx.status["trained"]
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)
