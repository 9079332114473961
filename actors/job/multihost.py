"""The runners of a job over several hosts, and how they talk (``actors/job/config/hosts.py``
says where each actor runs and what its addresses are).

Each host's runner starts and supervises its own actors, which report to it on its own control
port. The owner (the replay buffer's host) keeps the job's record: the runner of every other host
(a ``Member``) connects a DEALER named ``host:NAME`` to the owner's control socket, relays each of
its actors' control messages there as ``[actor, message]`` and sends its own heartbeat as
``[b"", Heartbeat]``; the owner (``Owner``) treats a relayed message as if the actor had sent it
to it, sends each member a heartbeat back, and at the end a ``Stop`` whose reason is the job's
outcome, which the member adopts. So the owner's ``status.jsonl`` and console show every actor of
the job, "job started" means every actor on every host is ready, and one outcome ends every host.

Partitions: a member whose actors go silent past ``run.heartbeat_timeout`` is reported lost; a
lost learner or router stops the job with an error (their state cannot be re-made elsewhere; the
job resumes when every host's command is run again), while a lost sampler's prompts are issued
again by the replay buffer (``replay.sampler_timeout_s``) and a lost reward worker's requests are
re-sent by the router. A member that hears nothing from the owner for that long stops its actors.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

import trio
import zmq

from actors.job.config.hosts import control_address, owner
from actors.runtime.zmq_bridge import make_socket
from messages.codec import Codec, DecodeError, encode
from messages.control import Heartbeat, StatusValue, Stop

if TYPE_CHECKING:
    from actors.job.processes import Proc
    from actors.runtime.config import Topology
    from actors.runtime.security import CurveKeys
    from actors.runtime.zmq_bridge import AsyncSocket


class HostJob(Protocol):
    """All that the link between the hosts' runners reads or calls of this host's job
    (``actors.job.supervisor.Job`` is one; mypy checks it): the job's topology, its processes,
    its clock and progress, its control socket, and how to end it or say something."""

    topo: Topology
    started: float  # time.monotonic() when the runner started
    step: int  # the learner's last reported step
    outcome: str | None
    all_ready: trio.Event
    zmq: zmq.Context
    curve: CurveKeys | None
    control: AsyncSocket

    @property
    def procs(self) -> dict[str, Proc]: ...

    def end(self, outcome: str) -> None: ...

    def say(self, text: str) -> None: ...

    def record_status(self, event: str, **fields: object) -> None: ...

PREFIX = b"host:"
WAIT_REPORT_S = 5.0  # seconds between "waiting for ..." lines
MEMBER_GRACE_S = 10.0  # at the end, how long the owner repeats the outcome to a silent member
# ZeroMQ heartbeats between the runners: a connection through a partition is declared dead and
# made again as soon as the link is back, instead of waiting out TCP's retransmission backoff
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 1000, 4000


def heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def outcome_code(outcome: str | None) -> str:
    return outcome or "running"


class Owner:
    """The owner's side: the other hosts' runners and their actors."""

    def __init__(self, job: HostJob) -> None:
        self.job = job
        self.members: dict[str, float] = {}  # host -> when its runner was last heard
        self.ended: set[str] = set()  # members that reported an outcome (they took the Stop)
        heartbeats(job.control.socket)  # for the members' connections, all made after this
        self.lost: set[str] = set()  # remote actors reported silent
        self.last_wait_report = 0.0  # the first "waiting for" line comes at the first tick
        self.codec: Codec[Heartbeat] = Codec(Heartbeat)

    def remote(self) -> list[Proc]:
        return [p for p in self.job.procs.values() if p.remote]

    def relayed(self, ident: bytes, frames: list[bytes]) -> Proc | None:
        """A frame from a member runner: its heartbeat (handled here, None) or an actor's
        message (its ``Proc``, whose message ``frames[-1]`` the caller handles)."""
        host = ident[len(PREFIX):].decode(errors="replace")
        if host not in self.job.topo.hosts or host == self.job.topo.run.host:
            return None
        self.members[host] = time.monotonic()
        if len(frames) == 2 and frames[0]:
            p = self.job.procs.get(frames[0].decode(errors="replace"))
            if p is None or p.host != host:
                return None
            if p.name in self.lost:
                self.lost.discard(p.name)
                print(f"=== {p.name} on host {host} is heard again", flush=True)
            return p
        try:
            beat = self.codec.decode(frames[-1] if frames else b"")
        except DecodeError:
            return None
        state = str(beat.status.get("state", ""))
        if state and state != "running":
            self.ended.add(host)
        if state.startswith("failed"):
            self.job.end(f"failed: host {host}: {state.removeprefix('failed: ')}")
        return None

    def tick(self, now: float) -> None:
        """Heartbeats to the members; waiting, silence and loss of the other hosts' actors."""
        job, topo = self.job, self.job.topo
        for host in self.members:
            self.send(host, Heartbeat(actor="runner", status={"step": job.step}))
        if not job.all_ready.is_set():
            waiting = [p for p in self.remote() if not p.ready]
            # said first, so a failure on a late first tick still shows what it waited for
            if waiting and now - self.last_wait_report >= WAIT_REPORT_S:
                self.last_wait_report = now
                job.say(f"=== waiting for {names(waiting)} ({now - job.started:.0f}s of "
                        f"{topo.run.host_wait_s:g}s)")  # (on a terminal: the live panel's note)
            if waiting and now - job.started > topo.run.host_wait_s:
                job.end(f"failed: not ready after run.host_wait_s = {topo.run.host_wait_s:g}s: "
                        f"{names(waiting)} (is `runner.py ... --host NAME` running there?)")
        for p in self.remote():
            silent = now - p.last_seen
            if not p.ready or p.finished or silent <= topo.run.heartbeat_timeout:
                continue
            if getattr(topo, p.kind).restart == "never":
                job.end(f"failed: {p.name} on host {p.host} silent for {silent:.0f}s (host lost or "
                        "cut off); run every host's command again with the same run.dir to resume")
            elif p.name not in self.lost:
                self.lost.add(p.name)
                p.status = {**p.status, "state": "lost"}
                print(f"!!! {p.name} on host {p.host} silent for {silent:.0f}s (host lost or cut "
                      "off): its prompts or requests go to the others", flush=True)
                job.record_status("lost", actor=p.name, host=p.host)

    def send(self, host: str, message: Any) -> None:
        try:
            self.job.control.send_multipart_nowait([PREFIX + host.encode(), encode(message)])
        except zmq.ZMQError:
            pass  # not connected now: it learns from the silence

    def announce(self) -> None:
        """Tell every member the job's outcome (they stop their actors and adopt it)."""
        for host in set(self.members) - self.ended:
            self.send(host, Stop(reason=outcome_code(self.job.outcome)))

    async def closing(self) -> None:
        """Repeat the outcome until every member has reported taking it, for at most
        ``MEMBER_GRACE_S`` (a member behind a link just mended reconnects first; one that stays
        cut off stops by itself when the owner has been silent too long)."""
        deadline = time.monotonic() + min(MEMBER_GRACE_S, self.job.topo.run.heartbeat_timeout)
        while set(self.members) - self.ended and time.monotonic() < deadline:
            self.announce()
            await trio.sleep(0.5)


