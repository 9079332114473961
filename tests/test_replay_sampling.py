"""Replay buffer: DAPO dynamic sampling, group reuse and the prompt length filter, with the
counters that prove nothing is lost and the recording rows each event appends."""

import random

import pytest

from actors.data.sources import make_task
from actors.replay.state import ReplayState
from actors.runtime.config import TaskConfig
from actors.runtime.versions import group_version
from messages.rollout import Sample, ScoredGroup
from messages.tensor import Tensor

EMPTY = Tensor("int32", (0,), b"")


def state(staleness=1, batch=2, capacity=100, **kw):
    return ReplayState(task=make_task(TaskConfig(), seed=0), groups_per_step=batch,
                       max_staleness=staleness, capacity=capacity, **kw)


def scored(prompt, version, rewards=(0.0, 1.0)):
    samples = [Sample(EMPTY, Tensor("float32", (0,), b""), version, "", "stop", r) for r in rewards]
    return ScoredGroup(prompt=prompt, prompt_ids=EMPTY, samples=samples, sampler="s")


def balanced(s):
    c = s.counters()
    return (c["issued"] == c["trained"] + c["dropped"] + c["in_flight"]
            and c["served"] == c["trained"] + c["reused"])


def fates(s):
    return [row for table, row in s.records if table == "fates"]


# dynamic sampling


def test_filtered_group_is_dropped_recorded_and_lets_a_replacement_in():
    s = state(staleness=0, batch=2, filter_groups=True)
    a, b = s.issue(b"x", 5)
    assert s.issue(b"x", 5) == []
    assert s.accept(scored(a, 0, rewards=(1.0, 1.0)))  # no signal: filtered
    assert s.accept(scored(b, 0))
    c = s.counters()
    assert c["dropped_filtered"] == 1 and c["dropped"] == 1 and c["held"] == 1
    assert ("groups", a.prompt_id) in [(t, r["group_id"]) for t, r in s.records if t == "groups"]
    assert fates(s) == [{"group_id": a.prompt_id, "fate": "dropped", "reason": "filtered",
                         "step": -1, "position": -1, "served": 0, "version": 0}]
    assert balanced(s)
    (replacement,) = s.issue(b"x", 5)  # the bound opened by one
    assert replacement.prompt_id == 2
    assert s.take_batch(2, step=1) is None
    s.accept(scored(replacement, 0))
    assert [g.prompt.prompt_id for g in s.take_batch(2, step=1)] == [1, 2]
    assert s.batch_stats["step_filtered"] == 1
    assert balanced(s)
    s.version = 1
    s.issue(b"x", 1)
    assert s.take_batch(2, step=2) is None and s.batch_stats["step_filtered"] == 1  # unchanged


def test_filtering_off_keeps_equal_reward_groups():
    s = state(staleness=0, batch=1)
    (p,) = s.issue(b"x", 1)
    s.accept(scored(p, 0, rewards=(0.0, 0.0)))
    assert s.counters()["dropped"] == 0 and len(s.take_batch(1)) == 1


def test_too_many_filtered_groups_stop_the_job():
    s = state(staleness=3, batch=2, filter_groups=True, max_filtered=2)
    ps = s.issue(b"x", 8)
    s.accept(scored(ps[0], 0, rewards=(0.0, 0.0)))
    s.accept(scored(ps[1], 0, rewards=(1.0, 1.0)))
    with pytest.raises(RuntimeError, match="3 groups filtered.*max_num_gen_batches"):
        s.accept(scored(ps[2], 0, rewards=(0.5, 0.5)))


# reuse


def test_reused_group_is_served_again_in_the_next_batch_and_counted():
    s = state(staleness=1, batch=2, reuse=2)
    assert s.admissible() == 2  # (η + v + 1)·B = 4 serves = 2 groups of 2 serves
    ps = s.issue(b"x", 5)
    for p in ps:
        s.accept(scored(p, 0))
    first = s.take_batch(2, step=1)
    c = s.counters()
    assert (c["trained"], c["served"], c["reused"], c["reusable"], c["in_flight"]) == (2, 2, 0, 2, 0)
    assert balanced(s)
    s.version = 1
    assert s.admissible() == 1  # 6 serves − 2 served − 2 left to serve = 2 serves
    (p2,) = s.issue(b"x", 5)
    s.accept(scored(p2, 1))
    second = s.take_batch(2, step=2)
    assert [g.prompt.prompt_id for g in second] == [g.prompt.prompt_id for g in first]
    assert s.batch_stats["step_reused"] == 2 and s.batch_stats["age_served_max"] == 2
    assert s.batch_stats["age_versions_mean"] == 1
    c = s.counters()
    assert (c["trained"], c["served"], c["reused"], c["reusable"]) == (2, 4, 2, 0)
    assert [(f["group_id"], f["served"], f["step"]) for f in fates(s)] == [
        (0, 1, 1), (1, 1, 1), (0, 2, 2), (1, 2, 2)]
    assert balanced(s)


