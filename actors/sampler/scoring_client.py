"""The sampler's side of the router: routed requests with a timeout, so nothing waits forever.

A request goes out as an ``Envelope`` (its id and pool) and an encoded body; the reply comes
back under the same id. The router already re-sends a request whose worker dies or times out;
this client covers what the router cannot: a reply lost with the router itself (a restart, a
dropped message). A request unanswered for ``timeout_s`` is sent again under the same id (a
late reply to an earlier send is as good as any; a router that still holds it ignores the
re-send), up to ``attempts`` sends; then it has failed, and the caller records the group as
unscored rather than waiting on it. A request the router gave up on (every worker it tried
died or timed out on it) fails at once.

A group is scored by every pool of ``targets`` (``score_targets``: the rule workers, and the
model pools of ``[[reward.models]]``), all at once; the weighted sum is its reward
(``actors/scoring/combine.py``), and it is unscored when any pool's request failed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import anyio

from actors.runtime.config import RULES_POOL
from actors.runtime.zmq_bridge import AsyncSocket
from actors.scoring.combine import combine
from messages.codec import Codec, DecodeError, encode
from messages.reward import ScoreReply, ScoreRequest, ToScoringClient
from messages.routing import Envelope, RouterError, ToClient


@dataclass(frozen=True)
class ClientStatistics:
    sent: int  # requests sent (first sends)
    resent: int  # sends after a timeout
    failed: int  # requests given up after every attempt
    late: int  # replies for requests already answered or given up
    in_flight: int  # requests waiting for a reply
    rejected: int  # frames that did not decode


class _Waiter:
    def __init__(self) -> None:
        self.done = anyio.Event()
        self.body: bytes | None = None
        self.failed = False  # the router answered with an error


class ScoringClient:
    """Sends routed requests on a DEALER connected to the router; ``serve`` must run beside."""

    def __init__(self, sock: AsyncSocket, *, timeout_s: float, attempts: int,
                 targets: tuple[tuple[str, float], ...] = ((RULES_POOL, 1.0),)) -> None:
        self.sock = sock
        self.targets = targets  # the pools that score every group, with their weights
        self.timeout_s, self.attempts = timeout_s, attempts
        self.codec: Codec[ToClient] = Codec(ToClient)
        self.body_codec: Codec[ToScoringClient] = Codec(ToScoringClient)
        self._ids = itertools.count()
        self._waiting: dict[int, _Waiter] = {}  # request id -> its waiter, until answered
        self._sent = self._resent = self._failed = self._late = 0
        self.router_error = ""  # the last error the router answered with

    def statistics(self) -> ClientStatistics:
        return ClientStatistics(self._sent, self._resent, self._failed, self._late,
                                len(self._waiting), self.codec.rejected)

    async def request(self, pool: str, body: bytes) -> bytes | None:
        """The reply body to ``body`` from a worker of ``pool``, or None when no reply came
        after ``attempts`` sends ``timeout_s`` apart."""
        rid = next(self._ids)
        waiter = self._waiting[rid] = _Waiter()
        frames = [encode(Envelope(rid, pool)), body]
        try:
            for attempt in range(self.attempts):
                if attempt:
                    self._resent += 1
                else:
                    self._sent += 1
                await self.sock.send_multipart(frames)
                with anyio.move_on_after(self.timeout_s):
                    await waiter.done.wait()
                if waiter.failed:
                    break
                if waiter.done.is_set():
                    return waiter.body
            self._failed += 1
            return None
        finally:
            self._waiting.pop(rid, None)

    async def score(self, request: ScoreRequest) -> ScoreReply | None:
        """Scores of one group's responses from every pool of ``targets``, combined; None when
        any pool's scoring failed (see ``request``)."""
        if len(self.targets) == 1:
            reply = await self.score_by(self.targets[0][0], request)
            return None if reply is None else combine(self.targets, [reply])
        replies: list[ScoreReply | None] = [None] * len(self.targets)
        body = encode(request)

        async def one(k: int) -> None:
            replies[k] = await self.score_by(self.targets[k][0], request, body)

        async with anyio.create_task_group() as tg:
            for k in range(len(self.targets)):
                tg.start_soon(one, k)
        if any(r is None for r in replies):
            return None
        return combine(self.targets, [r for r in replies if r is not None])

    async def score_by(self, pool: str, request: ScoreRequest,
                       body_bytes: bytes | None = None) -> ScoreReply | None:
        """Scores of one group's responses from ``pool``, or None when that failed."""
        body = await self.request(pool, body_bytes or encode(request))
        if body is None:
            return None
        try:
            reply = self.body_codec.decode(body)
        except DecodeError as exc:  # a broken worker: its reply is no reply
            self.router_error = f"undecodable reply: {exc}"[:200]
            self._failed += 1
            return None
        if len(reply.results) != len(request.responses):
            self.router_error = (f"{len(reply.results)} results for "
                                 f"{len(request.responses)} responses")
            self._failed += 1
            return None
        return reply

    async def serve(self) -> None:
        """Deliver replies to their requests until cancelled."""
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg = self.codec.decode(frames[0])
            except DecodeError:  # counted by the codec
                continue
            match msg:
                case RouterError(error=error, request_id=rid):
                    self.router_error = error[:200]
                    waiter = self._waiting.get(rid)
                    if waiter is not None and not waiter.done.is_set():
                        waiter.failed = True  # the router gave up on it: no re-send helps
                        waiter.done.set()
                case Envelope(request_id=rid) if len(frames) == 2:
                    waiter = self._waiting.get(rid)
                    if waiter is None or waiter.done.is_set():
                        self._late += 1
                        continue
                    waiter.body = frames[1]
                    waiter.done.set()
