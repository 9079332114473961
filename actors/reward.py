"""Reward worker: scores completions with the built-in task scorers.

Connects a DEALER to the router's worker address, announces itself (``WorkerHello``), heartbeats,
and answers each ``ScoreRequest`` with one ``ScoreResult`` per item. Scoring runs in a worker
thread so heartbeats keep flowing; a scorer that raises gives score 0.0 and a recorded error.
"""

from __future__ import annotations

import anyio
import zmq

from actors.runtime.actor import ActorContext
from actors.runtime.zmq_bridge import make_socket
from actors.tasks import SCORERS
from messages.codec import Codec, DecodeError, encode
from messages.reward import (
    RouterError,
    ScoreItem,
    ScoreReply,
    ScoreRequest,
    ScoreResult,
    ToWorker,
    WorkerHeartbeat,
    WorkerHello,
)


def score_items(items: list[ScoreItem]) -> list[ScoreResult]:
    """Score each item with its data source's scorer; failures become 0.0 plus the error."""
    results = []
    for item in items:
        scorer = SCORERS.get(item.data_source)
        if scorer is None:
            results.append(ScoreResult(0.0, error=f"no scorer for data_source {item.data_source!r}"))
            continue
        try:
            value = scorer(item.data_source, item.solution_str, item.ground_truth,
                           dict(item.extra_info))
            results.append(ScoreResult(float(value)))
        except Exception as exc:  # user-visible: recorded with the sample, job goes on
            results.append(ScoreResult(0.0, error=f"{type(exc).__name__}: {exc}"))
    return results


async def reward_actor(ctx: ActorContext, *, task_status) -> None:
    cfg = ctx.topology.reward
    sock = make_socket(ctx.zmq, zmq.DEALER, connect=ctx.topology.router.worker_address,
                       identity=ctx.name.encode())
    codec: Codec[ToWorker] = Codec(ToWorker)
    hello = WorkerHello(name=ctx.name, pool="reward", capacity=cfg.capacity)
    done = failed = 0
    slots = anyio.Semaphore(cfg.capacity)

    async def handle(request: ScoreRequest) -> None:
        nonlocal done, failed
        try:
            results = await anyio.to_thread.run_sync(score_items, request.items)
            failed += sum(1 for r in results if r.error)
            done += 1
            await sock.send_multipart([encode(ScoreReply(request.request_id, results))])
        finally:
            slots.release()

    async def heartbeats() -> None:
        while True:
            await sock.send_multipart([encode(WorkerHeartbeat(ctx.name, hello.pool, cfg.capacity))])
            ctx.status.update(requests_done=done, score_errors=failed)
            await anyio.sleep(min(1.0, ctx.topology.run.heartbeat_interval))

    await sock.send_multipart([encode(hello)])
    task_status.started()
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
