"""A job's processes, by actor kind, and each one's lifecycle in one place.

A kind's processes are started (``spawn``), watched until they exit and then restarted or not
(``supervise``), joined by workers attached by hand (``attach``: a ``runner.py attach KIND``
process that reports to this runner), left by them when they drain and finish (``detach``), and
finished. What differs between kinds is a row of the registry (``actors/registry.py``: gang,
ends_job, attachable) and the kind's ``restart`` / ``max_restarts`` settings; nothing here names
a kind. The job (``supervisor.Job``) owns the control socket, the status, the console and the end
conditions, and calls in here.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from actors.job.config.hosts import host_of, local_actors, owner
from actors.job.launchers.base import (
    ACTOR_ENV,
    ENTRY,
    FAILED,
    NO_ROOM,
    NODE_LOST,
    exit_cause,
)
from actors.job.launchers.table import LAUNCHERS
from actors.job.liveview import ActorRow
from actors.registry import BY_NAME, NAMES
from actors.runtime.config import ProcessName, Topology, reward_processes
from actors.runtime.ranks import node_ranks
from actors.runtime.rundir import EXIT_DISK_FULL, LOGS, TOPOLOGY, traceback_file
from messages.control import StatusValue

if TYPE_CHECKING:
    from actors.job.launchers.base import Child, Launcher
    from actors.job.liveview import View


class ProcessesJob(Protocol):
    """All that ``Processes`` reads or calls of the job that owns them (``actors.job.supervisor.Job``
    is one; mypy checks it): where the run and this runner's files are, whether a live panel
    shows the actors, whether the job is stopping, and how to record, say, end or finish."""

    topo: Topology
    run_dir: Path
    home: Path  # this runner's own files (another host's runner: RUN_DIR/hosts/NAME)
    view: View | None
    stopping: bool

    def work_done(self) -> None: ...

    def end(self, outcome: str) -> None: ...

    def say(self, text: str) -> None: ...

    def record_status(self, event: str, **fields: object) -> None: ...

    @property
    def launcher(self) -> Launcher: ...


@dataclasses.dataclass
class Proc:
    kind: str
    index: int
    process: Child | None = None
    restarts: int = 0  # every restart, whatever the cause
    causes: dict[str, int] = dataclasses.field(default_factory=dict)  # restarts by exit_cause
    ready: bool = False
    finished: bool = False
    last_seen: float = 0.0
    status: dict = dataclasses.field(default_factory=dict)
    # its reported state and since when (monotonic; from when this runner follows it: another
    # host's actor is never spawned here to set it)
    state: tuple[str, float] = dataclasses.field(
        default_factory=lambda: ("starting", time.monotonic()))
    shown: str = ""  # the last long-lasting state printed for it (off a terminal)
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # a learner rank's torchrun vars
    rank: int = 0  # the learner's rank (0 speaks for its group; other kinds are all rank 0)
    host: str = ""  # with [hosts]: where it runs
    remote: bool = False  # another host's runner starts it (the owner hears it through that one)
    attached: str = ""  # a worker attached by hand: its own name (no process of this runner's)
    after: list[str] = dataclasses.field(default_factory=list)  # started once these are ready
    # (processes sharing its GPU: ``layout.start_after``)

    @property
    def name(self) -> str:
        return self.attached or str(ProcessName(self.kind, self.index, self.rank))

    def row(self, now: float) -> ActorRow:
        return ActorRow(self.name, self.kind, self.ready, self.restarts, now - self.last_seen,
                        self.status, now - self.state[1], finished=self.finished)


class Processes:
    """The processes this runner follows, by name, and what happens to them over their life."""

    def __init__(self, job: ProcessesJob, procs: dict[str, Proc]) -> None:
        self.job = job
        self.procs = procs  # every process of the job this runner follows, attached ones too

    def of_kind(self, kind: str) -> list[Proc]:
        return [p for p in self.procs.values() if p.kind == kind]

    def running(self) -> list[tuple[Proc, Child]]:
        """This runner's own processes that have not exited."""
        return [(p, p.process) for p in self.procs.values()
                if p.process is not None and p.process.returncode is None]

    async def start(self, nursery: trio.Nursery) -> None:
        """Start every process this runner starts itself, in the registry's order; one that
        must wait for others on its GPU (``Proc.after``) once they are ready."""
        for p in list(self.procs.values()):
            if p.remote or p.attached:
                continue
            if p.after:
                nursery.start_soon(self.start_after, p, nursery)
                continue
            await self.spawn(p)
            nursery.start_soon(self.supervise, p)

    async def start_after(self, p: Proc, nursery: trio.Nursery) -> None:
        # readiness is a flag the job's control socket sets (as the watch loop reads it)
        while not all(self.procs[n].ready for n in p.after if n in self.procs):  # noqa: ASYNC110
            await trio.sleep(0.5)
        await self.spawn(p)
        nursery.start_soon(self.supervise, p)

    async def spawn(self, p: Proc) -> None:
        job = self.job
        args = ["-m", ENTRY, str(job.run_dir), p.kind, str(p.index)]
        p.ready, p.finished, p.status, p.last_seen = False, False, {}, time.monotonic()
        p.state = ("starting", p.last_seen)
        env = {**ACTOR_ENV, **p.env}
        if job.home != job.run_dir:  # another host's actors read their own runner's topology
            env["FLOWRL_TOPOLOGY"] = str(job.home / TOPOLOGY)
        # plain lines: the actors write to the runner's own output; under the live panel an
        # actor's own output would tear it: it goes to logs/NAME.log
        log = None if job.view is None else job.run_dir / LOGS / f"{p.name}.log"
        p.process = await job.launcher.spawn(p.name, args, env, log)

    async def supervise(self, p: Proc) -> None:
        """Wait for a process to exit; restart it or end the job, per its kind's row and its
        ``restart`` policy."""
        job, row = self.job, BY_NAME[p.kind]
        while True:
            assert p.process is not None
            rc = await p.process.wait()
            if job.stopping:
                return
            if rc == 0 and p.finished and row.ends_job:
                if p.rank == 0 or all(q.finished for q in self.of_kind(p.kind)):
                    job.work_done()  # rank 0, or on a node without it, the last rank
                return
            if row.gang:
                self.kill(q for q in self.of_kind(p.kind) if q is not p)
            tb_file = traceback_file(job.run_dir, p.name)
            if rc == 0 and p.finished:  # a worker that drained on a signal (not the runner's)
                tb = "(it drained and left on a signal; this runner is still running the job)"
            elif tb_file.is_file():
                tb = tb_file.read_text()
            elif rc < 0:
                tb = f"(no traceback: killed by signal {signal.Signals(-rc).name})"
            else:
                tb = "(no traceback: it stopped without being asked to)"
            pid = f"pid {p.process.pid}" if p.process.pid else "its process never started"
            print(f"!!! actor {p.name} ({pid}) exited with status {rc}\n{tb}",
                  flush=True)
            cfg = getattr(job.topo, p.kind)
            cause = exit_cause(p.process)
            failures = p.causes.get(FAILED, 0)
            # a lost node is not the process's failure: it restarts wherever there is room
            full = rc == EXIT_DISK_FULL  # a restart would find no more room
            restart = cfg.restart == "on-failure" and cause != NO_ROOM and not full and (
                cause == NODE_LOST or failures < cfg.max_restarts)
            job.record_status("exited", actor=p.name, returncode=rc, restart=restart, cause=cause)
            if restart:
                p.restarts += 1
                p.causes[cause] = p.causes.get(cause, 0) + 1
                tb_file.unlink(missing_ok=True)
                counted = (f"{failures + 1}/{cfg.max_restarts}" if cause == FAILED
                           else f"{cause}: not counted against {p.kind}.max_restarts")
                print(f"!!! restarting {p.name} ({counted})", flush=True)
                await self.spawn(p)
                continue
            job.end(f"failed: actor {p.name} exited with status {rc}"
                    + (" (no node has room for it)" if cause == NO_ROOM else "")
                    + (f": {tb.strip()}" if full else ""))
            return

    def kill(self, procs: Iterable[Proc]) -> None:
        for q in procs:
            if q.process is not None and q.process.returncode is None:
                q.process.kill()

    def attach(self, name: str, status: dict[str, StatusValue], host: str = "",
               remote: bool = False) -> Proc | None:
        """A worker attached by hand says Ready (its status names its kind): a row for it
        (``remote``: it reports to another host's runner, which relays it here)."""
        kind = str(status.get("attached", ""))
        if kind not in BY_NAME or not BY_NAME[kind].attachable or name in self.procs:
            return None
        p = self.procs[name] = Proc(kind, -1, attached=name, last_seen=time.monotonic(),
                                    host=host, remote=remote)
        self.job.say(f"=== {name} attached")
        self.job.record_status("attached", actor=name, kind=kind)
        return p

    def detach(self, p: Proc, why: str) -> None:
        """An attached worker left (it finished draining, or went silent): recorded, then its
        row goes (it has no process to wait for)."""
        self.job.record_status("detached", actor=p.name, reason=why)
        self.procs.pop(p.name, None)

    def lost(self, now: float, timeout: float) -> None:
        """Attached workers silent past ``timeout``: gone (their prompts or requests are taken
        back by the replay buffer's or the router's own timeout)."""
        for p in [p for p in self.procs.values() if p.attached and now - p.last_seen > timeout]:
            self.job.say(f"!!! {p.name} (attached) silent for {now - p.last_seen:.0f}s: dropped")
            self.detach(p, "silent")


