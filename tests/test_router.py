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
