"""A worker of one of the router's pools: the protocol every pool worker speaks, whatever it serves.

A worker connects a DEALER to the router's worker address, says ``WorkerHello`` (its name, its
pool and how many requests it takes at once), heartbeats, and answers each routed request (an
``Envelope`` and an opaque body) with the same envelope and its reply body. Up to ``capacity``
requests are handled at once, each in a task of its own, so heartbeats keep flowing while they
compute. Stopping (Stop, SIGTERM, SIGINT, Ctrl-C of an attached worker) is a drain: the worker
says bye, answers what the router sent it before the router's acknowledgement (bounded by
``drain_s``), then exits; with no acknowledgement within ``BYE_ACK_WAIT_S`` of its last answer
(a router that stopped with the job) it exits then.

A pool kind is a subclass that says what a request body is worth (``reply``), what it shows in
its status (``publish``) and what it runs beside the protocol (``background``): the reward
workers and model pools (``actors/reward.py``) and the teacher (``actors/teacher/worker.py``).
"""

from __future__ import annotations

import anyio
import anyio.abc
import zmq

from actors.runtime.actor import ActorContext
from actors.runtime.security import handshake_monitor, handshake_refused, watch_handshake
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from messages.codec import Codec, DecodeError, encode
from messages.control import Finished
from messages.routing import Envelope, ToWorker, WorkerBye, WorkerHeartbeat, WorkerHello

BYE_ACK_WAIT_S = 1.0  # with nothing in flight, how long to wait for the router's ack of a bye


class PoolWorker:
    """Takes routed requests up to ``capacity`` at once and answers each when ``reply`` returns."""

    def __init__(self, ctx: ActorContext, sock: AsyncSocket, pool: str, capacity: int,
                 drain_s: float) -> None:
        self.ctx, self.sock, self.pool = ctx, sock, pool
        self.capacity = max(1, capacity)
        self.drain_s = drain_s  # most time a stopping worker spends answering what it holds
        self.codec: Codec[ToWorker] = Codec(ToWorker, socket=f"[{ctx.name}] DEALER to the router")
        self.slots = anyio.Semaphore(self.capacity)
        self.done = 0  # requests answered
        self.in_flight = 0  # requests taken and not yet answered
        self.idle = anyio.Event()  # set while nothing is in flight
        self.idle.set()
        self.acked = anyio.Event()  # the router acknowledged our bye: all it sent us is here

    async def reply(self, body: bytes) -> bytes:
        """The encoded reply to one request body (a bad body gets a reply saying so, never an
        exception: the worker goes on serving)."""
        raise NotImplementedError

    def publish(self) -> None:
        """Refresh the worker's counters in its status."""

    async def background(self) -> None:
        """What runs beside the protocol for as long as the worker serves (sleep while idle)."""

    async def aclose(self) -> None:
        """Release what the worker holds (child processes), whatever ended it."""

    async def handle(self, envelope: Envelope, body: bytes) -> None:
        if self.in_flight == 0:  # one event per busy spell: a drain waiting on it sees its end
            self.idle = anyio.Event()
        self.in_flight += 1
        try:
            answer = await self.reply(body)
            self.publish()
            await self.sock.send_multipart([encode(Envelope(envelope.request_id)), answer])
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()
            self.slots.release()

    async def heartbeats(self) -> None:
        while True:
            await self.sock.send_multipart(
                [encode(WorkerHeartbeat(self.ctx.name, self.pool, self.capacity))])
            self.publish()
            await anyio.sleep(min(1.0, self.ctx.topology.run.heartbeat_interval))

    async def receive(self, tg: anyio.abc.TaskGroup) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg = self.codec.decode(frames[0])
            except DecodeError:
                self.ctx.status["rejected_frames"] = self.codec.rejected
                continue
            match msg:
                case WorkerBye():
                    self.acked.set()
                case Envelope() if len(frames) == 2:
                    await self.slots.acquire()
                    tg.start_soon(self.handle, msg, frames[1])
                case _:  # a RouterError, or an envelope without its body
                    self.codec.refuse(f"{type(msg).__name__} with {len(frames)} frames",
                                      "not a request")  # counted with those that did not decode
                    self.ctx.status["rejected_frames"] = self.codec.rejected

    async def drain(self) -> None:
        """Say bye, answer what was sent before the router's ack (bounded), then return."""
        await self.sock.send_multipart([encode(WorkerBye(name=self.ctx.name))])
        self.ctx.status["state"] = "leaving"
        with anyio.move_on_after(self.drain_s):
            while True:
                while self.in_flight:
                    await self.idle.wait()
                # the router acks after all it sent before our bye: an ack with nothing in
                # flight means nothing more comes; no ack within BYE_ACK_WAIT_S of the last
                # answer means a router that is gone (it stops with the job), not one to wait for
                with anyio.move_on_after(BYE_ACK_WAIT_S):
                    await self.acked.wait()
                if not self.in_flight:
                    return


def worker_socket(ctx: ActorContext) -> tuple[AsyncSocket, AsyncSocket | None]:
    """A DEALER named after the actor, connected to the router's worker address, and with CURVE
    the monitor of its handshake (opened before the connection, so no event is missed)."""
    sock = make_socket(ctx.zmq, zmq.DEALER, identity=ctx.name.encode(), curve=ctx.curve)
    monitor = handshake_monitor(sock) if ctx.curve is not None else None
    sock.socket.connect(ctx.topology.router.worker_address)
    return sock, monitor


async def serve(ctx: ActorContext, worker: PoolWorker, monitor: AsyncSocket | None, *,
                task_status) -> None:
    """Say hello, serve until cancelled from outside, then drain and go (an attached worker tells
    its runner it finished, so the runner drops its row)."""
    address = ctx.topology.router.worker_address
    stopping = anyio.Event()  # cancelled from outside (Stop, SIGTERM, SIGINT): drain, then go

    async def watch_cancel() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stopping.set()

    hello = [encode(WorkerHello(name=ctx.name, pool=worker.pool, capacity=worker.capacity))]
    if monitor is None:
        await worker.sock.send_multipart(hello)
    else:  # a refused key leaves the socket no peer to queue the hello for: watched meanwhile
        assert ctx.curve is not None
        async with anyio.create_task_group() as first:
            first.start_soon(handshake_refused, monitor, address, ctx.curve.public)
            await worker.sock.send_multipart(hello)
            first.cancel_scope.cancel()
    task_status.started()
    try:
        with worker.sock:
            async with anyio.create_task_group() as outer:
                outer.start_soon(watch_cancel)  # the only task the outside cancellation reaches
                with anyio.CancelScope(shield=True):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(worker.heartbeats)
                        tg.start_soon(worker.background)
                        if monitor is not None:  # a refused key fails the worker, loudly
                            assert ctx.curve is not None
                            tg.start_soon(watch_handshake, monitor, address, ctx.curve.public)
                        tg.start_soon(worker.receive, tg)
                        await stopping.wait()
                        await worker.drain()
                        if ctx.status.get("attached"):  # its runner drops its row now
                            await ctx.report(Finished(actor=ctx.name, status=dict(ctx.status),
                                                      detail=f"detached: {worker.done} requests done"))
                        tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await worker.aclose()  # children are killed and reaped, whatever ended the worker
        if ctx.control is None or ctx.status.get("attached"):  # by hand, or in a test
            print(f"=== {ctx.name} detached: {worker.done} requests done", flush=True)
