"""Router state (no I/O, explicit clock): least in-flight choice, capacity, pools named by the
request, failover bookkeeping, duplicate replies, statistics as a record and the status it
publishes; and a random walk that checks every request is answered exactly once."""

from __future__ import annotations

import dataclasses
import random

import pytest

from actors.router.state import RouterState, RouterStatistics, WorkerStatistics
from messages.routing import Envelope

BODY = b"\xc1 an opaque body: the router never decodes it"


def submit(s: RouterState, client_request_id: int, pool: str = "reward", client: bytes = b"c") -> int:
    return s.submit(client, Envelope(client_request_id, pool), BODY + b"%d" % client_request_id)


def test_least_in_flight_choice_respects_capacity():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 2, now=0)
    s.register(b"w2", "w2", "reward", 1, now=0)
    for i in range(4):
        submit(s, i)
    sent = s.assign(now=0)
    # w1 and w2 each get one, then only w1 has room; the fourth waits
    assert sorted(w.name for w, _, _ in sent) == ["w1", "w1", "w2"]
    assert len(s.pending) == 1
    (w2_rid, w2_entry), = [(rid, e) for w, rid, e in sent if w.name == "w2"]
    assert s.complete(b"w2", w2_rid, now=1) is w2_entry
    sent = s.assign(now=1)
    assert [w.name for w, _, _ in sent] == ["w2"]


def test_the_body_is_forwarded_as_it_came_under_a_router_id():
    s = RouterState()
    s.register(b"w", "w", "reward", 4, now=0)
    body = b"\x00\xff not msgpack at all"
    rids = [s.submit(b"client-a", Envelope(5, "reward"), body),
            s.submit(b"client-b", Envelope(5, "reward"), b"other")]  # same id, two clients
    assert len(set(rids)) == 2  # re-keyed: the replies cannot be confused
    (_, rid_a, a), (_, rid_b, b) = s.assign(now=0)
    assert (rid_a, rid_b) == tuple(rids)
    assert a.body is body and (a.client, a.client_request_id, a.pool) == (b"client-a", 5, "reward")
    assert s.complete(b"w", rid_b, now=1).client == b"client-b"
    assert s.complete(b"w", rid_a, now=1).client == b"client-a"


def test_new_worker_gets_work_at_once():
    s = RouterState()
    submit(s, 0)
    assert s.assign(now=0) == [] and len(s.pending) == 1
    stats = s.statistics()
    assert stats.unserved_pools == ("reward",) and stats.pending == 1 and stats.in_flight == 0
    assert stats.status()["waiting"] == "no live worker for reward"
    s.register(b"w", "w", "reward", 1, now=0)
    assert [w.name for w, _, _ in s.assign(now=0)] == ["w"]
    stats = s.statistics()
    assert stats.unserved_pools == () and "waiting" not in stats.status()
    assert (stats.pending, stats.in_flight) == (0, 1)


def test_pools_are_named_by_the_request():
    s = RouterState()
    s.register(b"r", "reward-0", "reward", 4, now=0)
    submit(s, 0, pool="generate")
    assert s.assign(now=0) == []  # a reward worker does not take a generate request
    stats = s.statistics()
    assert stats.unserved_pools == ("generate",)
    assert stats.status()["waiting"] == "no live worker for generate"
    submit(s, 1, pool="reward")
    assert [(w.name, e.pool) for w, _, e in s.assign(now=0)] == [("reward-0", "reward")]
    submit(s, 2, pool="embed")
    assert s.statistics().status()["waiting"] == "no live worker for embed, generate"
    s.register(b"g", "gen-0", "generate", 4, now=1)
    assert [(w.name, e.client_request_id) for w, _, e in s.assign(now=1)] == [("gen-0", 0)]
    assert s.statistics().unserved_pools == ("embed",)
    # a pool whose only worker is leaving is unserved again
    s.leave(b"g", now=2)
    submit(s, 3, pool="generate")
    assert s.assign(now=2) == []
    assert s.statistics().unserved_pools == ("embed", "generate")


