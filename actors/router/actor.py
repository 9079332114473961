"""The router: one front door for pools of workers, least in-flight first.

Clients (samplers) send routed requests (an ``Envelope`` naming the pool, then an opaque body)
to the client ROUTER; workers connect to the worker ROUTER, say ``WorkerHello`` (or just
heartbeat) with the pool they serve, and get requests. The router reads envelopes only: it
re-keys each request with its own id, so a reply maps back to exactly one client request, and
forwards bodies as they came. A reply whose id is no longer in flight (a late duplicate after a
re-send) is discarded and counted. A request whose worker stops heartbeating or exceeds
``request_timeout`` is re-sent to another live worker of its pool. While no worker can take it,
a request waits in a bounded queue.

``RouterState`` holds the decisions and the bookkeeping, without I/O. ``RouterLoop`` serves both
sockets from a blocking ``zmq.poll`` loop in a thread of its own; ``router_actor`` starts that
thread, publishes its status and stops it when cancelled.
"""

from __future__ import annotations

import contextlib
import time

import anyio
import anyio.to_thread
import zmq

from actors.router.state import RouterState, RouterStatistics
from actors.runtime.actor import ActorContext
from actors.runtime.zmq_bridge import endpoint, open_socket
from messages.codec import Codec, DecodeError, encode
from messages.routing import (
    Envelope,
    RouterError,
    ToRouterFromClient,
    ToRouterFromWorker,
    WorkerBye,
    WorkerHeartbeat,
    WorkerHello,
)

MAX_PENDING = 4096  # requests waiting for a worker; past this the router stops reading clients
BATCH = 256  # messages taken from a socket per wake-up (then the other socket's turn)

_NOBLOCK, _MORE, _POLLIN = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.POLLIN)


class RouterLoop:
    """The router's sockets served by a blocking loop in a thread of its own.

    Routing is pure message plumbing, and in the trio task each wake-up pays for more than a
    blocking ``zmq.poll`` does (re-arming epoll, cancel scopes, the ``AsyncSocket`` retry path;
    ``bench/bench_router.py`` compares the two). So the thread owns the sockets and the
    ``RouterState``; the actor's task only starts it, publishes its status and stops it. Every
    wake-up takes all ready messages of a socket (up to ``BATCH``) and sends what they produce
    before polling again; sends never wait (a ROUTER drops a message for a full or unknown peer,
    and a request so lost to a worker is re-sent on its timeout).
    """

    def __init__(self, state: RouterState, clients: zmq.Socket, workers: zmq.Socket,
                 stop: zmq.Socket, status: dict, *, tick: float, worker_timeout: float,
                 request_timeout: float, name: str = "router") -> None:
        self.state, self.clients, self.workers, self.stop = state, clients, workers, stop
        self.status = status  # the actor's status; this thread only overwrites rejected_frames
        self.tick, self.worker_timeout, self.request_timeout = tick, worker_timeout, request_timeout
        self.client_codec: Codec[ToRouterFromClient] = Codec(
            ToRouterFromClient, socket=f"[{name}] clients ROUTER {endpoint(clients)}")
        self.worker_codec: Codec[ToRouterFromWorker] = Codec(
            ToRouterFromWorker, socket=f"[{name}] workers ROUTER {endpoint(workers)}")
        # refreshed every tick, read by the actor's task
        self.snapshot: RouterStatistics = state.statistics()
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
                self.send(self.clients, self.given_up())
                self.snapshot = state.statistics()
                next_tick = now + self.tick
            items = with_clients if len(state.pending) < MAX_PENDING else without_clients
            ready = zmq.zmq_poll(items, max(1, int((next_tick - now) * 1000) + 1))
            to_workers: list[list[bytes]] = []
            to_clients: list[list[bytes]] = []
            for sock, _ in ready:
                if sock is self.stop:  # the counters as they stand, for the last report
                    self.snapshot = state.statistics()
                    return
                if sock is self.workers:
                    self.from_workers(to_workers, to_clients)
                else:
                    self.from_clients(to_clients)
            to_workers += self.assigned(time.monotonic())  # a leaving worker gets none: its ack stays last
            self.send(self.workers, to_workers)
            self.send(self.clients, to_clients + self.given_up())

    def from_clients(self, to_clients: list[list[bytes]]) -> None:
        limit = min(BATCH, MAX_PENDING - len(self.state.pending))
        for client, *frames in self.receive(self.clients, limit):
            try:
                envelope = self.client_codec.decode(frames[0] if frames else b"")
                if len(frames) != 2:  # decoded, but not a whole request
                    raise self.client_codec.refuse(
                        f"a request is an envelope and a body, got {len(frames)} frames",
                        "frame count")
            except DecodeError as exc:
                self.count_rejected()
                to_clients.append([client, encode(RouterError(error=f"router: {exc}"))])
                continue
            self.state.submit(client, envelope, frames[1])

    def from_workers(self, to_workers: list[list[bytes]], to_clients: list[list[bytes]]) -> None:
        state = self.state
        now = time.monotonic()
        for identity, *frames in self.receive(self.workers, BATCH):
            try:
                msg = self.worker_codec.decode(frames[0] if frames else b"")
                if len(frames) != (2 if isinstance(msg, Envelope) else 1):  # not whole
                    raise self.worker_codec.refuse(f"{type(msg).__name__} with {len(frames)} "
                                                   "frames", "frame count")
            except DecodeError as exc:
                self.count_rejected()
                to_workers.append([identity, encode(RouterError(error=f"router: {exc}"))])
                continue
            match msg:
                case Envelope(request_id=rid):
                    entry = state.complete(identity, rid, now)
                    if entry is not None:  # the body goes back as it came
                        to_clients.append([entry.client,
                                           encode(Envelope(entry.client_request_id)), frames[1]])
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
        return [[worker.identity, encode(Envelope(rid, entry.pool)), entry.body]
                for worker, rid, entry in self.state.assign(now)]

    def given_up(self) -> list[list[bytes]]:
        """Errors for the requests the state gave up on, to their clients."""
        out = [[e.client, encode(RouterError(
            error=f"router: gave up after {e.failures} workers failed this request",
            request_id=e.client_request_id))] for e in self.state.given_up]
        self.state.given_up.clear()
        return out

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
                          request_timeout=cfg.request_timeout, name=ctx.name)
        shown: set[str] = set()  # status keys of the last snapshot: a worker that left is dropped

        def publish() -> None:
            stats = loop.snapshot.status()
            for gone in shown - set(stats):
                ctx.status.pop(gone, None)
            shown.clear()
            shown.update(stats)
            ctx.status.update(stats)

        async def publish_status() -> None:
            """Per-worker statistics sort latency histories: refreshed on a timer, not per message."""
            while True:
                publish()
                await anyio.sleep(tick)

        async def serve() -> None:
            try:
                await anyio.to_thread.run_sync(loop.run)
            finally:
                publish()  # the snapshot the loop took as it stopped: the last report's counts
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
