"""The router: one front door for a pool of workers, least in-flight first.

Clients (samplers) send ``ScoreRequest`` to the client ROUTER; workers connect to the worker
ROUTER, say ``WorkerHello`` (or just heartbeat) and get requests. The router re-keys each
request with its own id, so a reply maps back to exactly one client request; a reply whose id
is no longer in flight (a late duplicate after a re-send) is discarded and counted. A request
whose worker stops heartbeating or exceeds ``request_timeout`` is re-sent to another live worker.
While no worker can take it, a request waits in a bounded queue.

``RouterState`` holds the decisions and the bookkeeping, without I/O. ``RouterLoop`` serves both
sockets from a blocking ``zmq.poll`` loop in a thread of its own; ``router_actor`` starts that
thread, publishes its status and stops it when cancelled.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import zmq

from actors.runtime.actor import ActorContext
from actors.runtime.zmq_bridge import open_socket
from messages.codec import Codec, DecodeError, encode
from messages.reward import (
    RouterError,
    ScoreReply,
    ScoreRequest,
    ToRouterFromClient,
    ToRouterFromWorker,
    WorkerBye,
    WorkerHeartbeat,
    WorkerHello,
)

MAX_PENDING = 4096  # requests waiting for a worker; past this the router stops reading clients
BATCH = 256  # messages taken from a socket per wake-up (then the other socket's turn)


@dataclass
class Worker:
    identity: bytes
    name: str
    pool: str
    capacity: int
    last_seen: float
    in_flight: set[int] = field(default_factory=set)  # router ids sent to this worker, unanswered
    done: int = 0
    failed: int = 0  # requests taken back from it (death, timeout)
    leaving: bool = False  # said bye: gets no new work
    latencies: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=512))


@dataclass
class InFlight:
    client: bytes
    client_request_id: int
    request: ScoreRequest  # re-keyed with the router id
    worker: bytes | None = None
    sent_at: float = 0.0
    failed_on: set[bytes] = field(default_factory=set)  # workers that died or timed out on it


@dataclass
class RouterState:
    """Routing decisions and bookkeeping, without I/O (tested on its own)."""

    workers: dict[bytes, Worker] = field(default_factory=dict)
    requests: dict[int, InFlight] = field(default_factory=dict)  # every unanswered request
    pending: collections.deque[int] = field(default_factory=collections.deque)  # ids without a worker
    ids: itertools.count = field(default_factory=itertools.count)
    answered: int = 0
    duplicates: int = 0  # replies for ids no longer in flight
    resent: int = 0
    departed: set[bytes] = field(default_factory=set)  # said bye and gone: heartbeats ignored

    def register(self, identity: bytes, name: str, pool: str, capacity: int, now: float,
                 hello: bool = False) -> None:
        """A hello or a heartbeat. A hello is a new incarnation: what the old one had in flight is
        re-sent and a bye it said is forgotten. A heartbeat from a worker that said bye keeps it
        leaving (or, once it is gone, does not bring it back)."""
        if hello:
            self.departed.discard(identity)
        elif identity in self.departed:
            return
        w = self.workers.get(identity)
        if w is None:
            self.workers[identity] = Worker(identity, name, pool, max(1, capacity), now)
            return
        w.last_seen, w.capacity, w.pool, w.name = now, max(1, capacity), pool, name
        if hello:
            w.leaving = False
            for rid in sorted(w.in_flight):  # the old process died with these
                self.take_back(rid)

    def leave(self, identity: bytes, now: float) -> bool:
        """A worker said bye: no new work; removed once its last request is answered.
        Returns True when the bye is acknowledged (known worker or not, it gets no more work)."""
        w = self.workers.get(identity)
        if w is not None:
            w.leaving, w.last_seen = True, now
        self.departed.add(identity)
        self._drop_if_done(identity)
        return True

    def _drop_if_done(self, identity: bytes) -> None:
        w = self.workers.get(identity)
        if w is not None and w.leaving and not w.in_flight:
            del self.workers[identity]

    def submit(self, client: bytes, request: ScoreRequest) -> int:
        rid = next(self.ids)
        keyed = ScoreRequest(request_id=rid, items=request.items, pool=request.pool)
        self.requests[rid] = InFlight(client, request.request_id, keyed)
        self.pending.append(rid)
        return rid

    def pick(self, pool: str, avoid: set[bytes] = frozenset()) -> Worker | None:
        """The live worker of ``pool`` with the fewest requests in flight and room for one more.

        Workers in ``avoid`` (those that already failed this request) are chosen only when no
        other worker of the pool has room.
        """
        best: Worker | None = None
        for w in self.workers.values():
            if w.pool != pool or w.leaving or len(w.in_flight) >= w.capacity:
                continue
            key = (w.identity in avoid, len(w.in_flight), w.done)
            if best is None or key < (best.identity in avoid, len(best.in_flight), best.done):
                best = w
        return best

    def assign(self, now: float) -> list[tuple[Worker, ScoreRequest]]:
        """Give pending requests to workers, in arrival order; returns what to send where."""
        out = []
        blocked: collections.deque[int] = collections.deque()
        while self.pending:
            rid = self.pending.popleft()
            entry = self.requests[rid]
            worker = self.pick(entry.request.pool, entry.failed_on)
            if worker is None:
                blocked.append(rid)
                continue
            worker.in_flight.add(rid)
            entry.worker, entry.sent_at = worker.identity, now
            out.append((worker, entry.request))
        self.pending = blocked
        return out

    def complete(self, worker_id: bytes, reply: ScoreReply, now: float) -> InFlight | None:
        """A worker answered; returns the client request to answer, or None for a duplicate."""
        entry = self.requests.get(reply.request_id)
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = now
        if entry is None or entry.worker != worker_id:
            self.duplicates += 1
            return None
        del self.requests[reply.request_id]
        if worker is not None:
            worker.in_flight.discard(reply.request_id)
            worker.done += 1
            worker.latencies.append(now - entry.sent_at)
            self._drop_if_done(worker_id)
        self.answered += 1
        return entry

    def take_back(self, rid: int) -> None:
        """Re-queue a request whose worker failed it; a late reply from that worker is a duplicate."""
        entry = self.requests[rid]
        if entry.worker is not None:
            entry.failed_on.add(entry.worker)
        if entry.worker is not None and entry.worker in self.workers:
            w = self.workers[entry.worker]
            w.in_flight.discard(rid)
            w.failed += 1
            self._drop_if_done(entry.worker)
        entry.worker = None
        self.pending.appendleft(rid)
        self.resent += 1

    def expire(self, now: float, worker_timeout: float, request_timeout: float) -> list[str]:
        """Remove silent workers and re-queue their work and any timed-out request."""
        gone = []
        for identity, w in list(self.workers.items()):
            if now - w.last_seen > worker_timeout:
                for rid in sorted(w.in_flight):
                    self.take_back(rid)
                self.workers.pop(identity, None)
                gone.append(w.name)
        for rid, entry in list(self.requests.items()):
            if entry.worker is not None and now - entry.sent_at > request_timeout:
                self.take_back(rid)
        return gone

    def statistics(self) -> dict[str, int | float | str]:
        stats: dict[str, int | float | str] = {
            "workers": len(self.workers), "in_flight": len(self.requests) - len(self.pending),
            "pending": len(self.pending), "answered": self.answered,
            "resent": self.resent, "duplicates": self.duplicates,
        }
        for w in self.workers.values():
            lat = sorted(w.latencies)
            p50 = lat[len(lat) // 2] if lat else 0.0
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
            stats[f"{w.name}"] = (f"{len(w.in_flight)}/{w.capacity} done={w.done} failed={w.failed} "
                                  f"p50={p50 * 1e3:.0f}ms p99={p99 * 1e3:.0f}ms"
                                  + (" leaving" if w.leaving else ""))
        if self.pending and not any(w.pool == "reward" and not w.leaving for w in self.workers.values()):
            stats["waiting"] = "no live reward worker"
        return stats


_NOBLOCK, _MORE, _POLLIN = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.POLLIN)


class RouterLoop:
    """The router's sockets served by a blocking loop in a thread of its own.

    Routing is pure message plumbing, and in the trio task each wake-up cost about twice the CPU
    of a blocking ``zmq.poll`` (measured in ``bench/bench_router.py``: re-arming epoll, cancel
    scopes, the ``AsyncSocket`` retry path). So the thread owns the sockets and the
    ``RouterState``; the actor's task only starts it, publishes its status and stops it. Every
    wake-up takes all ready messages of a socket (up to ``BATCH``) and sends what they produce
    before polling again; sends never wait (a ROUTER drops a message for a full or unknown peer,
    and a request so lost to a worker is re-sent on its timeout).
    """

    def __init__(self, state: RouterState, clients: zmq.Socket, workers: zmq.Socket,
                 stop: zmq.Socket, status: dict, *, tick: float, worker_timeout: float,
                 request_timeout: float) -> None:
        self.state, self.clients, self.workers, self.stop = state, clients, workers, stop
        self.status = status  # the actor's status; this thread only overwrites rejected_frames
        self.tick, self.worker_timeout, self.request_timeout = tick, worker_timeout, request_timeout
        self.client_codec: Codec[ToRouterFromClient] = Codec(ToRouterFromClient)
        self.worker_codec: Codec[ToRouterFromWorker] = Codec(ToRouterFromWorker)
        # refreshed every tick, read by the actor's task: (statistics, names of known workers)
        self.snapshot: tuple[dict[str, int | float | str], set[str]] = ({}, set())
        self.status["rejected_frames"] = 0

    def run(self) -> None:
        """Serve until a message arrives on the ``stop`` socket."""
        state = self.state
        next_tick = 0.0
        with_clients = [(self.workers, _POLLIN), (self.stop, _POLLIN), (self.clients, _POLLIN)]
        without_clients = with_clients[:2]  # bounded: past MAX_PENDING clients wait
        while True:
            now = time.monotonic()
            if now >= next_tick:
                state.expire(now, self.worker_timeout, self.request_timeout)
                self.send(self.workers, self.assigned(now))
                self.snapshot = (state.statistics(), {w.name for w in state.workers.values()})
                next_tick = now + self.tick
            items = with_clients if len(state.pending) < MAX_PENDING else without_clients
            ready = zmq.zmq_poll(items, max(1, int((next_tick - now) * 1000) + 1))
            to_workers: list[list[bytes]] = []
            to_clients: list[list[bytes]] = []
            for sock, _ in ready:
                if sock is self.stop:
                    return
                if sock is self.workers:
                    self.from_workers(to_workers, to_clients)
                else:
                    self.from_clients(to_clients)
            to_workers += self.assigned(time.monotonic())  # a leaving worker gets none: its ack stays last
            self.send(self.workers, to_workers)
            self.send(self.clients, to_clients)

    def from_clients(self, to_clients: list[list[bytes]]) -> None:
        limit = min(BATCH, MAX_PENDING - len(self.state.pending))
        for client, *frames in self.receive(self.clients, limit):
            try:
                request = self.client_codec.decode(frames[-1] if frames else b"")
            except DecodeError as exc:
                self.count_rejected()
                to_clients.append([client, encode(RouterError(error=f"router: {exc}"))])
                continue
            self.state.submit(client, request)

    def from_workers(self, to_workers: list[list[bytes]], to_clients: list[list[bytes]]) -> None:
        state = self.state
        now = time.monotonic()
        for identity, *frames in self.receive(self.workers, BATCH):
            try:
                msg = self.worker_codec.decode(frames[-1] if frames else b"")
            except DecodeError as exc:
                self.count_rejected()
                to_workers.append([identity, encode(RouterError(error=f"router: {exc}"))])
                continue
            match msg:
                case ScoreReply() as reply:
                    entry = state.complete(identity, reply, now)
                    if entry is not None:
                        answer = ScoreReply(request_id=entry.client_request_id, results=reply.results)
                        to_clients.append([entry.client, encode(answer)])
                case WorkerHeartbeat(name=name, pool=pool, capacity=cap):
                    state.register(identity, name, pool, cap, now)
                case WorkerHello(name=name, pool=pool, capacity=cap):
                    state.register(identity, name, pool, cap, now, hello=True)
                case WorkerBye(name=name):
                    state.leave(identity, now)
                    # the ack follows every request sent to it before (one pipe, in order): once
                    # the worker has it and has answered those, it can go
                    to_workers.append([identity, encode(WorkerBye(name=name))])

    def assigned(self, now: float) -> list[list[bytes]]:
        return [[worker.identity, encode(request)] for worker, request in self.state.assign(now)]

    def count_rejected(self) -> None:
        # an existing key: no resize while the actor's task copies the status
        self.status["rejected_frames"] = self.client_codec.rejected + self.worker_codec.rejected

    @staticmethod
    def receive(sock: zmq.Socket, limit: int) -> list[list[bytes]]:
        """Up to ``limit`` queued messages, without waiting."""
        out: list[list[bytes]] = []
        recv = sock.recv
        try:
            while len(out) < limit:
                frame = recv(_NOBLOCK, copy=False)  # a Frame knows ``more``: no getsockopt
                parts = [frame.bytes]
                while frame.more:
                    frame = recv(_NOBLOCK, copy=False)
                    parts.append(frame.bytes)
                out.append(parts)
        except zmq.Again:
            pass
        return out

    @staticmethod
    def send(sock: zmq.Socket, messages: list[list[bytes]]) -> None:
        send = sock.send
        for *head, last in messages:
            for frame in head:
                send(frame, _MORE)
            send(last, _NOBLOCK)


async def router_actor(ctx: ActorContext, *, task_status) -> None:
    cfg = ctx.topology.router
    tick = min(1.0, ctx.topology.run.heartbeat_interval)
    stop_address = f"inproc://router-stop-{id(ctx)}-{time.monotonic_ns()}"
    with contextlib.ExitStack() as stack:
        clients = stack.enter_context(open_socket(ctx.zmq, zmq.ROUTER, bind=cfg.address,
                                                       curve=ctx.curve))
        workers = stack.enter_context(open_socket(ctx.zmq, zmq.ROUTER, bind=cfg.worker_address,
                                                       curve=ctx.curve))
        stop_rx = stack.enter_context(open_socket(ctx.zmq, zmq.PAIR, bind=stop_address))
        stop_tx = stack.enter_context(open_socket(ctx.zmq, zmq.PAIR, connect=stop_address))
        loop = RouterLoop(RouterState(), clients, workers, stop_rx, ctx.status, tick=tick,
                          worker_timeout=max(5.0, 5 * ctx.topology.run.heartbeat_interval),
                          request_timeout=cfg.request_timeout)
        shown: set[str] = set()  # per-worker keys in the status: a worker that left is dropped

        async def publish_status() -> None:
            """Per-worker statistics sort latency histories: refreshed on a timer, not per message."""
            while True:
                stats, names = loop.snapshot
                for gone in shown - names:
                    ctx.status.pop(gone, None)
                shown.clear()
                shown.update(names)
                ctx.status.update(stats)
                await anyio.sleep(tick)

        async def serve() -> None:
            try:
                await anyio.to_thread.run_sync(loop.run)
            finally:
                tg.cancel_scope.cancel()  # the loop only returns when told to stop

        async def stop_on_cancel() -> None:
            try:
                await anyio.sleep_forever()
            finally:
                stop_tx.send(b"")  # wakes the loop's poll; it returns, and serve() with it

        task_status.started()
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_cancel)
            tg.start_soon(serve)
            tg.start_soon(publish_status)
