"""Validation without processes: the metrics (verl's, value for value, and pass@k), the rounds the
replay buffer keeps, the prompt set of a topology, and the answers the built-in scorers read."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from actors.job.config.load import apply_overrides, decode_topology
from actors.scoring.rules import INVALID, extract_answer
from actors.validation.metrics import (
    ScoredPrompt,
    named,
    pass_at_k,
    pass_sizes,
    source_metrics,
    subset_sizes,
    validation_metrics,
)
from actors.validation.prompts import validation_prompts, validation_sampling
from actors.validation.rounds import ValidationRounds
from messages.rollout import Prompt
from tests.helpers import sample_group


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 4) == 1.0  # fewer than k wrong: a k-subset always has a right one
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    # pass@1 is the share of correct samples; pass@k only grows with k
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 16)
        c = rng.randint(0, n)
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert values == sorted(values)
    assert pass_sizes(4) == [1, 2, 4] and pass_sizes(6) == [1, 2, 4, 6] and pass_sizes(1) == [1]
    assert subset_sizes(4) == [2, 4] and subset_sizes(5) == [2, 4, 5] and subset_sizes(1) == []


def test_metric_names_and_values_of_one_round():
    prompts = [ScoredPrompt("arith", [1.0, 0.0, 1.0, 1.0], ["3", "4", "3", "3"], [5, 6, 7, 8],
                            [False, False, False, True]),
               ScoredPrompt("arith", [0.0, 0.0, 0.0, 0.0], ["1", "2", "1", INVALID], [4, 4, 4, 4],
                            [False] * 4),
               ScoredPrompt("gsm", [1.0, 1.0], [], [9, 9], [False, False])]
    m = validation_metrics(prompts, pass_threshold=1.0)
    assert m["val-core/arith/reward/mean@4"] == pytest.approx((0.75 + 0.0) / 2)
    assert m["val-core/gsm/reward/mean@2"] == 1.0
    # verl's rule: mean, maj and best at the largest N are val-core, the rest val-aux
    assert "val-core/arith/reward/best@4/mean" in m and "val-core/arith/reward/maj@4/mean" in m
    assert "val-aux/arith/reward/worst@4/mean" in m and "val-aux/arith/reward/best@2/mean" in m
    assert "val-aux/arith/reward/std@4" in m
    assert not any(k.startswith("val-core/gsm/reward/maj") for k in m)  # no answers: no vote
    # the majority answer of prompt 1 is "3" (reward 1), of prompt 2 "1" (reward 0); maj@4 is
    # verl's bootstrap over draws with replacement, where "4" sometimes wins prompt 1's vote
    assert 0.35 < m["val-core/arith/reward/maj@4/mean"] < 0.5
    assert m["val-aux/arith/reward/pass@1"] == pytest.approx(0.375)
    assert m["val-aux/arith/reward/pass@4"] == pytest.approx(0.5)
    assert m["val-aux/arith/reward/pass@2"] == pytest.approx((1 - 0 + 0) / 2)  # C(1,2)=0
    assert m["val-aux/arith/response_length/mean"] == pytest.approx(42 / 8)
    assert m["val-aux/arith/response_length/max"] == 8
    assert m["val-aux/arith/response_length/clip_ratio"] == pytest.approx(1 / 8)
    assert m["val-aux/prompts"] == 3 and m["val-aux/samples"] == 10
    # a variable "acc" from the scorer becomes the core one (verl)
    acc = [ScoredPrompt("s", [0.5, 1.0], extras=[{"acc": 0.0}, {"acc": 1.0}])]
    named_acc = named(source_metrics(acc))
    assert "val-core/s/acc/mean@2" in named_acc and "val-aux/s/reward/mean@2" in named_acc


def test_metrics_equal_verls_process_validation_metrics():
    """Our per-source metrics against verl 0.9.1's own function on random rounds (several
    sources, N of 1, 3, 4, 8, answers on some sources, an ``acc`` extra on some prompts)."""
    from tests.verl_reference import load_verl

    verl = load_verl()
    if isinstance(verl, str):
        pytest.skip(verl)
    import verl.trainer.ppo.metric_utils as mu

    for seed in range(3):
        rng = random.Random(seed)
        prompts = []
        for i in range(24):
            n = rng.choice([1, 3, 4, 8])
            src = rng.choice(["a", "b", "c"])
            rewards = [rng.choice([0.0, 1.0, 0.5, -0.25]) for _ in range(n)]
            answers = [rng.choice(["1", "2", INVALID]) for _ in range(n)] if src != "b" else []
            extras = [{"acc": float(r > 0.4)} for r in rewards] if i % 3 == 0 else []
            prompts.append(ScoredPrompt(src, rewards, answers, extras=extras))
        ours = source_metrics(prompts)
        data_sources, uids, infos = [], [], {"reward": [], "pred": [], "acc": []}
        for i, p in enumerate(prompts):
            for j, r in enumerate(p.rewards):
                data_sources.append(p.data_source)
                uids.append(str(i))
                infos["reward"].append(r)
                infos["pred"].append(p.answers[j] if p.answers else None)
                infos["acc"].append(p.extras[j]["acc"] if p.extras else None)
        theirs = mu.process_validation_metrics(data_sources, uids, infos)
        assert set(theirs) == set(ours)
        for src, by_var in theirs.items():
            assert set(by_var) == set(ours[src])
            for var, metrics in by_var.items():
                assert set(metrics) == set(ours[src][var]), (src, var)
                for k, v in metrics.items():
                    assert abs(ours[src][var][k] - v) <= 1e-12, (seed, src, var, k)


def prompts(n: int) -> list[Prompt]:
    return [Prompt(i, [], "repeat_letter", "a") for i in range(n)]


def group_of(prompt_id: int, seconds: float = 1.0):
    g = sample_group()
    return msgspec.structs.replace(g, prompt=msgspec.structs.replace(g.prompt, prompt_id=prompt_id),
                                   generate_seconds=seconds)


def test_rounds_come_due_at_the_start_every_k_steps_and_at_the_end():
    r = ValidationRounds(prompts(3), every=5, before_training=True, total_steps=12)
    r.advance(0)
    assert r.active is not None and r.active.step == 0
    step, got = r.issue(b"s0", 2, now=1.0)
    assert step == 0 and [p.prompt_id for p in got] == [0, 1]
    assert r.issue(b"s1", 2, now=1.5)[1][0].prompt_id == 2
    assert r.issue(b"s1", 2, now=1.6) == (-1, [])  # all out
    r.advance(1)
    r.advance(5)  # due while round 0 runs: it waits
    assert r.active.step == 0 and r.queued is not None and r.queued.step == 5
    assert r.accept(0, [group_of(0), group_of(1)]) is None
    done = r.accept(0, [group_of(2, 2.0)])
    assert done is not None and done.step == 0 and done.complete and done.generate_s == 3.0
    assert r.active.step == 5 and r.queued is None and r.rounds == 1
    r.advance(10)  # while 5 runs
    r.advance(12)  # the last step replaces 10, which never started
    assert r.queued.step == 12 and r.skipped == 1
    assert [s for s in range(0, 13) if r.due(s)] == [5, 10, 12]  # 0 is recorded now
    # nothing due without prompts, without every (but the start), or already recorded
    assert not ValidationRounds([], 5, True, 12).due(0)
    only_start = ValidationRounds(prompts(1), 0, True, 12)
    assert [s for s in range(13) if only_start.due(s)] == [0]
    resumed = ValidationRounds(prompts(1), 5, True, 12, recorded={0, 5})
    resumed.advance(5)  # a resume at the checkpoint of step 5, whose round is recorded
    assert resumed.active is None
    resumed.advance(10)
    assert resumed.active.step == 10


def test_round_prompts_come_back_after_a_sampler_restart_and_strays_are_rejected():
    r = ValidationRounds(prompts(4), every=0, before_training=True, total_steps=5)
    r.advance(0)
    r.issue(b"s0", 2, now=0.0)
    r.issue(b"s1", 2, now=0.0)
    assert r.requeue_from(b"s0") == 2 and r.out == 2
    step, again = r.issue(b"s2", 4, now=1.0)
    assert [p.prompt_id for p in again] == [0, 1]
    assert r.accept(0, [group_of(0), group_of(0)]) is None  # the second one is a duplicate
    assert r.rejected == 1
    assert r.accept(3, [group_of(1)]) is None and r.rejected == 2  # not the running round
    r.accept(0, [group_of(1), group_of(2)])
    done = r.accept(0, [group_of(3)])
    assert done is not None and sorted(done.done) == [0, 1, 2, 3]
    assert r.issued == 6 and r.returned == 4
    s = r.status()
    assert s["val_step"] == -1 and s["val_rounds"] == 1


def test_prompt_set_of_a_topology(tmp_path):
    import json

    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n"
                            for i in range(10)))
    topo = decode_topology(apply_overrides({}, [
        "validation.temperature=0.6", "validation.n=2",
        f'validation.datasets=[{{builtin="arithmetic", size=5}}, {{path="{data}", '
        f'prompt_key="question", answer_key="answer", data_source="exact", size=3, '
        f'shuffle=false}}]']))
    got = validation_prompts(topo)
    assert [p.prompt_id for p in got] == list(range(8))
    assert [p.data_source for p in got] == ["arithmetic"] * 5 + ["exact"] * 3
    assert [p.ground_truth for p in got[5:]] == ["0", "1", "2"]
    # built-ins draw with their own seed: not the training task's first rows
    from actors.data.sources import make_task
    train = make_task(topo.task.__class__(name="arithmetic"), topo.run.seed)
    assert [p.messages for p in got[:5]] != [train.prompt(i, i).messages for i in range(5)]
    params = validation_sampling(topo)
    assert params.temperature == 0.6 and params.max_tokens == topo.sampler.max_tokens


def test_built_in_scorers_read_answers_for_majority_votes():
    assert extract_answer("arithmetic", "3 + 4 is 7.") == "7"
    assert extract_answer("arithmetic", "no idea") == INVALID
    assert extract_answer("gsm8k", "so #### 1,234", method="strict") == "1234"
    assert extract_answer("gsm8k", "it is 12 or 13", method="flexible") == "13"
    assert extract_answer("math", r"thus \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_answer("answer_tag", "<answer> 5 </answer>") == "5"
    assert extract_answer("calculator", "x") == ""  # a rule reading no answer for votes