def job_procs(topology: Topology, home: Path) -> dict[str, Proc]:
    """The processes this runner follows, by name (``remote``: another host's runner starts it)."""
    here = set(local_actors(topology))  # with [hosts]: this host's; without: all
    is_owner = topology.run.host == owner(topology)
    procs = {
        p.name: p
        for kind in (NAMES if topology.learner.node_rank == 0 else ("learner",))
        for p in (learner_ranks(topology, home) if kind == "learner" else
                  [Proc(kind, i) for i in range(getattr(topology, kind).count)])
        # the owner also follows the others' actors; a learner node k > 0 runs its ranks
        if (kind, p.index) in here or is_owner or topology.learner.node_rank > 0
    }
    for p in procs.values():
        p.host = host_of(topology, p.kind, p.index)
        p.remote = (p.kind, p.index) not in here and topology.learner.node_rank == 0
    if topology.learner.node_rank == 0:  # served models' replicas (config/pools.py): reward
        R = topology.reward  # processes after the rule workers, on the owner's host
        for i in range(R.count, reward_processes(R)):
            procs[str(ProcessName("reward", i))] = Proc("reward", i, host=owner(topology),
                                                        remote=not is_owner)
    return procs


def learner_ranks(topology: Topology, home: Path) -> list[Proc]:
    """The learner processes this runner starts, one per rank, each with its torchrun
    environment: this node's (and on a node k > 0, the topology file of this node's runner),
    or under a launcher that places processes across nodes (Ray) every node's, in rank order,
    with the same variables the per-node runners would give them."""
    L = topology.learner
    own = {"FLOWRL_TOPOLOGY": str(home / TOPOLOGY)} if L.node_rank > 0 else {}
    every = LAUNCHERS[topology.run.launcher].across_nodes
    return [Proc("learner", 0, env={**r.env(), **own}, rank=r.rank)
            for node in (range(L.nnodes) if every else (L.node_rank,))
            for r in node_ranks(L.nproc_per_node, L.nnodes, node, L.master_addr, L.master_port)]
