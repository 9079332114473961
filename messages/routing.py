"""Routing flow: clients -> Router -> workers of a pool -> Router -> clients.

Sockets: the router binds a ROUTER for clients (``router`` address; samplers connect DEALERs)
and a ROUTER for workers (``router_workers`` address; workers connect DEALERs). Workers announce
themselves with ``WorkerHello`` and can join or leave while the job runs.

A request or a reply is two frames: an ``Envelope`` (frame 0) and the body (frame 1). The
router reads only the envelope: it picks a worker of the envelope's ``pool``, re-keys the id so
a reply maps back to exactly one client request, and forwards the body bytes untouched. What a
body holds is the business of the pool's clients and workers (``messages.reward`` for
``reward``), so one router serves any pool.
"""

from __future__ import annotations

import msgspec


class Envelope(msgspec.Struct, tag=True, gc=False, omit_defaults=True):
    """Client -> Router -> Worker, and back: frame 0 of a routed message; frame 1 is the body.

    ``request_id`` is unique per client (the router re-keys it on the way to a worker and
    restores it on the way back); ``pool`` names the kind of worker that serves a request
    (replies leave it empty).
    """

    request_id: int
    pool: str = ""


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


ToRouterFromClient = Envelope
ToRouterFromWorker = Envelope | WorkerHello | WorkerHeartbeat | WorkerBye
ToWorker = Envelope | RouterError | WorkerBye
ToClient = Envelope | RouterError
