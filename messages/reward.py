"""Scoring flow: Sampler -> Router -> reward worker -> Router -> Sampler.

Sockets: the router binds a ROUTER for clients (``router`` address, samplers connect DEALERs)
and a ROUTER for workers (``router_workers`` address, reward workers connect DEALERs). Workers
announce themselves with ``WorkerHello`` and can join or leave while the job runs. The router is
generic over pools: ``pool`` names which kind of worker serves a request.
"""

from __future__ import annotations

import msgspec

from messages.rollout import ChatMessage


class ScoreItem(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One completion to score (verl ``compute_score`` arguments)."""

    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: dict[str, str | int | float] = {}
    response_length: int = 0  # response tokens, for the overlong penalty (0: unknown, none applied)
    prompt: list[ChatMessage] = []  # the prompt's messages, for scorers that read it (reward models)


class ScoreResult(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    score: float
    error: str = ""  # non-empty: scoring failed and ``score`` is the failure score
    extra: dict[str, float] = {}


class ScoreRequest(msgspec.Struct, tag=True, gc=False):
    """Client -> Router -> Worker. ``request_id`` is unique per client; the router re-keys it."""

    request_id: int
    items: list[ScoreItem]
    pool: str = "reward"


class ScoreReply(msgspec.Struct, tag=True, gc=False):
    """Worker -> Router -> Client: one result per item, in order."""

    request_id: int
    results: list[ScoreResult]


class WorkerHello(msgspec.Struct, tag=True):
    """Worker -> Router: this worker serves ``pool`` and takes up to ``capacity`` requests at once."""

    name: str
    pool: str = "reward"
    capacity: int = 1


class WorkerHeartbeat(msgspec.Struct, tag=True, gc=False):
    """Worker -> Router: still alive. Carries the hello's fields so a restarted router re-learns it."""

    name: str
    pool: str = "reward"
    capacity: int = 1


class WorkerBye(msgspec.Struct, tag=True):
    """Worker -> Router: leaving; send no more work (in-flight requests still get replies).

    Router -> Worker: the acknowledgement; every request the router sent it before comes first.
    """

    name: str


class RouterError(msgspec.Struct, tag=True):
    """Router -> Client or Worker: a frame that did not decode, or a request it cannot route."""

    error: str
    request_id: int = -1


ToRouterFromClient = ScoreRequest
ToRouterFromWorker = ScoreReply | WorkerHello | WorkerHeartbeat | WorkerBye
ToWorker = ScoreRequest | RouterError | WorkerBye
ToClient = ScoreReply | RouterError
