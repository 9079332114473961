"""Reward worker: scores completions with built-in rules and users' functions, or serves a model.

Connects a DEALER to the router's worker address, announces itself (``WorkerHello``), heartbeats,
and answers each routed ``ScoreRequest`` (one group: the prompt's fields once, its responses)
with a ``ScoreReply`` of one ``ScoreResult`` per response. ``actors.scoring.Scoring`` does the
work: rules on a worker thread, user code and math-verify in sandboxed child processes with a
timeout and limits, so heartbeats keep flowing and a scorer that hangs, crashes or raises gives
score 0.0 and a recorded error while the worker goes on serving. Its counters are published in
the actor's status (``score_errors``, ``score_timeouts``, ``score_crashes``, ...).

A served model's replica (``[[reward.models]]``: reward processes numbered after the rule
workers, ``actors/runtime/config/pools.py``) is the same worker serving the model's pool with
``actors.scoring.served.ServedScoring``: the entry's model (a reward model or a judge), batched
across concurrent requests, asleep while idle when the entry says so.

The protocol (hello, heartbeats, up to ``capacity`` requests at once, the drain on stopping) is
every pool worker's: ``actors/router/worker.py``.
"""

from __future__ import annotations

from actors.router.worker import PoolWorker, serve, worker_socket
from actors.runtime.actor import ActorContext
from actors.runtime.config import RULES_POOL, model_replica
from actors.runtime.zmq_bridge import AsyncSocket
from actors.scoring.items import items_of
from actors.scoring.scorer import Scoring, job_rules
from actors.scoring.served import ServedScoring
from messages.codec import Codec, DecodeError, encode
from messages.reward import ScoreReply, ToRewardWorker

POOL = RULES_POOL


class RewardWorker(PoolWorker):
    """Answers each routed ``ScoreRequest`` with a ``ScoreReply`` from its ``Scoring``."""

    def __init__(self, ctx: ActorContext, sock: AsyncSocket, scoring: Scoring | ServedScoring,
                 pool: str = POOL, capacity: int = 0) -> None:
        cfg = ctx.topology.reward
        super().__init__(ctx, sock, pool, capacity or cfg.capacity, drain_s=cfg.timeout_s + 5.0)
        self.scoring = scoring
        self.body_codec: Codec[ToRewardWorker] = Codec(
            ToRewardWorker, socket=f"[{ctx.name}] request bodies from the router")

    def publish(self) -> None:
        s = self.scoring.statistics()
        self.ctx.status.update(requests_done=self.done, items_scored=s.items,
                               score_errors=s.errors, score_timeouts=s.timeouts,
                               score_crashes=s.crashes, score_children=s.children,
                               score_children_started=s.children_started,
                               requests_in_flight=self.in_flight)
        if isinstance(self.scoring, ServedScoring):
            self.ctx.status.update(self.scoring.status())

    async def reply(self, body: bytes) -> bytes:
        try:
            request = self.body_codec.decode(body)
        except DecodeError as exc:  # answered with no results: the client fails the request
            self.ctx.status["rejected_bodies"] = self.body_codec.rejected
            self.ctx.status["body_error"] = str(exc)[:200]
            return encode(ScoreReply([]))
        results = await self.scoring.score(items_of(request), request.max_response_length)
        self.done += 1
        return encode(ScoreReply(results))

    async def background(self) -> None:
        if isinstance(self.scoring, ServedScoring):
            await self.scoring.keep_sleeping()

    async def aclose(self) -> None:
        await self.scoring.aclose()


async def reward_actor(ctx: ActorContext, *, task_status) -> None:
    cfg = ctx.topology.reward
    sock, monitor = worker_socket(ctx)
    replica = model_replica(cfg, ctx.index)  # None: a rule worker (attached: -1, or --pool)
    scoring: Scoring | ServedScoring
    if replica is None:
        scoring, pool, capacity = Scoring(cfg, job_rules(ctx.topology)), POOL, cfg.capacity
    else:
        entry, _ = replica
        scoring = ServedScoring(entry, ctx.topology, label=f"{ctx.name} {ctx.run_dir}")
        pool, capacity = entry.name, entry.capacity
        ctx.status.update(scoring.status())
    await scoring.load()
    await serve(ctx, RewardWorker(ctx, sock, scoring, pool, capacity), monitor,
                task_status=task_status)
