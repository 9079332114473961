"""Reward worker: scores completions with built-in rules and users' functions.

Connects a DEALER to the router's worker address, announces itself (``WorkerHello``), heartbeats,
and answers each routed ``ScoreRequest`` (one group: the prompt's fields once, its responses)
with a ``ScoreReply`` of one ``ScoreResult`` per response. ``actors.scoring.Scoring`` does the
work: rules on a worker thread, user code and math-verify in sandboxed child processes with a
timeout and limits, so heartbeats keep flowing and a scorer that hangs, crashes or raises gives
score 0.0 and a recorded error while the worker goes on serving; a reward model is loaded at
start and runs batched on a worker thread. Its counters are published in the actor's status
(``score_errors``, ``score_timeouts``, ``score_crashes``, ...).

A model pool's replica (``[[reward.pools]]``: reward processes numbered after the rule workers,
``actors/runtime/config/pools.py``) is the same worker serving the pool's name with
``actors.scoring.pool.PoolScoring``: the pool's model, batched across concurrent requests,
asleep while idle when the pool says so.

Stopping (Stop, SIGTERM, SIGINT, Ctrl-C of an attached worker) is a drain: the worker says bye,
answers what the router sent it before the router's acknowledgement, then exits.
"""

from __future__ import annotations

import anyio
import zmq

from actors.runtime.actor import ActorContext
from actors.runtime.config.pools import RULES_POOL, pool_replica
from actors.runtime.security import handshake_monitor, watch_handshake
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from actors.scoring.items import items_of
from actors.scoring.pool import PoolScoring
from actors.scoring.scorer import Scoring
from messages.codec import Codec, DecodeError, encode
from messages.control import Finished
from messages.reward import ScoreReply, ToRewardWorker
from messages.routing import Envelope, ToWorker, WorkerBye, WorkerHeartbeat, WorkerHello

BYE_ACK_WAIT_S = 1.0  # with nothing in flight, how long to wait for the router's ack of a bye
POOL = RULES_POOL


class RewardWorker:
    """Takes routed requests up to ``capacity`` at once and answers each when it is scored."""

    def __init__(self, ctx: ActorContext, sock: AsyncSocket, scoring: Scoring | PoolScoring,
                 pool: str = POOL, capacity: int = 0) -> None:
        self.ctx, self.sock, self.scoring = ctx, sock, scoring
        self.cfg = ctx.topology.reward
        self.pool = pool  # the router's pool it serves
        self.capacity = capacity or self.cfg.capacity
        self.codec: Codec[ToWorker] = Codec(ToWorker)
        self.body_codec: Codec[ToRewardWorker] = Codec(ToRewardWorker)
        self.slots = anyio.Semaphore(self.capacity)
        self.done = 0  # requests answered
        self.in_flight = 0  # requests taken and not yet answered
        self.idle = anyio.Event()  # set while nothing is in flight
        self.idle.set()
        self.acked = anyio.Event()  # the router acknowledged our bye: all it sent us is here

    def publish(self) -> None:
        s = self.scoring.statistics()
        self.ctx.status.update(requests_done=self.done, items_scored=s.items,
                               score_errors=s.errors, score_timeouts=s.timeouts,
                               score_crashes=s.crashes, score_children=s.children,
                               score_children_started=s.children_started,
                               requests_in_flight=self.in_flight)
        if isinstance(self.scoring, PoolScoring):
            self.ctx.status.update(self.scoring.status())

    async def handle(self, envelope: Envelope, body: bytes) -> None:
        self.in_flight += 1
        self.idle = anyio.Event()
        try:
            try:
                request = self.body_codec.decode(body)
            except DecodeError as exc:  # answered with no results: the client fails the request
                self.ctx.status["rejected_bodies"] = self.body_codec.rejected
                self.ctx.status["body_error"] = str(exc)[:200]
                results = []
            else:
                results = await self.scoring.score(items_of(request), request.max_response_length)
                self.done += 1
                self.publish()
            await self.sock.send_multipart([encode(Envelope(envelope.request_id)),
                                            encode(ScoreReply(results))])
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
                    self.codec.rejected += 1  # counted with the frames that did not decode
                    self.ctx.status["rejected_frames"] = self.codec.rejected

    async def drain(self) -> None:
        """Say bye, answer what was sent before the router's ack (bounded), then return."""
        await self.sock.send_multipart([encode(WorkerBye(name=self.ctx.name))])
        self.ctx.status["state"] = "leaving"
        bound = self.cfg.timeout_s + 5.0
        with anyio.move_on_after(bound):
            with anyio.move_on_after(BYE_ACK_WAIT_S if self.in_flight == 0 else bound):
                await self.acked.wait()  # no ack (router gone): what is in flight still answers
            while self.in_flight:
                await self.idle.wait()


async def reward_actor(ctx: ActorContext, *, task_status) -> None:
    cfg = ctx.topology.reward
    address = ctx.topology.router.worker_address
    sock = make_socket(ctx.zmq, zmq.DEALER, identity=ctx.name.encode(), curve=ctx.curve)
    monitor = handshake_monitor(sock) if ctx.curve is not None else None
    sock.socket.connect(address)
    replica = pool_replica(cfg, ctx.index)  # None: a rule worker (attached: -1, or --pool)
    scoring: Scoring | PoolScoring
    if replica is None:
        scoring, pool, capacity = Scoring(cfg, threads=cfg.threads), POOL, cfg.capacity
    else:
        model_pool, _ = replica
        scoring = PoolScoring(model_pool, ctx.topology, label=f"{ctx.name} {ctx.run_dir}")
        pool, capacity = model_pool.name, model_pool.capacity
        ctx.status.update(scoring.status())
    await scoring.load()
    worker = RewardWorker(ctx, sock, scoring, pool, capacity)
    stopping = anyio.Event()  # cancelled from outside (Stop, SIGTERM, SIGINT): drain, then go

    async def watch_cancel() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stopping.set()

    await sock.send_multipart([encode(WorkerHello(name=ctx.name, pool=pool,
                                                  capacity=capacity))])
    task_status.started()
    try:
        with sock:
            async with anyio.create_task_group() as outer:
                outer.start_soon(watch_cancel)  # the only task the outside cancellation reaches
                with anyio.CancelScope(shield=True):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(worker.heartbeats)
                        if isinstance(scoring, PoolScoring):
                            tg.start_soon(scoring.keep_sleeping)
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
            await scoring.aclose()  # children are killed and reaped, whatever ended the worker
        if ctx.control is None or ctx.status.get("attached"):  # by hand, or in a test
            print(f"=== {ctx.name} detached: {worker.done} requests done", flush=True)
