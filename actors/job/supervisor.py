"""The supervisor: start one process per actor, watch them, stop them.

The processes' lifecycle (spawn, restart, attach, detach) is ``Processes``' (``actors/job/processes.py``);
``Job`` holds the job's side: the control socket, the status, the console, the signals and the
end conditions. ``Job`` (given a resolved topology by ``actors/job/launch.py``, which also opened
the metric sinks of ``run.loggers``) starts the actors in the registry's order (``python -m
actors.main RUN_DIR KIND INDEX``) and supervises them: it reports the job started once every
actor is ready, writes every step's and every validation's metrics to the sinks (the console: a
live panel on a terminal, one line per step otherwise), records every actor's status in
``status.jsonl`` (per step, per validation, every ``run.status_interval`` seconds), reports an
actor that dies with its traceback (restarting it when its ``restart`` policy says so), adds a
worker attached by hand (``runner.py attach``) when it reports and drops it when it has drained
and finished, answers an attacher's ``AskTopology``, and on Ctrl-C, a failure or the learner's
completion (and the final validation's) stops every process (Stop message, then SIGTERM, then
SIGKILL) and reaps them all. It listens to the actors until the last one is reaped, so a step
the learner finishes while stopping still reaches the sinks.

A learner of several ranks is one process per rank, started torchrun-style
(``actors/runtime/ranks.py``); rank 0 reports for the group, and when any rank dies the others
are killed at once (their collectives could only hang) and the job stops. On node k > 0 of a
learner spread over nodes (``learner.node_rank``) the runner starts only that node's ranks, keeps
its own files in ``RUN_DIR/nodes/nodeK/`` (the run directory is shared by every node: the ranks
write their checkpoint shards there), opens no metric sinks (node 0 records the job) and ends
with them. With ``[hosts]`` the runner starts only the actors placed on its host (``run.host``)
and talks to the other hosts' runners (``actors/job/multihost.py``); the runner of a host
other than the replay buffer's keeps its own files in ``RUN_DIR/hosts/NAME/``.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio
import zmq

from actors.job.config.hosts import owner
from actors.job.config.layout import start_after
from actors.job.launchers.base import Launcher
from actors.job.launchers.local import LocalLauncher
from actors.job.liveview import View
from actors.job.metrics import Metrics, Resume
from actors.job.multihost import PREFIX, Member, Owner
from actors.job.processes import Proc, Processes, job_procs
from actors.registry import BY_NAME
from actors.runtime.config import Topology
from actors.runtime.cores import remove_table
from actors.runtime.rundir import STATUS, TOPOLOGY, remove_partial
from actors.runtime.security import ZapHandler, job_keys
from actors.runtime.zmq_bridge import make_socket
from messages.codec import Codec, DecodeError, encode
from messages.control import (
    Abort,
    AskTopology,
    Finished,
    Heartbeat,
    JobTopology,
    Ready,
    StepReport,
    Stop,
    ToRunner,
    ValidationReport,
)

STOP_GRACE_S = 90.0  # time for a stop message to end an actor (the learner's final checkpoint)
TERM_GRACE_S = 10.0
LONG_WAIT_S = 10.0  # off a terminal, an actor this long in a state other than running is shown
QUIET_STATES = ("running", "finished", "stopping", "training", "waiting for batch")  # prefixes
VALIDATION_PROGRESS_S = 30.0  # off a terminal, a validation round's progress this often


def continue_command(run_dir: Path, *overrides: str, argv: list[str] | None = None) -> str:
    """The command that continues this run: the runner's own command line (``argv``, default
    this process's), with ``run.dir`` naming the run's directory (a ``{time}`` in the topology's
    would name a new one) and ``overrides`` in place of the same keys given before."""
    argv = sys.argv if argv is None else argv
    if not argv or Path(argv[0]).name != "runner.py":  # started otherwise (a Ray node's script)
        argv = ["runner.py", "TOPOLOGY"]
    keys = {o.split("=", 1)[0] for o in (*overrides, "run.dir=")}
    kept = [a for a in argv[1:] if a.split("=", 1)[0] not in keys]
    return shlex.join(["python", argv[0], *kept, f"run.dir={run_dir}", *overrides])


def validation_progress(replay: Mapping[str, Any], validated: set[int],
                        shown: tuple[int, float], now: float) -> tuple[tuple[int, float], str]:
    """The line saying how far the validation round the replay buffer's status names has got
    (``""``: none due), every ``VALIDATION_PROGRESS_S`` from the round's start (a round can take
    minutes before its one line of metrics); ``shown`` is the round last shown and when."""
    step, done, total = (int(replay.get(k, 0) or 0) for k in ("val_step", "val_done", "val_total"))
    if step < 0 or not total or done >= total or step in validated:
        return shown, ""
    if shown[0] != step:  # a new round: its first line one period on
        return (step, now), ""
    if now - shown[1] < VALIDATION_PROGRESS_S:
        return shown, ""
    return (step, now), f"... validation of step {step}: {done}/{total} prompts scored"


def awaits_final_validation(topology: Topology, resume: Resume) -> bool:
    """Whether the job ends with the validation of its last step (still to come)."""
    V = topology.validation
    return bool(V.datasets) and V.every > 0 and \
        ("validation", topology.learner.total_steps) not in resume.logged


class Job:
    def __init__(self, topology: Topology, run_dir: Path, metrics: Metrics | None = None,
                 view: View | None = None, resume: Resume | None = None,
                 home: Path | None = None, launcher: Launcher | None = None) -> None:
        self.topo = topology
        self.launcher = launcher or LocalLauncher()  # what starts the processes (run.launcher)
        self.run_dir = run_dir
        # this runner's own files (a node k > 0: RUN_DIR/nodes/nodeK; a host other than the
        # owner: RUN_DIR/hosts/NAME)
        self.home = home or run_dir
        self.processes = Processes(self, job_procs(topology, self.home))
        placed = {p.name: p for p in topology.placement}
        after = start_after(topology, topology.placement)
        for p in self.procs.values():  # each process on the GPUs the runner gave it
            if p.name in placed and not p.remote:
                p.env = {**p.env, **placed[p.name].env()}
                p.after = after.get(p.name, [])
        self.all_ready = trio.Event()  # every actor reported Ready once
        self.step = 0  # the learner's last reported step
        self.metrics = metrics or Metrics([])
        self.view = view  # the live panel's model, on a terminal
        self.final_validation = awaits_final_validation(topology, resume or Resume())
        self.validated: set[int] = set()  # steps whose validation was reported
        self.learner_done = False  # finished, the final validation still to come
        self.validation_shown = (-1, 0.0)  # the round whose progress was last printed, and when
        self.outcome: str | None = None  # "finished", "interrupted" or "failed: ..."
        self.status_unwritten = 0  # status.jsonl lines a full disk refused
        self.done = trio.Event()
        self.stopping = False
        self.started = time.monotonic()
        self.zmq = zmq.Context()
        self.curve = curve = job_keys(topology)
        self.zap = None if curve is None else ZapHandler(
            self.zmq, {curve.public}, topology.security.authorized_keys,
            log=lambda text: print(f"!!! runner: {text}", flush=True))
        self.control = make_socket(self.zmq, zmq.ROUTER, bind=topology.control_address, curve=curve)
        self.control.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # restarted actors keep their name
        self.control_codec: Codec[ToRunner] = Codec(
            ToRunner, socket=f"[runner] control ROUTER {topology.control_address}")
        self.owner: Owner | None = None  # with [hosts], on the owner: the other hosts' runners
        self.member: Member | None = None  # with [hosts], elsewhere: the link to the owner
        is_owner = topology.run.host == owner(topology)
        if topology.hosts and topology.learner.node_rank == 0:  # (node k > 0: its ranks alone)
            self.owner, self.member = (Owner(self), None) if is_owner else (None, Member(self))

    def end(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.done.set()

    def members(self) -> set[str]:
        """The other hosts of the job (their runners relay their actors' reports here)."""
        return set(self.topo.hosts) - {self.topo.run.host}

    @property
    def procs(self) -> dict[str, Proc]:
        return self.processes.procs

    def work_done(self) -> None:
        """The kind that ends the job (the learner) finished: the job ends, or waits for the
        final validation first."""
        total = self.topo.learner.total_steps
        if self.final_validation and total not in self.validated:
            self.learner_done = True
            self.say(f"=== waiting for the validation of step {total}")
        else:
            self.end("finished")

    async def listen(self) -> None:
        """Every message on the control socket: this runner's processes', attached workers',
        and (relayed) other hosts' runners' and their actors'."""
        while True:
            ident, *frames = await self.control.recv_multipart()
            p, name, host, relayed = self._sender(ident, frames)
            try:
                msg = self.control_codec.decode(frames[-1] if frames else b"")
            except DecodeError:
                continue
            match msg:
                case AskTopology() if not relayed:  # an attach from elsewhere (CURVE let it in)
                    self.send_topology(ident)
                    continue
                case Ready(status=status) if p is None and (not relayed or host in self.members()):
                    # a worker attached by hand, to this runner or to another host's
                    p = self.processes.attach(name, status, host=host, remote=relayed)
            if p is None:
                continue
            p.last_seen = time.monotonic()
            self._heard(p, msg)

    def _sender(self, ident: bytes, frames: list[bytes]) -> tuple[Proc | None, str, str, bool]:
        """Who sent ``frames``: its process (None: not one of the job's yet), its name, its
        host, and whether another host's runner relayed it."""
        relayed = self.owner is not None and ident.startswith(PREFIX)
        name, host = ident.decode(errors="replace"), self.topo.run.host
        if relayed:
            assert self.owner is not None
            p = self.owner.relayed(ident, frames)  # another host's runner, or its actor
            if len(frames) == 2 and frames[0]:  # its actor's: [name, message]
                name, host = frames[0].decode(errors="replace"), name[len(PREFIX):]
        else:
            p = self.procs.get(name)
            if self.member is not None:
                self.member.forward(ident, frames)
        return p, name, host, relayed

    def _heard(self, p: Proc, msg: Any) -> None:
        """What a message from the job's process ``p`` changes."""
        match msg:
            case Ready(status=status):
                self._ready(p, status)
            case Heartbeat(status=status):
                p.status = status
                state = str(status.get("state", ""))
                if state != p.state[0]:
                    p.state = (state, time.monotonic())
            case StepReport() as report:
                self.step = max(self.step, report.step)
                self.metrics.write("train", report.step, report.metrics)
                if report.samples:
                    self.metrics.write_samples(report.step, report.samples)
                self.record_status("step")
            case ValidationReport() as report:
                self.validated.add(report.step)
                self.metrics.write("validation", report.step, report.metrics)
                self.record_status("validation", validation_step=report.step)
                if self.learner_done and report.step == self.topo.learner.total_steps:
                    self.end("finished")
            case Abort(reason=reason):
                p.status = {**p.status, "state": "stopping the job"}
                self.say(f"!!! {p.name}: {reason}")
                self.end(f"failed: {reason.splitlines()[0]}")
            case Finished(detail=detail, status=status):
                p.finished = True
                p.status = status or p.status
                self.say(f"=== {p.name} finished: {detail}")
                if p.remote and BY_NAME[p.kind].ends_job:  # its own host's runner ends there
                    self.work_done()
                if p.attached:
                    self.processes.detach(p, "finished")

    def _ready(self, p: Proc, status: dict) -> None:
        """``p`` is ready; the job has started once every process it started is."""
        p.ready = True
        p.status = status or p.status
        if not self.all_ready.is_set() and all(q.ready for q in self.procs.values()
                                               if not q.attached):
            self.all_ready.set()
            print(f"=== job started: all {len(self.procs)} actors ready after "
                  f"{time.monotonic() - self.started:.1f}s", flush=True)
            self.record_status("started")

    def send_topology(self, ident: bytes) -> None:
        """``topology.json`` to an attaching process (an answer it may miss: it asks again)."""
        try:
            self.control.send_multipart_nowait(
                [ident, encode(JobTopology((self.home / TOPOLOGY).read_bytes()))])
        except (OSError, zmq.ZMQError):
            pass

    def record_status(self, event: str, **fields: object) -> None:
        """A ``status.jsonl`` line (``actors/runtime/rundir.py`` lists the events), with every
        actor's last reported status (the router's per-worker in flight, done, failed and
        latency percentiles among them), whether it is ready, how often it restarted and the
        pid of its process (one this runner started)."""
        line = {"event": event, "step": self.step, "time": time.time(), **fields,
                **({"rejected_frames": n} if (n := self.control_codec.rejected) else {}),
                # CURVE handshakes of unknown keys on the control socket (as each actor reports
                # its own): frames that never reached decoding, counted nowhere else
                **({"auth_refused": n} if self.zap is not None and (n := self.zap.refused) else {}),
                **{p.name: {"ready": p.ready, "restarts": p.restarts,
                            **({"restarts_by_cause": p.causes} if p.causes else {}),
                            **({"pid": p.process.pid} if p.process is not None else {}),
                            **p.status}
                   for p in self.procs.values()}}
        try:
            with (self.home / STATUS).open("a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as exc:  # a full disk: the job goes on (and the actors' writes say it)
            if not self.status_unwritten:
                print(f"!!! {self.home / STATUS} cannot be written ({exc}); the job goes on "
                      f"without it", flush=True)
            self.status_unwritten += 1

    def say(self, text: str) -> None:
        """A line for the person watching (above the live panel on a terminal)."""
        print(text, flush=True)
        if self.view is not None and text.startswith("=== waiting"):
            self.view.note = text[4:]

    async def watch(self) -> None:
        """Refresh the live panel (or, off a terminal, mention long waits), record the status
        every ``run.status_interval`` seconds, and treat an actor silent past the timeout as
        dead."""
        interval = self.topo.run.status_interval
        last_record = time.monotonic()
        while True:
            await trio.sleep(1.0)
            now = time.monotonic()
            for hosts in (self.owner, self.member):
                if hosts is not None:
                    hosts.tick(now)
            for p, process in self.processes.running():
                silent = now - p.last_seen
                if silent > self.topo.run.heartbeat_timeout:
                    self.say(f"!!! {p.name} silent for {silent:.0f}s: killing it")
                    process.kill()
            self.processes.lost(now, self.topo.run.heartbeat_timeout)
            if self.view is not None:
                self.view.actors = [p.row(now) for p in self.procs.values()]
            else:
                self.mention_long_waits(now)
            if interval > 0 and now - last_record >= interval:
                last_record = now
                self.record_status("status")

    def mention_long_waits(self, now: float) -> None:
        """Off a terminal: one line when an actor has spent ``LONG_WAIT_S`` in a state such as
        loading its model or writing a checkpoint."""
        for p in self.procs.values():
            state, since = p.state
            if state and not state.startswith(QUIET_STATES) and now - since >= LONG_WAIT_S \
                    and p.shown != state:
                p.shown = state
                self.say(f"... {p.name}: {state} ({now - since:.0f}s so far)")
        self.mention_validation(now)

    def mention_validation(self, now: float) -> None:
        """Off a terminal: a running validation round's prompts done (``validation_progress``)."""
        replay = next((p.status for p in self.procs.values() if p.kind == "replay"), {})
        self.validation_shown, line = validation_progress(replay, self.validated,
                                                          self.validation_shown, now)
        if line:
            self.say(line)

    async def signals(self) -> None:
        """First Ctrl-C: orderly stop (final checkpoint). A second one: kill every actor now."""
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
            async for _ in received:
                if self.outcome is None:
                    print("=== interrupted: stopping every actor (final checkpoint first; "
                          "Ctrl-C again to kill)", flush=True)
                    self.end("interrupted")
                    continue
                self.say("=== interrupted again: killing every actor")
                self.processes.kill(self.procs.values())

    async def shutdown(self) -> None:
        """Stop message, then SIGTERM, then SIGKILL; every child is reaped before returning."""
        self.stopping = True
        if self.owner is not None:
            self.owner.announce()
        live = self.processes.running()
        # workers attached by hand are told too (they end with the job), not waited for
        attached = [p for p in self.procs.values() if p.attached]

        async def stop_messages() -> None:
            # again every second: an actor still starting up may not be connected to hear one
            while True:
                for p in [p for p, process in live if process.returncode is None] + attached:
                    try:
                        self.control.send_multipart_nowait(
                            [p.name.encode(), encode(Stop(reason=self.outcome or ""))])
                    except zmq.ZMQError:
                        pass
                await trio.sleep(1.0)

        for grace, action in ((STOP_GRACE_S, "terminate"), (TERM_GRACE_S, "kill"), (None, None)):
            with trio.move_on_after(grace if grace is not None else 30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stop_messages)
                    for _, process in live:
                        await process.wait()
                    nursery.cancel_scope.cancel()
            live = [(p, process) for p, process in live if process.returncode is None]
            if not live or action is None:
                break
            print(f"=== {', '.join(p.name for p, _ in live)} did not stop: {action}", flush=True)
            for _, process in live:
                getattr(process, action)()

    def reaped_every_learner_rank(self) -> bool:
        """Every rank of the learner was this runner's child and has exited: a checkpoint
        half-written when the job stopped (a rank out of space while another still wrote into
        the temp folder) will never be finished, so its room can be given back now."""
        ranks = [p for p in self.processes.of_kind("learner") if not p.attached]
        L = self.topo.learner
        return (len(ranks) == L.nproc_per_node * L.nnodes
                and all(not p.remote and p.process is not None
                        and p.process.returncode is not None for p in ranks))

    async def run(self) -> int:
        try:
            async with trio.open_nursery() as outer:
                outer.start_soon(self.signals)  # stays on through shutdown
                outer.start_soon(self.listen)  # so does this: a step taken while stopping is reported
                try:
                    async with trio.open_nursery() as nursery:
                        if self.member is not None:
                            nursery.start_soon(self.member.serve)
                        await self.processes.start(nursery)
                        nursery.start_soon(self.watch)
                        await self.done.wait()
                        nursery.cancel_scope.cancel()
                finally:
                    with trio.CancelScope(shield=True):
                        await self.shutdown()
                        remove_table(self.run_dir)  # this host's core table (actors/runtime/cores.py)
                        if self.reaped_every_learner_rank():
                            remove_partial(self.run_dir)  # (a full disk wants that room back)
                        await trio.sleep(0.1)  # the last reports of the actors just reaped
                        if self.member is not None:
                            await self.member.closing()
                        if self.owner is not None:
                            await self.owner.closing()
                    outer.cancel_scope.cancel()
        finally:  # once every task of the nursery has ended: none is left waiting on them
            self.control.close()
            if self.zap is not None:
                self.zap.close()
            self.zmq.destroy(linger=0)
        self.record_status("stopped", outcome=self.outcome,
                           returncodes={p.name: p.process.returncode if p.process else None
                                        for p in self.procs.values() if not p.attached})
        self.metrics.close(self.outcome or "failed")
        print(f"=== job {self.outcome}; run directory: {self.run_dir}", flush=True)
        if restarted := [p for p in self.procs.values() if p.restarts]:
            print("    restarts: " + ", ".join(
                f"{p.name} {p.restarts} (" + ", ".join(f"{c} {n}" for c, n in p.causes.items())
                + ")" for p in restarted), flush=True)
        if self.outcome == "finished":
            more = f"learner.total_steps={2 * self.topo.learner.total_steps}"
            print(f"    continue it for more steps: {continue_command(self.run_dir, more)}",
                  flush=True)
            return 0
        print(f"    resume with: {continue_command(self.run_dir)}", flush=True)
        if self.outcome == "interrupted":
            return 130
        return 1
