"""Router: least in-flight choice, capacity, failover bookkeeping, duplicate replies."""

from actors.router import RouterState
from messages.reward import ScoreItem, ScoreReply, ScoreRequest, ScoreResult

ITEM = ScoreItem("arithmetic", "3", "3")


def request(rid):
    return ScoreRequest(request_id=rid, items=[ITEM])


def reply(rid):
    return ScoreReply(request_id=rid, results=[ScoreResult(1.0)])


def test_least_in_flight_choice_respects_capacity():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 2, now=0)
    s.register(b"w2", "w2", "reward", 1, now=0)
    for i in range(4):
        s.submit(b"c", request(i))
    sent = s.assign(now=0)
    targets = [w.name for w, _ in sent]
    # w1 and w2 each get one, then only w1 has room; the fourth waits
    assert sorted(targets) == ["w1", "w1", "w2"]
    assert len(s.pending) == 1
    w2_rid = next(r.request_id for w, r in sent if w.name == "w2")
    assert s.complete(b"w2", reply(w2_rid), now=1).client_request_id == w2_rid
    sent = s.assign(now=1)
    assert [w.name for w, _ in sent] == ["w2"]


def test_new_worker_gets_work_at_once():
    s = RouterState()
    s.submit(b"c", request(0))
    assert s.assign(now=0) == [] and len(s.pending) == 1
    assert s.statistics()["waiting"] == "no live reward worker"
    s.register(b"w", "w", "reward", 1, now=0)
    assert [w.name for w, _ in s.assign(now=0)] == ["w"]


def test_dead_worker_work_is_resent_and_late_reply_discarded():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0)
    s.submit(b"c", request(41))
    (worker, keyed), = s.assign(now=0)
    s.register(b"w2", "w2", "reward", 4, now=5)
    s.expire(now=11, worker_timeout=10, request_timeout=100)  # w1 silent since 0
    assert b"w1" not in s.workers
    (worker2, keyed2), = s.assign(now=11)
    assert worker2.name == "w2" and keyed2.request_id == keyed.request_id
    assert s.complete(b"w2", reply(keyed.request_id), now=12).client_request_id == 41
    assert s.complete(b"w1", reply(keyed.request_id), now=13) is None  # late duplicate
    assert s.duplicates == 1 and s.answered == 1 and s.resent == 1


def test_timed_out_request_goes_to_another_worker():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 1, now=0)
    s.register(b"w2", "w2", "reward", 1, now=0)
    s.submit(b"c", request(0))
    (first, _), = s.assign(now=0)
    s.workers[b"w1"].last_seen = s.workers[b"w2"].last_seen = 50
    s.expire(now=61, worker_timeout=100, request_timeout=60)
    (second, _), = s.assign(now=61)
    assert second.name != first.name


def test_leaving_worker_gets_no_new_work():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0)
    s.workers[b"w1"].leaving = True
    s.submit(b"c", request(0))
    assert s.assign(now=0) == []


def test_pools_are_separate():
    s = RouterState()
    s.register(b"g", "gen-0", "generate", 4, now=0)
    s.submit(b"c", request(0))
    assert s.assign(now=0) == []
    s.submit(b"c", ScoreRequest(request_id=1, items=[ITEM], pool="generate"))
    assert [w.name for w, _ in s.assign(now=0)] == ["gen-0"]


def test_leaving_worker_is_removed_once_its_last_reply_is_in():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0)
    s.register(b"w2", "w2", "reward", 4, now=0)
    s.submit(b"c", request(7))
    (worker, keyed), = s.assign(now=0)
    s.leave(worker.identity, now=1)
    assert worker.identity in s.workers  # still owes a reply
    assert worker.name in s.statistics() and "leaving" in s.statistics()[worker.name]
    s.submit(b"c", request(8))
    (other, _), = s.assign(now=1)
    assert other.identity != worker.identity  # no new work for the leaving one
    assert s.complete(worker.identity, reply(keyed.request_id), now=2).client_request_id == 7
    assert worker.identity not in s.workers and worker.name not in s.statistics()


def test_idle_leaving_worker_is_removed_at_once():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0)
    s.leave(b"w1", now=1)
    assert b"w1" not in s.workers and s.statistics()["workers"] == 0


def test_heartbeat_after_bye_does_not_bring_a_worker_back():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0)
    s.register(b"w2", "w2", "reward", 4, now=0)
    s.submit(b"c", request(0))
    (worker, _), = s.assign(now=0)
    s.leave(worker.identity, now=1)
    s.register(worker.identity, worker.name, "reward", 4, now=2)  # heartbeat while draining
    assert s.workers[worker.identity].leaving
    idle = b"w2" if worker.identity == b"w1" else b"w1"
    s.leave(idle, now=2)
    s.register(idle, "again", "reward", 4, now=3)  # heartbeat after it was removed
    assert idle not in s.workers
    s.submit(b"c", request(1))
    assert s.assign(now=3) == []  # nobody live: it waits
    assert s.statistics()["waiting"] == "no live reward worker"


def test_hello_is_a_new_incarnation():
    s = RouterState()
    s.register(b"w1", "w1", "reward", 4, now=0, hello=True)
    s.submit(b"c", request(0))
    (_, keyed), = s.assign(now=0)
    # killed and restarted under the same identity: what it had is re-sent, to it again
    s.register(b"w1", "w1", "reward", 4, now=5, hello=True)
    assert s.resent == 1 and not s.workers[b"w1"].in_flight
    (worker, again), = s.assign(now=5)
    assert worker.identity == b"w1" and again.request_id == keyed.request_id
    # one that said bye and is gone comes back with a hello
    s.complete(b"w1", reply(keyed.request_id), now=6)
    s.leave(b"w1", now=7)
    assert b"w1" not in s.workers
    s.register(b"w1", "w1", "reward", 4, now=8, hello=True)
    assert b"w1" in s.workers and not s.workers[b"w1"].leaving