def test_reusable_group_past_max_staleness_is_retired_not_dropped():
    s = state(staleness=1, batch=1, reuse=2)
    (p,) = s.issue(b"x", 1)
    s.accept(scored(p, 0))
    s.take_batch(1, step=1)
    s.version = 2  # two versions past the one that generated it
    assert s.take_batch(1, step=2) is None
    c = s.counters()
    assert c["retired"] == 1 and c["reusable"] == 0 and c["dropped"] == 0 and c["trained"] == 1
    assert fates(s)[-1] == {"group_id": 0, "fate": "retired", "reason": "stale", "step": -1,
                            "position": -1, "served": 1, "version": 2}
    assert balanced(s)


@pytest.mark.parametrize(("staleness", "reuse", "filtering"),
                         [(0, 1, False), (1, 1, True), (1, 2, False), (2, 3, True), (3, 2, True)])
def test_every_batch_is_served_and_counters_balance(staleness, reuse, filtering):
    """A well-behaved job (samplers return every prompt at the current version) never stalls:
    the admission bound always lets in enough groups for the next batch; no group is served
    twice in a batch, more than ``reuse`` times, or past ``max_staleness``."""
    rng = random.Random(staleness * 10 + reuse)
    B = 4
    s = state(staleness=staleness, batch=B, capacity=3 * B, reuse=reuse, filter_groups=filtering)
    serves: dict[int, int] = {}
    for step in range(1, 60):
        batch = None
        for _ in range(50):  # rounds of generation until the batch can be served
            for p in s.issue(b"x", 100):
                rewards = (1.0, 1.0) if filtering and rng.random() < 0.3 else (0.0, rng.random())
                s.accept(scored(p, s.version, rewards))
                assert balanced(s)
            batch = s.take_batch(B, step=step)
            if batch is not None:
                break
        assert batch is not None, f"stalled at step {step}: {s.counters()}"
        ids = [g.prompt.prompt_id for g in batch]
        assert len(set(ids)) == B
        for g in batch:
            assert s.version - group_version(g) <= staleness
            serves[g.prompt.prompt_id] = serves.get(g.prompt.prompt_id, 0) + 1
        assert max(serves.values()) <= reuse
        assert s.counters()["in_flight"] + s.counters()["reusable"] <= 3 * B
        s.version += 1
        assert balanced(s)
    c = s.counters()
    assert c["served"] == 59 * B and c["trained"] == len(serves)
    if reuse > 1:
        assert c["reused"] > 0.5 * c["served"] * (reuse - 1) / reuse


# prompt length filter


def test_long_prompts_are_skipped_and_counted_never_issued():
    long_ = lambda p: 100 if int(p.extra_info["a"]) > 5 else 3  # noqa: E731
    s = state(staleness=0, batch=6, max_prompt_length=10, prompt_length=long_)
    prompts = s.issue(b"x", 6)
    assert len(prompts) == 6 and all(int(p.extra_info["a"]) <= 5 for p in prompts)
    assert [p.prompt_id for p in prompts] == list(range(6))
    c = s.counters()
    assert c["filtered_prompts"] == s.next_row - 6 > 0 and c["issued"] == 6
    assert balanced(s)
    rows = [r["row"] for t, r in s.records if t == "prompts"]
    assert [p.extra_info["index"] for p in prompts] == rows  # the rows the prompts came from
    for p in prompts:
        s.accept(scored(p, 0))
    s.take_batch(6, step=1)
    assert s.batch_stats["step_filtered_prompts"] == c["filtered_prompts"]


def test_every_prompt_too_long_is_an_error():
    s = state(max_prompt_length=1, prompt_length=lambda p: 5)
    with pytest.raises(ValueError, match="longer than task.max_prompt_length = 1"):
        s.issue(b"x", 1)
