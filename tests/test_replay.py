"""Replay buffer admission control, staleness drops and the counters that prove nothing is lost."""

from actors.data.sources import make_task
from actors.replay.state import ReplayState
from actors.runtime.config import TaskConfig
from messages.rollout import Sample, ScoredGroup
from messages.tensor import Tensor

EMPTY = Tensor("int32", (0,), b"")


def state(staleness=1, batch=2, capacity=100):
    return ReplayState(task=make_task(TaskConfig(), seed=0), groups_per_step=batch,
                       max_staleness=staleness, capacity=capacity)


def scored(prompt, version):
    sample = Sample(EMPTY, Tensor("float32", (0,), b""), version, "", "stop", 1.0)
    return ScoredGroup(prompt=prompt, prompt_ids=EMPTY, samples=[sample], sampler="s")


def balanced(s):
    c = s.counters()
    return c["issued"] == c["trained"] + c["dropped"] + c["in_flight"]


def test_synchronous_admission_issues_one_batch_per_version():
    s = state(staleness=0, batch=2)
    assert s.admissible() == 2
    prompts = s.issue(b"a", 5)
    assert [p.prompt_id for p in prompts] == [0, 1]
    assert s.issue(b"a", 5) == []  # closed until the learner moves on
    for p in prompts:
        assert s.accept(scored(p, 0))
    assert s.admissible() == 0  # held groups still count
    assert len(s.take_batch(2)) == 2
    assert s.admissible() == 0  # trained at version 0; version 1 not yet published
    s.version = 1
    assert s.admissible() == 2
    assert balanced(s)


def test_async_admission_is_one_batch_ahead_per_staleness_step():
    s = state(staleness=1, batch=2)
    assert s.admissible() == 4  # (η + v + 1)·B = 4
    s.issue(b"a", 3)
    assert s.admissible() == 1
    s.version = 2
    assert s.admissible() == 5  # (1 + 2 + 1)·2 − 3 in flight
    s2 = state(staleness=1, batch=2, capacity=4)
    s2.issue(b"a", 10)
    assert s2.counters()["in_flight"] == 4  # capacity bounds what is in flight


def test_stale_groups_are_dropped_and_counted():
    s = state(staleness=1, batch=1)
    ps = s.issue(b"a", 2)
    s.accept(scored(ps[0], 0))
    s.accept(scored(ps[1], 2))
    s.version = 2  # group 0 is two versions behind
    batch = s.take_batch(1)
    assert [g.prompt.prompt_id for g in batch] == [1]
    c = s.counters()
    assert c["dropped_stale"] == 1 and c["trained"] == 1 and c["in_flight"] == 0
    assert balanced(s)
    assert s.batch_stats["age_versions_max"] == 0.0  # the group trained was not stale


def test_take_batch_waits_for_enough_groups():
    s = state(batch=2)
    ps = s.issue(b"a", 2)
    s.accept(scored(ps[0], 0))
    assert s.take_batch(2) is None
    s.accept(scored(ps[1], 0))
    assert len(s.take_batch(2)) == 2


def test_unknown_and_duplicate_groups_are_rejected():
    s = state()
    p = s.issue(b"a", 1)[0]
    assert s.accept(scored(p, 0))
    assert not s.accept(scored(p, 0))  # duplicate
    assert s.counters()["rejected"] == 1
    assert balanced(s)


def test_restarted_sampler_gets_its_prompts_back_first():
    s = state(staleness=0, batch=3)
    lost = s.issue(b"a", 2)
    s.issue(b"b", 1)
    assert s.requeue_from(b"a") == 2
    assert balanced(s)
    again = s.issue(b"a", 5)
    assert [p.prompt_id for p in again] == [p.prompt_id for p in lost]
    assert s.issued == 3  # requeued prompts are not issued twice
    assert balanced(s)


def test_counters_balance_through_a_long_random_run():
    import random
    rng = random.Random(0)
    s = state(staleness=1, batch=3, capacity=7)
    outstanding = []
    for _ in range(500):
        action = rng.random()
        if action < 0.4:
            outstanding += s.issue(b"a", rng.randint(1, 4))
        elif action < 0.8 and outstanding:
            p = outstanding.pop(rng.randrange(len(outstanding)))
            s.accept(scored(p, max(0, s.version - rng.randint(0, 2))))
        elif s.take_batch(3) is not None:
            s.version += 1
        assert balanced(s)
        assert s.counters()["in_flight"] <= 7


def test_a_prompt_the_engine_rejected_is_dropped_with_its_reason_not_reissued():
    s = state(staleness=0, batch=2)
    a, b = s.issue(b"a", 2)
    too_long = ScoredGroup(prompt=a, prompt_ids=EMPTY, samples=[], sampler="s",
                           generate_error="prompt of 300 tokens is longer than max_model_len 256")
    assert s.accept(too_long) and s.accept(scored(b, 0))
    c = s.counters()
    assert c["dropped_rejected"] == 1 and c["dropped"] == 1 and c["held"] == 1 and balanced(s)
    assert [r for t, r in s.records if t == "fates"][0]["reason"] == "rejected"
    assert [p.prompt_id for p in s.issue(b"a", 5)] == [2]  # a replacement, never prompt 0 again


def fixed(staleness=1, batch=2, capacity=100):
    from actors.replay.schedule import FixedSchedule

    return ReplayState(task=make_task(TaskConfig(), seed=0), groups_per_step=batch,
                       max_staleness=staleness, capacity=capacity,
                       schedule=FixedSchedule(batch, staleness, seed=0))


def test_a_fixed_schedule_issues_whole_batches_at_their_version_and_serves_in_prompt_order():
    """run.deterministic: batch b (prompt ids b·G..) goes out whole whatever was asked, with
    version max(0, b − η) and a seed of its own, only once the learner has that version; a
    batch given back goes out again whole with the same version and seed; a training batch is
    the lowest prompt ids, once none before them is out; the learner may publish version v
    once the batches due on v − 1 are back."""
    s = fixed(staleness=1, batch=2)
    b0, b1 = s.issue(b"a", 5), s.issue(b"b", 1)
    assert [p.prompt_id for p in b0] == [0, 1] and [p.prompt_id for p in b1] == [2, 3]
    assert s.issued_as(b0)[0] == 0 and s.issued_as(b1)[0] == 0
    assert s.issued_as(b0)[1] != s.issued_as(b1)[1]
    assert s.issue(b"c", 2) == []  # batch 2 needs version 1
    for p in reversed(b1):  # batch 1 comes back first: nothing is served before batch 0
        s.accept(scored(p, 0))
    assert s.peek_batch(2) is None and s.take_batch(2, step=1) is None
    assert not s.publish_ready(1)
    seed = s.issued_as(b0)[1]
    assert s.requeue_from(b"a") == 2  # a sampler restarted: batch 0 goes out again, whole
    again = s.issue(b"c", 1)
    assert [p.prompt_id for p in again] == [0, 1] and s.issued_as(again) == (0, seed)
    s.accept(scored(again[1], 0))
    s.accept(scored(again[0], 0))
    assert [g.prompt.prompt_id for g in s.take_batch(2, step=1)] == [0, 1]
    assert s.publish_ready(1)  # batches 0 and 1 (version 0) are back
    assert not s.publish_ready(2)  # batch 2 is not even issued
    s.version = 1
    b2 = s.issue(b"a", 1)
    assert [p.prompt_id for p in b2] == [4, 5] and s.issued_as(b2)[0] == 1
    assert balanced(s)
