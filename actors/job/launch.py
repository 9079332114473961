"""Starting a job: resolve its topology, take its run directory, make or wait for its keys, write
the resolved topology the actors read, open the metric sinks, then hand it to the supervisor
(``actors/job/supervisor.py``), whose exit status is the job's.

Resolution fills in the run directory (``{time}``), the model directory and every ``auto``
address: ``ipc://`` sockets in a fresh folder under /tmp on one host, ``tcp://IP:PORT`` with
``[hosts]`` (``actors/job/config/hosts.py``) or on each process's node under Ray (the
launcher's, ``actors/job/launchers/``, which also starts the processes and is closed last).
One runner at a time holds a run directory (with ``[hosts]`` or learner nodes, one per host or
node, each in its own folder under it).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import anyio
import msgspec
import zmq

from actors.job.config.capacity import check_shm
from actors.job.config.hosts import local_actors, owner
from actors.job.config.layout import place, start_after
from actors.job.config.preflight import preflight
from actors.job.launchers.base import Launcher
from actors.job.launchers.local import LocalLauncher
from actors.job.launchers.table import launcher_for
from actors.job.liveview import LiveView
from actors.job.loggers import open_metrics
from actors.job.processes import job_procs, learner_ranks
from actors.job.supervisor import Job
from actors.job.trackers import TrackerError
from actors.registry import NAMES
from actors.runtime.config import ConfigError, ProcessName, Topology, visible_gpus
from actors.runtime.ranks import free_port
from actors.runtime.recording import damaged_parts
from actors.runtime.rundir import (
    CHECKPOINTS,
    LOGS,
    METRICS,
    STATUS,
    TOPOLOGY,
    VALIDATION,
    DiskFull,
    cut_torn_line,
    latest_checkpoint,
    out_of_space,
    remove_stale_sockets,
    set_aside_damaged,
)
from actors.runtime.security import prepare_job_keys


def resolve(topology: Topology, *, model_ready: bool = True,
            launcher: Launcher | None = None) -> tuple[Topology, Path]:
    """Fill in the run directory, the model directory and every ``auto`` address: those the
    launcher knows (``[hosts]``: each host's; Ray: each process's node), ``ipc://`` the rest."""
    from actors.model_store import resolve_model_path

    run_dir = Path(topology.run.dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))).resolve()
    topology = msgspec.structs.replace(
        topology, run=msgspec.structs.replace(topology.run, dir=str(run_dir)))
    launcher = launcher or LocalLauncher()
    names = [p.name for p in job_procs(topology, run_dir).values() if not p.remote]
    topology = launcher.addresses(topology, names)
    sockets = topology.run.socket_dir or tempfile.mkdtemp(prefix="flowrl-", dir="/tmp")
    Path(sockets).mkdir(parents=True, exist_ok=True)

    def addr(value: str, name: str) -> str:
        return f"ipc://{sockets}/{name}" if value == "auto" else value

    try:
        model = str(resolve_model_path(topology.model.path)) if model_ready else topology.model.path
    except FileNotFoundError as exc:
        raise ConfigError(f"model.path: {exc}") from None
    resolved = msgspec.structs.replace(
        topology,
        run=msgspec.structs.replace(topology.run, dir=str(run_dir), socket_dir=sockets),
        model=msgspec.structs.replace(topology.model, path=model),
        replay=msgspec.structs.replace(topology.replay, address=addr(topology.replay.address, "replay")),
        router=msgspec.structs.replace(
            topology.router, address=addr(topology.router.address, "router"),
            worker_address=addr(topology.router.worker_address, "router-workers")),
        learner=msgspec.structs.replace(
            topology.learner, weights_address=addr(topology.learner.weights_address, "weights"),
            master_port=topology.learner.master_port or free_port(topology.learner.master_addr)),
        control_address=addr(topology.control_address, "control"),
    )
    return resolved, run_dir


