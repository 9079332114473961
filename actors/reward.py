"""Reward worker: scores completions with built-in rules and users' functions.

Connects a DEALER to the router's worker address, announces itself (``WorkerHello``), heartbeats,
and answers each ``ScoreRequest`` with one ``ScoreResult`` per item. ``actors.scoring.Scoring``
does the work: rules on a worker thread, user code and math-verify in child processes with a
timeout and limits, so heartbeats keep flowing and a scorer that hangs, crashes or raises gives
score 0.0 and a recorded error while the worker goes on serving. Its counters are published in
the actor's status (``score_errors``, ``score_timeouts``, ``score_crashes``, ...).
"""

from __future__ import annotations

import anyio
import zmq

from actors.runtime.actor import ActorContext
from actors.runtime.zmq_bridge import make_socket
from actors.scoring.scorer import Scoring
from messages.codec import Codec, DecodeError, encode
from messages.reward import (
    RouterError,
    ScoreReply,
    ScoreRequest,
    ToWorker,
    WorkerHeartbeat,
    WorkerHello,
)


async def reward_actor(ctx: ActorContext, *, task_status) -> None:
    cfg = ctx.topology.reward
    sock = make_socket(ctx.zmq, zmq.DEALER, connect=ctx.topology.router.worker_address,
                       identity=ctx.name.encode())
    codec: Codec[ToWorker] = Codec(ToWorker)
    hello = WorkerHello(name=ctx.name, pool="reward", capacity=cfg.capacity)
    scoring = Scoring(cfg, max_response_length=ctx.topology.sampler.max_tokens)
    done = 0
    slots = anyio.Semaphore(cfg.capacity)

    def publish() -> None:
        s = scoring.statistics()
        ctx.status.update(requests_done=done, items_scored=s.items, score_errors=s.errors,
                          score_timeouts=s.timeouts, score_crashes=s.crashes,
                          score_children=s.children, score_children_started=s.children_started)

    async def handle(request: ScoreRequest) -> None:
        nonlocal done
        try:
            results = await scoring.score(request.items)
            done += 1
            publish()
            await sock.send_multipart([encode(ScoreReply(request.request_id, results))])
        finally:
            slots.release()

    async def heartbeats() -> None:
        while True:
            await sock.send_multipart([encode(WorkerHeartbeat(ctx.name, hello.pool, cfg.capacity))])
            publish()
            await anyio.sleep(min(1.0, ctx.topology.run.heartbeat_interval))

    await sock.send_multipart([encode(hello)])
    task_status.started()
    try:
        with sock:
            async with anyio.create_task_group() as tg:
                tg.start_soon(heartbeats)
                while True:
                    frames = await sock.recv_multipart()
                    try:
                        msg = codec.decode(frames[-1])
                    except DecodeError:
                        ctx.status["rejected_frames"] = codec.rejected
                        continue
                    if isinstance(msg, RouterError):
                        continue
                    await slots.acquire()
                    tg.start_soon(handle, msg)
    finally:
        await scoring.aclose()  # children are killed and reaped, whatever ended the worker