class Member:
    """A non-owner host's runner: relays its actors' reports to the owner and obeys its Stop."""

    def __init__(self, job: HostJob) -> None:
        self.job = job
        topo = job.topo
        self.owner = owner(topo)
        self.address = control_address(topo, self.owner)
        self.uplink = make_socket(job.zmq, zmq.DEALER, identity=PREFIX + topo.run.host.encode(),
                                  curve=job.curve)
        heartbeats(self.uplink.socket)
        self.uplink.socket.connect(self.address)
        self.heard: float | None = None  # when the owner was last heard (None: not yet)
        self.last_beat = 0.0
        self.last_wait_report = 0.0  # the first "waiting for" line comes at the first tick

    def forward(self, ident: bytes, frames: list[bytes]) -> None:
        """An actor's control message, on to the owner (dropped while the owner is unreachable
        and the queue is full: its heartbeats are repeated anyway)."""
        self.send([ident, frames[-1] if frames else b""])

    def send(self, frames: list[bytes]) -> None:
        try:
            self.uplink.send_multipart_nowait(frames)
        except zmq.ZMQError:
            pass

    def beat(self) -> None:
        status: dict[str, StatusValue] = {"state": outcome_code(self.job.outcome),
                                          "actors": len(self.job.procs)}
        self.send([b"", encode(Heartbeat(actor=f"host:{self.job.topo.run.host}", status=status))])

    async def serve(self) -> None:
        codec: Codec[Stop | Heartbeat] = Codec(Stop | Heartbeat)
        while True:
            frames = await self.uplink.recv_multipart()
            try:
                msg = codec.decode(frames[-1])
            except DecodeError:
                continue
            self.heard = time.monotonic()
            if isinstance(msg, Stop):
                print(f"=== the owner host {self.owner} ended the job: {msg.reason}", flush=True)
                self.job.end(msg.reason if msg.reason != "running" else "interrupted")
                self.beat()  # the owner waits for this: it took the outcome

    def tick(self, now: float) -> None:
        job, run = self.job, self.job.topo.run
        if now - self.last_beat >= run.heartbeat_interval:
            self.last_beat = now
            self.beat()
        if self.heard is None:
            if now - self.last_wait_report >= WAIT_REPORT_S:  # (said before a failure too)
                self.last_wait_report = now
                job.say(f"=== waiting for the owner host {self.owner} (its runner at "
                        f"{self.address}; {now - job.started:.0f}s of {run.host_wait_s:g}s)")
            if now - job.started > run.host_wait_s:
                job.end(f"failed: the owner host {self.owner} (its runner at {self.address}) did "
                        f"not answer within run.host_wait_s = {run.host_wait_s:g}s")
        elif now - self.heard > run.heartbeat_timeout:
            job.end(f"failed: lost the owner host {self.owner}: silent for {now - self.heard:.0f}s "
                    "(run every host's command again with the same run.dir to resume)")

    async def closing(self) -> None:
        """Tell the owner how this host ended (a failure here stops the job there too)."""
        self.beat()
        await trio.sleep(0.3)  # a moment for the frame to leave (the owner may be gone)
        self.uplink.close()


def names(procs: list[Proc]) -> str:
    return ", ".join(f"{p.name} (host {p.host})" for p in procs)