def test_dead_worker_work_is_resent_and_late_reply_discarded():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0)
    submit(s, 41)
    (worker, rid, _), = s.assign(now=0)
    s.register(b"w2", "w2", "reward", 4, now=5)
    assert s.expire(now=11, worker_timeout=10, request_timeout=100) == ["w1"]  # silent since 0
    assert b"w1" not in s.workers
    (worker2, rid2, _), = s.assign(now=11)
    assert worker2.name == "w2" and rid2 == rid  # the same router id: a late reply is a duplicate
    assert s.complete(b"w2", rid, now=12).client_request_id == 41
    assert s.complete(b"w1", rid, now=13) is None  # late duplicate
    stats = s.statistics()
    assert (stats.duplicates, stats.answered, stats.resent) == (1, 1, 1)
    assert (stats.in_flight, stats.pending) == (0, 0)


def test_timed_out_request_goes_to_another_worker():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 1, now=0)
    s.register(b"w2", "w2", "reward", 1, now=0)
    submit(s, 0)
    (first, rid, _), = s.assign(now=0)
    s.workers[b"w1"].last_seen = s.workers[b"w2"].last_seen = 50
    assert s.expire(now=61, worker_timeout=100, request_timeout=60) == []  # both alive
    (second, again, _), = s.assign(now=61)
    assert second.name != first.name and again == rid
    by_name = {w.name: w for w in s.statistics().workers}
    assert (by_name[first.name].failed, by_name[first.name].in_flight) == (1, 0)
    assert (by_name[second.name].failed, by_name[second.name].in_flight) == (0, 1)
    # the first worker answers after all: a duplicate, and the client gets the second's answer
    assert s.complete(first.identity, rid, now=62) is None
    assert s.complete(second.identity, rid, now=63).client_request_id == 0


def test_leaving_worker_gets_no_new_work():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0)
    s.workers[b"w1"].leaving = True
    submit(s, 0)
    assert s.assign(now=0) == []


def test_leaving_worker_is_removed_once_its_last_reply_is_in():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0)
    s.register(b"w2", "w2", "reward", 4, now=0)
    submit(s, 7)
    (worker, rid, _), = s.assign(now=0)
    s.leave(worker.identity, now=1)
    assert worker.identity in s.workers  # still owes a reply
    status = s.statistics().status()
    assert status[f"worker/{worker.name}"]["leaving"] is True and status[f"worker/{worker.name}"]["in_flight"] == 1
    submit(s, 8)
    (other, _, _), = s.assign(now=1)
    assert other.identity != worker.identity  # no new work for the leaving one
    assert s.complete(worker.identity, rid, now=2).client_request_id == 7
    assert worker.identity not in s.workers and f"worker/{worker.name}" not in s.statistics().status()


def test_idle_leaving_worker_is_removed_at_once():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0)
    s.leave(b"w1", now=1)
    stats = s.statistics()
    assert b"w1" not in s.workers and stats.workers == () and stats.status()["workers"] == 0


def test_heartbeat_after_bye_does_not_bring_a_worker_back():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0)
    s.register(b"w2", "w2", "reward", 4, now=0)
    submit(s, 0)
    (worker, _, _), = s.assign(now=0)
    s.leave(worker.identity, now=1)
    s.register(worker.identity, worker.name, "reward", 4, now=2)  # heartbeat while draining
    assert s.workers[worker.identity].leaving
    idle = b"w2" if worker.identity == b"w1" else b"w1"
    s.leave(idle, now=2)
    s.register(idle, "again", "reward", 4, now=3)  # heartbeat after it was removed
    assert idle not in s.workers
    submit(s, 1)
    assert s.assign(now=3) == []  # nobody live: it waits
    assert s.statistics().status()["waiting"] == "no live worker for reward"


