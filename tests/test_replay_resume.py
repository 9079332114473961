"""Rebuilding the replay buffer from a hand-made recording: what a crash at any moment leaves."""

from __future__ import annotations

import json

from actors.data.sources import make_task
from actors.replay.state import ReplayState
from actors.runtime.config import TaskConfig
from actors.runtime.recording import Recorder
from actors.runtime.rundir import checkpoint_position
from messages.rollout import Sample, ScoredGroup
from messages.tensor import Tensor

EMPTY = Tensor("int32", (0,), b"")
TABLES = ["prompts", "groups", "fates"]


def state(batch=2, staleness=4, capacity=100):
    return ReplayState(task=make_task(TaskConfig(name="repeat_letter"), seed=3),
                       groups_per_step=batch, max_staleness=staleness, capacity=capacity)


def scored(prompt, version=0):
    sample = Sample(EMPTY, Tensor("float32", (0,), b""), version, "a", "stop", 1.0)
    return ScoredGroup(prompt=prompt, prompt_ids=EMPTY, samples=[sample], sampler="s")


def flush(s: ReplayState, rec: Recorder, tables=TABLES, incarnation: str | None = None) -> None:
    """Move the state's rows to the recorder and write ``tables`` (a kill loses the others)."""
    for table, row in s.records:
        rec.append(table, row if incarnation is None else {**row, "incarnation": incarnation})
    s.records.clear()
    for t in TABLES:
        if t in tables:
            rec.writers[t].flush()
        else:
            rec.writers[t].rows = []


def ids(items):
    """Prompt ids of groups or prompts."""
    return [getattr(x, "prompt", x).prompt_id for x in items]


def balanced(s):
    c = s.counters()
    return c["issued"] == c["trained"] + c["dropped"] + c["in_flight"]


def run_three_steps(tmp_path):
    """Accept 8 (one of them stale), train steps 1-3 flushing before each batch."""
    s, rec = state(), Recorder(tmp_path, TABLES)
    prompts = s.issue(b"a", 10)
    for p in prompts[:8]:
        s.accept(scored(p, version=0))
    batches = {}
    for step in (1, 2, 3):
        if step == 3:
            s.version = 5  # the rest of the held groups are stale now, except a fresh one
            s.accept(scored(s.issue(b"a", 1)[0], version=5))
        batches[step] = ids(s.take_batch(2 if step < 3 else 1, step=step) or [])
        flush(s, rec)
        s.version = max(s.version, step)
    return s, rec, prompts, batches


def test_groups_trained_after_the_checkpoint_are_held_again_in_order(tmp_path):
    before, _, prompts, batches = run_three_steps(tmp_path)
    assert batches == {1: [0, 1], 2: [2, 3], 3: [10]}
    assert before.dropped["stale"] == 4  # groups 4..7 at version 0 against version 5

    s = state()
    r = s.restore(tmp_path, step=1, version=1)
    assert r is not None and (r.step, r.version, r.redone) == (1, 1, 3)
    assert ids(s.held) == [2, 3, 10]  # steps 2 and 3 in (step, position) order; drops stay
    assert s.trained == 2 and s.dropped == {"stale": 4} and s.version == 1
    assert ids(s.requeued) == [8, 9]  # issued, never came back
    assert s.issued == 11 and s.next_row == 11
    assert balanced(s)
    assert ids(s.take_batch(2, step=2)) == batches[2]  # step 2 is redone on the same batch
    again = s.issue(b"b", 5)
    assert ids(again)[:2] == [8, 9] and ids(again)[2:] == [11, 12, 13]  # no id repeats
    assert [p.messages for p in again[:2]] == [p.messages for p in prompts[8:10]]
    assert balanced(s)
    # the redone step is recorded again; only the new prompts are (the requeued ones were)
    assert [(t, r.get("group_id", r.get("prompt_id"))) for t, r in s.records] == [
        ("fates", 2), ("fates", 3), ("prompts", 11), ("prompts", 12), ("prompts", 13)]


def test_a_checkpoint_past_every_batch_holds_only_what_was_never_trained(tmp_path):
    run_three_steps(tmp_path)
    s = state()
    s.restore(tmp_path, step=3, version=3)
    assert s.trained == 5 and ids(s.held) == [] and ids(s.requeued) == [8, 9]
    assert s.counters()["dropped"] == 4 and balanced(s)


def test_restored_groups_are_the_exact_recorded_messages(tmp_path):
    s0, rec = state(), Recorder(tmp_path, TABLES)
    groups = [scored(p, version=0) for p in s0.issue(b"a", 3)]
    for g in groups:
        s0.accept(g)
    flush(s0, rec)
    s = state()
    s.restore(tmp_path, step=0, version=0)
    assert list(s.held) == groups