def resumable(run_dir: Path) -> bool:
    """Damage on disk, before a run resumes: each damaged checkpoint is set aside (one line
    each), the run resuming from the newest whole one; False, with the error printed, when
    none is left or the recording is damaged (the run cannot resume exactly)."""
    aside = set_aside_damaged(run_dir)
    for line in aside:
        print(f"=== {line}", flush=True)
    if aside and latest_checkpoint(run_dir) is None:
        print(f"error: no whole checkpoint is left in {run_dir / CHECKPOINTS} (each was "
              f"damaged on disk and set aside); resuming would train from step 0 over a run "
              f"recorded past it: restore a checkpoint from a copy, or start a new run "
              f"directory (run.dir)", file=sys.stderr)
        return False
    if damaged := damaged_parts(run_dir):
        print(f"error: the recording of {run_dir} is damaged on disk, so the run cannot "
              f"resume exactly: {'; '.join(damaged)}. Restore the part from a copy, or start a "
              f"new run directory (run.dir)", file=sys.stderr)
        return False
    return True


def node_home(run_dir: Path, node_rank: int) -> Path:
    """Where the runner of node ``node_rank`` keeps its lock, topology and status."""
    return run_dir if node_rank == 0 else run_dir / "nodes" / f"node{node_rank}"


def bad_topology(exc: ConfigError) -> int:
    """The runner's answer to a topology it refuses before starting anything: one line naming
    the key, and exit status 2 (the status scripts tell a bad topology by)."""
    print(f"error: bad topology: {exc}", file=sys.stderr)
    return 2


def run_job(topology: Topology) -> int:
    """Resolve ``topology``, take the run directory, start and supervise the job; its exit
    status (0 finished, 130 interrupted, 1 failed, 2 refused before starting)."""
    own_sockets = not topology.run.socket_dir  # a fresh temp folder, removed at exit
    if topology.hosts and not topology.run.host:
        print(f"error: this topology places actors on hosts {', '.join(topology.hosts)}: start "
              "one runner on each with --host NAME", file=sys.stderr)
        return 2
    try:
        launcher = launcher_for(topology)  # (refused where it cannot run: Ray not installed)
        print("=== checking the model, the data files and the user code", flush=True)
        preflight(topology)  # before anything is started or written: a bad input stops here
    except ConfigError as exc:
        return bad_topology(exc)
    try:
        return _run(topology, launcher, own_sockets)
    finally:
        launcher.close()


def _run(topology: Topology, launcher: Launcher, own_sockets: bool) -> int:
    try:
        topology, run_dir = resolve(topology, launcher=launcher)
    except ConfigError as exc:
        return bad_topology(exc)
    home = _runner_home(topology, run_dir)
    lock = _lock(home, topology.run.host)
    if lock is None:
        return 2
    try:
        try:
            topology = _with_keys_and_placement(topology, run_dir, home, launcher)
        except ConfigError as exc:
            return bad_topology(exc)
        mine = _prepare_run_dir(topology, run_dir, home)
        if topology.learner.resume and home == run_dir and not resumable(run_dir):
            return 2
        _announce(topology, run_dir, mine)
        return _supervise(topology, run_dir, home, launcher)
    except OSError as exc:  # the runner's own files (the topology, keys, records) at the start
        if isinstance(exc, DiskFull) or not out_of_space(exc, run_dir):
            raise
        print(f"error: {DiskFull(run_dir, 'the job files the runner writes', None)}",
              file=sys.stderr)
        return 1
    finally:
        if own_sockets:
            shutil.rmtree(topology.run.socket_dir, ignore_errors=True)
        lock.close()


def _runner_home(topology: Topology, run_dir: Path) -> Path:
    """This runner's own folder: the run directory for the owner's runner, its node's folder
    for a learner node k > 0, ``hosts/NAME`` for another host's."""
    here, node = topology.run.host, topology.learner.node_rank
    home = node_home(run_dir, node) if node or here == owner(topology) \
        else run_dir / "hosts" / here
    home.mkdir(parents=True, exist_ok=True)
    return home


