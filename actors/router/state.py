"""The router's state: routing decisions and bookkeeping, without I/O (tested on its own with
an explicit clock).

A request is known by the router id it was given at ``submit`` (and by its client's own id);
it waits in ``pending`` until ``assign`` gives it to the least-loaded live worker of its pool,
leaves when that worker answers (``complete``), and goes back to ``pending`` when the worker
dies, leaves or times out on it (``take_back``), to be given to another worker first; a request
``max_failures`` workers failed is given up and its client told. Statistics are a record.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from messages.control import StatusValue
from messages.routing import Envelope


@dataclass(frozen=True)
class WorkerStatistics:
    name: str
    pool: str
    in_flight: int
    capacity: int
    done: int
    failed: int  # requests taken back from it (death, timeout)
    p50_s: float  # latency percentiles over its last 512 replies (0 before any)
    p99_s: float
    leaving: bool


@dataclass(frozen=True)
class RouterStatistics:
    workers: tuple[WorkerStatistics, ...]
    in_flight: int  # requests at a worker
    pending: int  # requests waiting for a worker
    answered: int
    resent: int
    duplicates: int  # replies for ids no longer in flight
    resubmitted: int  # client re-sends of requests still held (ignored)
    failed: int  # requests given up after max_failures workers failed them
    unserved_pools: tuple[str, ...]  # pools with requests waiting and no live worker

    def status(self) -> dict[str, StatusValue]:
        """As an actor status: the totals, plus one entry per worker, ``worker/NAME`` (a prefix,
        so no worker's name can shadow a total)."""
        out: dict[str, StatusValue] = {
            "workers": len(self.workers), "in_flight": self.in_flight, "pending": self.pending,
            "answered": self.answered, "resent": self.resent, "duplicates": self.duplicates,
            "resubmitted": self.resubmitted, "failed": self.failed}
        if self.unserved_pools:
            out["waiting"] = "no live worker for " + ", ".join(self.unserved_pools)
        for w in self.workers:
            out[f"worker/{w.name}"] = {"pool": w.pool, "in_flight": w.in_flight, "capacity": w.capacity,
                           "done": w.done, "failed": w.failed, "p50_ms": round(w.p50_s * 1e3, 1),
                           "p99_ms": round(w.p99_s * 1e3, 1), "leaving": w.leaving}
        return out


@dataclass
class Worker:
    identity: bytes
    name: str
    pool: str
    capacity: int
    last_seen: float
    in_flight: set[int] = field(default_factory=set)  # router ids sent to this worker, unanswered
    done: int = 0
    failed: int = 0  # requests taken back from it (death, timeout)
    leaving: bool = False  # said bye: gets no new work
    latencies: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=512))

    def statistics(self) -> WorkerStatistics:
        lat = sorted(self.latencies)
        p50 = lat[len(lat) // 2] if lat else 0.0
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
        return WorkerStatistics(self.name, self.pool, len(self.in_flight), self.capacity,
                                self.done, self.failed, p50, p99, self.leaving)


@dataclass
class InFlight:
    client: bytes
    client_request_id: int
    pool: str
    body: bytes  # forwarded as it came, never decoded
    worker: bytes | None = None
    sent_at: float = 0.0
    failed_on: set[bytes] = field(default_factory=set)  # workers that died or timed out on it
    failures: int = 0  # times a worker died or timed out on it


@dataclass
class RouterState:
    """Routing decisions and bookkeeping, without I/O (tested on its own)."""

    workers: dict[bytes, Worker] = field(default_factory=dict)
    requests: dict[int, InFlight] = field(default_factory=dict)  # every unanswered request
    pending: collections.deque[int] = field(default_factory=collections.deque)  # ids without a worker
    ids: itertools.count = field(default_factory=itertools.count)
    # (client, client request id) -> router id, for every request in ``requests``
    by_client: dict[tuple[bytes, int], int] = field(default_factory=dict)
    max_failures: int = 3  # a request failed by this many workers is given up (poisoned)
    given_up: list[InFlight] = field(default_factory=list)  # to answer with an error; the loop
    # drains it
    answered: int = 0
    duplicates: int = 0  # replies for ids no longer in flight
    resent: int = 0
    resubmitted: int = 0  # client re-sends of a request the router still holds (ignored)
    failed: int = 0  # requests given up after max_failures
    departed: set[bytes] = field(default_factory=set)  # said bye and gone: heartbeats ignored

    def register(self, identity: bytes, name: str, pool: str, capacity: int, now: float,
                 hello: bool = False) -> None:
        """A hello or a heartbeat. A hello is a new incarnation: what the old one had in flight is
        re-sent and a bye it said is forgotten. A heartbeat from a worker that said bye keeps it
        leaving (or, once it is gone, does not bring it back)."""
        if hello:
            self.departed.discard(identity)
        elif identity in self.departed:
            return
        w = self.workers.get(identity)
        if w is None:
            self.workers[identity] = Worker(identity, name, pool, max(1, capacity), now)
            return
        w.last_seen, w.capacity, w.pool, w.name = now, max(1, capacity), pool, name
        if hello:
            w.leaving = False
            for rid in sorted(w.in_flight):  # the old process died with these
                self.take_back(rid)

    def leave(self, identity: bytes, now: float) -> bool:
        """A worker said bye: no new work; removed once its last request is answered.
        Returns True when the bye is acknowledged (known worker or not, it gets no more work)."""
        w = self.workers.get(identity)
        if w is not None:
            w.leaving, w.last_seen = True, now
        self.departed.add(identity)
        self._drop_if_done(identity)
        return True

    def _drop_if_done(self, identity: bytes) -> None:
        w = self.workers.get(identity)
        if w is not None and w.leaving and not w.in_flight:
            del self.workers[identity]

    def submit(self, client: bytes, envelope: Envelope, body: bytes) -> int:
        """A client's request; returns the router id it goes to a worker under. A client's
        re-send of a request the router still holds changes nothing (its answer is coming)."""
        key = (client, envelope.request_id)
        if key in self.by_client:
            self.resubmitted += 1
            return self.by_client[key]
        rid = next(self.ids)
        self.requests[rid] = InFlight(client, envelope.request_id, envelope.pool, body)
        self.by_client[key] = rid
        self.pending.append(rid)
        return rid

    def _forget(self, rid: int) -> InFlight:
        entry = self.requests.pop(rid)
        del self.by_client[(entry.client, entry.client_request_id)]
        return entry

    def pick(self, pool: str, avoid: AbstractSet[bytes] = frozenset()) -> Worker | None:
        """The live worker of ``pool`` with the fewest requests in flight and room for one more.

        Workers in ``avoid`` (those that already failed this request) are chosen only when no
        other worker of the pool has room.
        """
        best: Worker | None = None
        for w in self.workers.values():
            if w.pool != pool or w.leaving or len(w.in_flight) >= w.capacity:
                continue
            key = (w.identity in avoid, len(w.in_flight), w.done)
            if best is None or key < (best.identity in avoid, len(best.in_flight), best.done):
                best = w
        return best

    def assign(self, now: float) -> list[tuple[Worker, int, InFlight]]:
        """Give pending requests to workers, in arrival order; returns what to send where:
        (worker, router id, request)."""
        out = []
        blocked: collections.deque[int] = collections.deque()
        while self.pending:
            rid = self.pending.popleft()
            entry = self.requests[rid]
            worker = self.pick(entry.pool, entry.failed_on)
            if worker is None:
                blocked.append(rid)
                continue
            worker.in_flight.add(rid)
            entry.worker, entry.sent_at = worker.identity, now
            out.append((worker, rid, entry))
        self.pending = blocked
        return out

    def complete(self, worker_id: bytes, rid: int, now: float) -> InFlight | None:
        """A worker answered router id ``rid``; returns the client request to answer, or None
        for a duplicate."""
        entry = self.requests.get(rid)
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = now
        if entry is None or entry.worker != worker_id:
            self.duplicates += 1
            return None
        self._forget(rid)
        if worker is not None:
            worker.in_flight.discard(rid)
            worker.done += 1
            worker.latencies.append(now - entry.sent_at)
            self._drop_if_done(worker_id)
        self.answered += 1
        return entry

    def take_back(self, rid: int) -> None:
        """Re-queue a request whose worker failed it; a late reply from that worker is a duplicate.
        One that ``max_failures`` workers failed is given up instead (``given_up``): a request
        that kills or hangs every worker it meets must not go round for ever."""
        entry = self.requests[rid]
        if entry.worker is not None:
            entry.failed_on.add(entry.worker)
            entry.failures += 1
        if entry.worker is not None and entry.worker in self.workers:
            w = self.workers[entry.worker]
            w.in_flight.discard(rid)
            w.failed += 1
            self._drop_if_done(entry.worker)
        entry.worker = None
        if entry.failures >= self.max_failures:
            self.given_up.append(self._forget(rid))
            self.failed += 1
            return
        self.pending.appendleft(rid)
        self.resent += 1

    def expire(self, now: float, worker_timeout: float, request_timeout: float) -> list[str]:
        """Remove silent workers and re-queue their work and any timed-out request."""
        gone = []
        for identity, w in list(self.workers.items()):
            if now - w.last_seen > worker_timeout:
                for rid in sorted(w.in_flight):
                    self.take_back(rid)
                self.workers.pop(identity, None)
                gone.append(w.name)
        for rid, entry in list(self.requests.items()):
            if entry.worker is not None and now - entry.sent_at > request_timeout:
                self.take_back(rid)
        return gone

    def statistics(self) -> RouterStatistics:
        waiting = {self.requests[rid].pool for rid in self.pending}
        served = {w.pool for w in self.workers.values() if not w.leaving}
        return RouterStatistics(
            workers=tuple(w.statistics() for w in self.workers.values()),
            in_flight=len(self.requests) - len(self.pending), pending=len(self.pending),
            answered=self.answered, resent=self.resent, duplicates=self.duplicates,
            resubmitted=self.resubmitted, failed=self.failed,
            unserved_pools=tuple(sorted(waiting - served)))