def test_kill_between_the_parts_of_one_flush(tmp_path):
    s0, rec = state(), Recorder(tmp_path, TABLES)
    ps = s0.issue(b"a", 4)
    for p in ps:
        s0.accept(scored(p))
    assert ids(s0.take_batch(2, step=1)) == [0, 1]
    flush(s0, rec)  # batch 1 served and trained
    s0.version = 1
    s0.accept(scored(s0.issue(b"a", 1)[0], version=1))  # group 4
    s0.issue(b"a", 1)  # prompt 5, never answered
    s0.take_batch(2, step=2)
    flush(s0, rec, tables=["prompts", "groups"])  # killed before the fates part: batch 2 unsent

    s = state()
    s.restore(tmp_path, step=1, version=1)
    assert ids(s.held) == [2, 3, 4] and s.trained == 2 and ids(s.requeued) == [5]
    assert ids(s.take_batch(2, step=2)) == [2, 3] and balanced(s)

    # killed after the prompts part only: group 4 was never durable, prompt 4 is issued again
    tmp2 = tmp_path / "b"
    s0, rec = state(), Recorder(tmp2, TABLES)
    for p in s0.issue(b"a", 2):
        s0.accept(scored(p))
    flush(s0, rec, tables=["prompts"])
    s = state()
    s.restore(tmp2, step=0, version=0)
    assert ids(s.held) == [] and ids(s.requeued) == [0, 1] and balanced(s)


def test_a_later_incarnations_record_of_a_step_replaces_the_earlier_one(tmp_path):
    # incarnation A trains steps 1 and 2 and is killed; B resumed from step 1, but groups came
    # back in another order there (a drop differed), so its step 2 is another batch; B reaches
    # step 2 and checkpoints, then is killed in step 3
    s0, rec = state(), Recorder(tmp_path, TABLES)
    for p in s0.issue(b"a", 6):
        s0.accept(scored(p))
    s0.take_batch(2, step=1)
    s0.take_batch(2, step=2)  # A's step 2: [2, 3]
    flush(s0, rec, incarnation="A")
    rec.append("fates", {"group_id": 2, "fate": "dropped", "reason": "filtered", "step": -1,
                         "position": -1, "served": 0, "version": 1, "incarnation": "B"})
    for pos, gid in enumerate([3, 4]):
        rec.append("fates", {"group_id": gid, "fate": "trained", "reason": "", "step": 2,
                             "position": pos, "served": 1, "version": 1, "incarnation": "B"})
    for pos, gid in enumerate([5]):
        rec.append("fates", {"group_id": gid, "fate": "trained", "reason": "", "step": 3,
                             "position": pos, "served": 1, "version": 2, "incarnation": "B"})
    rec.flush()

    s = state()
    r = s.restore(tmp_path, step=2, version=2)
    assert s.trained == 4 and s.dropped == {"filtered": 1}
    assert ids(s.held) == [5] and r.redone == 1 and r.missing_steps == ()
    assert balanced(s)


def test_nothing_recorded_leaves_a_fresh_state(tmp_path):
    s = state()
    assert s.restore(tmp_path) is None
    assert s.issued == 0 and s.next_row == 0 and not s.held


def test_checkpoint_position_reads_the_latest_trainer_state(tmp_path):
    assert checkpoint_position(tmp_path) == (0, 0)
    for step in (3, 12, 6):
        d = tmp_path / "checkpoints" / f"step_{step}"
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text(json.dumps({"step": step, "version": step}))
    (tmp_path / "checkpoints" / ".tmp_step_15_99").mkdir()  # a save killed half-way
    assert checkpoint_position(tmp_path) == (12, 12)


def test_reused_groups_wait_for_their_next_serve_again(tmp_path):
    s0, rec = state(batch=2, staleness=3), Recorder(tmp_path, TABLES)
    s0.reuse = 2
    for p in s0.issue(b"a", 6):
        s0.accept(scored(p))
    batches = {}
    for step in (1, 2, 3):
        batches[step] = ids(s0.take_batch(2, step=step))
        flush(s0, rec)
        s0.version = step
    assert batches == {1: [0, 1], 2: [0, 1], 3: [2, 3]}

    s = state(batch=2, staleness=3)
    s.reuse = 2
    s.restore(tmp_path, step=1, version=1)
    assert [(g.prompt.prompt_id, n) for g, n in s.reusable] == [(0, 1), (1, 1)]
    assert s.trained == 2 and s.served == 2 and s.reused == 0 and ids(s.held) == [2, 3]  # admission let 4 in (reuse 2)
    assert balanced(s)
    assert ids(s.take_batch(2, step=2)) == batches[2]
    assert ids(s.take_batch(2, step=3)) == batches[3]
    assert s.served == s.trained + s.reused == 6