def _lock(home: Path, here: str) -> TextIO | None:
    """The lock of ``home``, held for the job's lifetime; None (the error printed) when another
    runner holds it."""
    lock = open(home / ".runner.lock", "w")  # noqa: SIM115 - held for the job's lifetime
    try:
        # released by the kernel when this process dies, however it dies (kill -9 included)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"error: another runner is using {home}" + (f" (host {here})" if here else ""),
              file=sys.stderr)
        lock.close()
        return None
    return lock


def _with_keys_and_placement(topology: Topology, run_dir: Path, home: Path,
                             launcher: Launcher) -> Topology:
    """``topology`` with the job's keys and this runner's placement; ConfigError for either."""
    remove_stale_sockets(home, Path(topology.run.socket_dir))
    if home == run_dir:
        topology = prepare_job_keys(topology, run_dir)
    else:  # the owner's runner makes the job's keys: they must be the same everywhere
        topology = wait_for_job_keys(topology, run_dir)
    return with_placement(topology, home, launcher.gpus())


def _prepare_run_dir(topology: Topology, run_dir: Path, home: Path) -> set[str]:
    """Clear this runner's stale tracebacks, write the resolved topology the actors read and
    cut a torn last line off the records appended to; returns the names of the processes this
    runner starts."""
    (run_dir / LOGS).mkdir(exist_ok=True)
    ranks = {p.name for p in learner_ranks(topology, home)}
    placed = local_actors(topology)
    others = {str(ProcessName(k, i)) for k, i in placed if k != "learner"}
    mine = ranks if topology.learner.node_rank else (
        others | (ranks if ("learner", 0) in placed else set()))
    for stale in (run_dir / LOGS).glob("*.traceback"):
        if stale.stem in mine:  # (another host's or node's are not this runner's to remove)
            stale.unlink()
    resolved = home / TOPOLOGY  # actors read it: replace it whole, never half-written
    try:
        before = _user_code(resolved.read_bytes())
    except OSError:  # a first start
        before = {}
    written = msgspec.json.format(msgspec.json.encode(topology))
    tmp = resolved.with_name(f".topology.json.{os.getpid()}.tmp")
    tmp.write_bytes(written)
    os.replace(tmp, resolved)
    print(f"=== run directory: {run_dir}", flush=True)
    for key, (path, sha) in _user_code(written).items():
        if key in before and before[key][1] != sha:
            print(f"=== {key}.path: {path} changed since this run's last start (sha256 "
                  f"{before[key][1][:12]}... then, {sha[:12]}... now): the steps from here on "
                  f"compute with the new code, and a rerun of an earlier step too (it runs "
                  f"the file as it is now)", flush=True)
    print(f"=== model: {topology.model.path}", flush=True)
    # records appended to: a last line a kill cut short is cut off (the owner's runner
    # writes the metrics and checks the checkpoints)
    for record in (STATUS, METRICS, VALIDATION) if home == run_dir else (STATUS,):
        cut_torn_line(home / record)
    return mine


def _user_code(resolved: bytes) -> dict[str, tuple[str, str]]:
    """``{key: (path, sha256)}`` of each user code file a resolved topology (its JSON)
    records (a custom loss or estimator); empty when there is none or it cannot be read."""
    try:
        algorithm = msgspec.json.decode(resolved).get("algorithm", {})
    except (msgspec.DecodeError, AttributeError):
        return {}
    return {f"algorithm.{key}": (row["path"], row["sha256"]) for key, row in algorithm.items()
            if isinstance(row, dict) and row.get("sha256") and row.get("path")}


