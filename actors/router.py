"""The router: one front door for a pool of workers, least in-flight first.

Clients (samplers) send ``ScoreRequest`` to the client ROUTER; workers connect to the worker
ROUTER, say ``WorkerHello`` (or just heartbeat) and get requests. The router re-keys each
request with its own id, so a reply maps back to exactly one client request; a reply whose id
is no longer in flight (a late duplicate after a re-send) is discarded and counted. A request
whose worker stops heartbeating or exceeds ``request_timeout`` is re-sent to another live worker.
While no worker can take it, a request waits in a bounded queue.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field

import anyio
import zmq

from actors.runtime.actor import ActorContext
from actors.runtime.zmq_bridge import make_socket
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
BATCH = 256  # messages taken from a socket per wake-up


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
            stats[f"{w.name}"] = (f"{len(w.in_flight)}/{w.capacity} done={w.done} p50={p50 * 1e3:.0f}ms"
                                  + (" leaving" if w.leaving else ""))
        if self.pending and not any(w.pool == "reward" and not w.leaving for w in self.workers.values()):
            stats["waiting"] = "no live reward worker"
        return stats


async def router_actor(ctx: ActorContext, *, task_status) -> None:
    cfg = ctx.topology.router
    state = RouterState()
    clients = make_socket(ctx.zmq, zmq.ROUTER, bind=cfg.address)
    workers = make_socket(ctx.zmq, zmq.ROUTER, bind=cfg.worker_address)
    client_codec: Codec[ToRouterFromClient] = Codec(ToRouterFromClient)
    worker_codec: Codec[ToRouterFromWorker] = Codec(ToRouterFromWorker)
    worker_timeout = max(5.0, 5 * ctx.topology.run.heartbeat_interval)
    room = anyio.Event()

    shown: set[str] = set()  # per-worker keys in the status: a worker that left is dropped

    def assigned(now: float) -> list[list[bytes]]:
        return [[worker.identity, encode(request)] for worker, request in state.assign(now)]

    async def dispatch() -> None:
        if out := assigned(time.monotonic()):
            await workers.send_multipart_batch(out)

    def count_rejected() -> None:
        ctx.status["rejected_frames"] = client_codec.rejected + worker_codec.rejected

    def publish_status() -> None:
        """Per-worker statistics sort latency histories: refreshed on a timer, not per message."""
        stats = state.statistics()
        names = {w.name for w in state.workers.values()}
        for gone in shown - names:
            ctx.status.pop(gone, None)
        shown.clear()
        shown.update(names)
        ctx.status.update(stats)
        count_rejected()

    # Both loops handle every message that is ready per wake-up and send what it produced in one
    # batch per socket: under load the scheduler and the readiness checks are paid per batch.
    # Requests are sent in the same step that assigns them (no checkpoint in between; a worker
    # ROUTER never blocks a send), so every request assigned to a worker goes out before that
    # worker's bye acknowledgement.

    async def from_clients() -> None:
        nonlocal room
        while True:
            while len(state.pending) >= MAX_PENDING:  # bounded: stop reading, clients wait
                await room.wait()
                room = anyio.Event()
            batch = await clients.recv_multipart_batch(min(BATCH, MAX_PENDING - len(state.pending)))
            errors = []
            for client, *frames in batch:
                try:
                    request = client_codec.decode(frames[-1] if frames else b"")
                except DecodeError as exc:
                    errors.append([client, encode(RouterError(error=f"router: {exc}"))])
                    continue
                state.submit(client, request)
            if errors:
                count_rejected()
                await clients.send_multipart_batch(errors)
            await dispatch()

    async def from_workers() -> None:
        while True:
            batch = await workers.recv_multipart_batch(BATCH)
            now = time.monotonic()
            to_workers: list[list[bytes]] = []
            to_clients: list[list[bytes]] = []
            rejected = False
            for identity, *frames in batch:
                try:
                    msg = worker_codec.decode(frames[-1] if frames else b"")
                except DecodeError as exc:
                    rejected = True
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
            if rejected:
                count_rejected()
            to_workers += assigned(now)  # a leaving worker gets none: its ack stays last
            if to_workers:
                await workers.send_multipart_batch(to_workers)
            if to_clients:
                await clients.send_multipart_batch(to_clients)
                room.set()

    async def watchdog() -> None:
        while True:
            publish_status()
            await anyio.sleep(min(1.0, ctx.topology.run.heartbeat_interval))
            state.expire(time.monotonic(), worker_timeout, cfg.request_timeout)
            await dispatch()

    task_status.started()
    with clients, workers:
        async with anyio.create_task_group() as tg:
            tg.start_soon(from_clients)
            tg.start_soon(from_workers)
            tg.start_soon(watchdog)