def test_hello_is_a_new_incarnation():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0, hello=True)
    submit(s, 0)
    (_, rid, _), = s.assign(now=0)
    # killed and restarted under the same identity: what it had is re-sent, to it again
    s.register(b"w1", "w1", "reward", 4, now=5, hello=True)
    assert s.resent == 1 and not s.workers[b"w1"].in_flight
    (worker, again, _), = s.assign(now=5)
    assert worker.identity == b"w1" and again == rid
    # one that said bye and is gone comes back with a hello
    s.complete(b"w1", rid, now=6)
    s.leave(b"w1", now=7)
    assert b"w1" not in s.workers
    s.register(b"w1", "w1", "reward", 4, now=8, hello=True)
    assert b"w1" in s.workers and not s.workers[b"w1"].leaving


def test_statistics_are_a_record_and_the_status_has_one_entry_per_worker():
    s = RouterState()
    s.register(b"a", "reward-0", "reward", 2, now=0)
    s.register(b"b", "reward-1", "reward", 1, now=0)
    rids = [submit(s, i) for i in range(4)]
    sent = {rid: w for w, rid, _ in s.assign(now=10.0)}
    assert len(sent) == 3
    latencies = {}
    for rid, delay in zip(sorted(sent), (0.002, 0.004, 0.010), strict=True):
        latencies.setdefault(sent[rid].name, []).append(delay)
        s.complete(sent[rid].identity, rid, now=10.0 + delay)
    s.complete(b"a", rids[0], now=11.0)  # answered already: a duplicate
    stats = s.statistics()
    assert isinstance(stats, RouterStatistics)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.answered = 0  # type: ignore[misc]
    assert (stats.in_flight, stats.pending, stats.answered, stats.resent, stats.duplicates) == \
        (0, 1, 3, 0, 1)
    assert stats.unserved_pools == ()  # one waits, but its pool has live workers
    by_name = {w.name: w for w in stats.workers}
    assert set(by_name) == {"reward-0", "reward-1"}
    for name, w in by_name.items():
        assert isinstance(w, WorkerStatistics)
        lat = sorted(latencies[name])
        assert (w.pool, w.done, w.failed, w.in_flight, w.leaving) == ("reward", len(lat), 0, 0, False)
        assert w.p50_s == pytest.approx(lat[len(lat) // 2])
        assert w.p99_s == pytest.approx(lat[-1])
    assert by_name["reward-0"].capacity == 2 and by_name["reward-1"].capacity == 1
    a = by_name["reward-0"]
    assert stats.status() == {
        "workers": 2, "in_flight": 0, "pending": 1, "answered": 3, "resent": 0, "duplicates": 1,
        "resubmitted": 0, "failed": 0,
        "worker/reward-0": {"pool": "reward", "in_flight": 0, "capacity": 2, "done": a.done, "failed": 0,
                     "p50_ms": round(a.p50_s * 1e3, 1), "p99_ms": round(a.p99_s * 1e3, 1),
                     "leaving": False},
        "worker/reward-1": {"pool": "reward", "in_flight": 0, "capacity": 1,
                     "done": by_name["reward-1"].done, "failed": 0,
                     "p50_ms": round(by_name["reward-1"].p50_s * 1e3, 1),
                     "p99_ms": round(by_name["reward-1"].p99_s * 1e3, 1), "leaving": False},
    }
    # a worker that never answered reports zeros, not an error
    s.register(b"c", "reward-2", "reward", 1, now=12)
    fresh = {w.name: w for w in s.statistics().workers}["reward-2"]
    assert (fresh.done, fresh.p50_s, fresh.p99_s) == (0, 0.0, 0.0)


@pytest.mark.parametrize("seed", range(20))
def test_random_walk_answers_every_request_exactly_once(seed):
    """Workers join, leave, die, restart and answer late, requests time out; through it all the
    bookkeeping adds up and, once a worker stays, every request is answered exactly once."""
    rng = random.Random(seed)
    s = RouterState()
    now = 0.0
    identities = [b"w%d" % i for i in range(4)]
    pools = ("reward", "generate")
    held: list[tuple[bytes, int]] = []  # (worker, router id) as sent, not yet answered by it
    answered: dict[int, int] = {}  # client request id -> times answered
    failed: set[int] = set()  # client request ids given up (max_failures workers failed them)
    next_request = 0

    def check() -> None:
        for entry in s.given_up:  # the loop answers these with an error, once
            assert entry.client_request_id not in failed
            failed.add(entry.client_request_id)
        s.given_up.clear()
        assert not failed & set(answered)
        stats = s.statistics()
        assert stats.failed == len(failed)
        at_workers = sum(len(w.in_flight) for w in s.workers.values())
        assert stats.in_flight == at_workers == len(s.requests) - len(s.pending)
        assert stats.pending == len(set(s.pending)) == len(s.pending)
        for rid, entry in s.requests.items():  # each request at one worker or waiting, not both
            owners = [w for w in s.workers.values() if rid in w.in_flight]
            assert (entry.worker is None) == (rid in s.pending) == (not owners)
            assert len(owners) <= 1 and all(w.identity == entry.worker for w in owners)
        assert stats.answered == sum(answered.values()) == len(answered)
        assert all(n == 1 for n in answered.values())

    for _ in range(300):
        now += rng.random()
        action = rng.random()
        if action < 0.25:
            submit(s, next_request, rng.choice(pools))
            next_request += 1
        elif action < 0.40:
            ident = rng.choice(identities)
            s.register(ident, ident.decode(), rng.choice(pools), rng.randint(1, 3), now,
                       hello=rng.random() < 0.3)
        elif action < 0.45:
            s.leave(rng.choice(identities), now)
        elif action < 0.75 and held:  # a worker answers (maybe late, maybe after it was dropped)
            ident, rid = held.pop(rng.randrange(len(held)))
            entry = s.complete(ident, rid, now)
            if entry is not None:
                answered[entry.client_request_id] = answered.get(entry.client_request_id, 0) + 1
        elif action < 0.85:
            s.expire(now, worker_timeout=5.0, request_timeout=3.0)
        held += [(w.identity, rid) for w, rid, _ in s.assign(now)]
        check()

    # then one live worker per pool that answers everything: nothing is lost
    for pool in pools:
        s.register(b"final-" + pool.encode(), "final-" + pool, pool, 1000, now, hello=True)
    for _ in range(10):
        now += 10.0
        for w in s.workers.values():
            w.last_seen = now
        s.expire(now, worker_timeout=5.0, request_timeout=3.0)
        for w, rid, _ in s.assign(now):
            entry = s.complete(w.identity, rid, now)
            answered[entry.client_request_id] = answered.get(entry.client_request_id, 0) + 1
        check()
    assert not s.requests and sorted([*answered, *failed]) == list(range(next_request))


def test_a_client_resend_of_a_request_still_held_changes_nothing():
    s = RouterState()
    s.register(b"w", "w", "reward", 4, now=0)
    first = submit(s, 5)
    assert submit(s, 5) == first and s.resubmitted == 1 and len(s.requests) == 1
    assert submit(s, 5, client=b"other") != first  # ids are per client
    sent = s.assign(now=0)
    assert len(sent) == 2
    assert s.complete(b"w", first, now=1) is not None
    # once answered, a re-send is a request again (the answer may have been lost on its way)
    assert submit(s, 5) not in (first, None) and s.resubmitted == 1


def test_a_request_every_worker_fails_is_given_up_with_the_client_told():
    s = RouterState(max_failures=3)
    rid = submit(s, 9)
    for k in range(3):  # three workers in turn sit on it past the request timeout
        ident = b"w%d" % k
        s.register(ident, ident.decode(), "reward", 1, now=10 * k)
        (worker, sent_rid, _), = s.assign(now=10 * k)
        assert worker.identity == ident and sent_rid == rid
        s.workers[ident].last_seen = 10 * k + 9  # alive, just slow
        s.expire(now=10 * k + 9, worker_timeout=100, request_timeout=5)
    (entry,) = s.given_up
    assert entry.client_request_id == 9 and entry.failures == 3
    assert not s.requests and not s.pending and s.resent == 2
    stats = s.statistics()
    assert stats.failed == 1 and stats.status()["failed"] == 1
    assert s.complete(b"w2", rid, now=40) is None and s.duplicates == 1  # a late reply