def _announce(topology: Topology, run_dir: Path, mine: set[str]) -> None:
    """Print what this runner is about to start: the checkpoint resumed from, the actors, the
    placement on GPUs and the processes started in turn."""
    here, node = topology.run.host, topology.learner.node_rank
    resumed = latest_checkpoint(run_dir) if topology.learner.resume else None
    if resumed is not None:  # the learner loads it; the replay buffer its recording
        print(f"=== resuming from {resumed.name} ({resumed})", flush=True)
    counts = ", ".join(f"{k}×{getattr(topology, k).count}" for k in NAMES
                       if getattr(topology, k).count)  # (no teacher×0)
    if node > 0:
        counts = f"learner ranks of node {node} of {topology.learner.nnodes} only"
    elif here:
        counts = f"{', '.join(sorted(mine))} on host {here} (of {counts})"
    print(f"=== actors: {counts}; max_staleness={topology.algorithm.max_staleness}", flush=True)
    if any(p.gpus for p in topology.placement):
        print("=== placement: " + "; ".join(p.describe() for p in topology.placement),
              flush=True)
    if waits := start_after(topology, topology.placement):
        print("=== started in turn on shared GPUs (vLLM measures the free memory as it "
              "starts): " + "; ".join(f"{name} after {', '.join(before)}"
                                     for name, before in waits.items()), flush=True)


def _supervise(topology: Topology, run_dir: Path, home: Path, launcher: Launcher) -> int:
    """Open the metric sinks and the live panel (node 0 only: it records the job) and run the
    supervisor until the job ends; its exit status."""
    here = topology.run.host
    try:
        if topology.learner.node_rank > 0:  # node 0 records the job: no sinks, no panel here
            return anyio.run(Job(topology, run_dir, home=home, launcher=launcher).run,
                             backend="trio")
        try:
            metrics, view, resume = open_metrics(topology, run_dir)
        except TrackerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        job = Job(topology, run_dir, metrics, view, resume, home, launcher)
    except zmq.ZMQError as exc:
        print(f"error: this runner cannot listen on {topology.control_address}: {exc}"
              + (f" (is a runner for host {here} already running, or is {here}'s address "
                 "not one of this machine's?)" if here else ""), file=sys.stderr)
        return 2
    live = next((s for s in metrics.sinks if isinstance(s, LiveView)), None)
    if live is not None:
        live.start()
    try:
        return anyio.run(job.run, backend="trio")
    finally:
        if live is not None and live.live.is_started:
            live.close(job.outcome or "failed")


def with_placement(topology: Topology, home: Path,
                   gpus: Sequence[str] | None = None) -> Topology:
    """``topology`` with the placement of the processes this runner starts on its GPUs
    (``gpus``: default, those it sees: ``visible_gpus``); ConfigError for a layout that cannot
    work, or for a /dev/shm too small for the weights (``capacity.check_shm``)."""
    names = [p.name for p in job_procs(topology, home).values() if not p.remote]
    placed = place(topology, names, visible_gpus() if gpus is None else gpus)
    check_shm(topology, learner_on_gpu=any(p.gpus for p in placed
                                           if ProcessName.parse(p.name).kind == "learner"))
    return msgspec.structs.replace(topology, placement=placed)


def wait_for_job_keys(topology: Topology, run_dir: Path) -> Topology:
    """Another host's runner: the job's keys, made by the owner's runner (a run directory shared
    by the hosts, or ``security.keys_dir`` copied to each), waited for up to run.host_wait_s."""
    if not topology.security.curve:
        return topology
    keys_dir = Path(topology.security.keys_dir or run_dir / "keys")
    deadline = time.monotonic() + topology.run.host_wait_s
    while True:
        if all((keys_dir / f"{n}.key_secret").is_file() for n in ("server", "client")):
            time.sleep(0.2)  # a key being written by the owner is whole a moment later
            return prepare_job_keys(topology, run_dir)
        if time.monotonic() > deadline:
            raise ConfigError(f"security.keys_dir: no job keys in {keys_dir} after "
                              f"run.host_wait_s: the owner host {owner(topology)}'s runner makes "
                              "them; share the run directory or copy its keys there")
        print(f"=== waiting for the job's keys in {keys_dir} (the owner host makes them)",
              flush=True)
        time.sleep(2.0)
