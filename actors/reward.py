"""Reward worker: scores completions with built-in rules and users' functions.

Connects a DEALER to the router's worker address, announces itself (``WorkerHello``), heartbeats,
and answers each ``ScoreRequest`` with one ``ScoreResult`` per item. ``actors.scoring.Scoring``
does the work: rules on a worker thread, user code and math-verify in child processes with a
timeout and limits, so heartbeats keep flowing and a scorer that hangs, crashes or raises gives
score 0.0 and a recorded error while the worker goes on serving; a reward model is loaded at start
and runs batched on a worker thread. Its counters are published in
the actor's status (``score_errors``, ``score_timeouts``, ``score_crashes``, ...).
"""

from __future__ import annotations

import anyio
import zmq

from actors.runtime.actor import ActorContext
from actors.runtime.security import handshake_monitor, watch_handshake
from actors.runtime.zmq_bridge import make_socket
from actors.scoring.scorer import Scoring
from messages.codec import Codec, DecodeError, encode
from messages.reward import (
    RouterError,
    ScoreReply,
    ScoreRequest,
    ToWorker,
    WorkerBye,
    WorkerHeartbeat,
    WorkerHello,
)

BYE_ACK_WAIT_S = 1.0  # with nothing in flight, how long to wait for the router's ack of a bye


async def reward_actor(ctx: ActorContext, *, task_status) -> None:
    cfg = ctx.topology.reward
    address = ctx.topology.router.worker_address
    sock = make_socket(ctx.zmq, zmq.DEALER, identity=ctx.name.encode(), curve=ctx.curve)
    monitor = handshake_monitor(sock) if ctx.curve is not None else None
    sock.socket.connect(address)
    codec: Codec[ToWorker] = Codec(ToWorker)
    hello = WorkerHello(name=ctx.name, pool="reward", capacity=cfg.capacity)
    scoring = Scoring(cfg, max_response_length=ctx.topology.sampler.max_tokens, threads=cfg.threads)
    await scoring.load()
    done = 0
    in_flight = 0
    slots = anyio.Semaphore(cfg.capacity)
    stopping = anyio.Event()  # cancelled from outside (Stop, SIGTERM, SIGINT): drain, then go
    acked = anyio.Event()  # the router acknowledged our bye: every request it sent us is here
    idle = anyio.Event()  # nothing in flight

    def publish() -> None:
        s = scoring.statistics()
        ctx.status.update(requests_done=done, items_scored=s.items, score_errors=s.errors,
                          score_timeouts=s.timeouts, score_crashes=s.crashes,
                          score_children=s.children, score_children_started=s.children_started,
                          requests_in_flight=in_flight)

    async def handle(request: ScoreRequest) -> None:
        nonlocal done, in_flight, idle
        in_flight += 1
        idle = anyio.Event()
        try:
            results = await scoring.score(request.items)
            done += 1
            publish()
            await sock.send_multipart([encode(ScoreReply(request.request_id, results))])
        finally:
            in_flight -= 1
            if in_flight == 0:
                idle.set()
            slots.release()

    async def heartbeats() -> None:
        while True:
            await sock.send_multipart([encode(WorkerHeartbeat(ctx.name, hello.pool, cfg.capacity))])
            publish()
            await anyio.sleep(min(1.0, ctx.topology.run.heartbeat_interval))

    async def receive(tg: anyio.abc.TaskGroup) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                msg = codec.decode(frames[-1])
            except DecodeError:
                ctx.status["rejected_frames"] = codec.rejected
                continue
            if isinstance(msg, WorkerBye):
                acked.set()
                continue
            if isinstance(msg, RouterError):
                continue
            await slots.acquire()
            tg.start_soon(handle, msg)

    async def drain() -> None:
        """Say bye, answer what was sent before the router's ack (bounded), then return."""
        await sock.send_multipart([encode(WorkerBye(name=ctx.name))])
        ctx.status["state"] = "leaving"
        with anyio.move_on_after(cfg.timeout_s + 5.0):
            with anyio.move_on_after(BYE_ACK_WAIT_S if in_flight == 0 else cfg.timeout_s + 5.0):
                await acked.wait()  # no ack (router gone): whatever is in flight is still answered
            while in_flight:
                await idle.wait()

    async def watch_cancel() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stopping.set()

    await sock.send_multipart([encode(hello)])
    idle.set()
    task_status.started()
    try:
        with sock:
            async with anyio.create_task_group() as outer:
                outer.start_soon(watch_cancel)  # the only task the outside cancellation reaches
                with anyio.CancelScope(shield=True):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(heartbeats)
                        if monitor is not None:  # a refused key fails the worker, loudly
                            assert ctx.curve is not None
                            tg.start_soon(watch_handshake, monitor, address, ctx.curve.public)
                        tg.start_soon(receive, tg)
                        await stopping.wait()
                        await drain()
                        tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await scoring.aclose()  # children are killed and reaped, whatever ended the worker
        if ctx.control is None:  # attached by hand (or in a test): say what it did
            print(f"=== {ctx.name} detached: {done} requests done", flush=True)
