"""A whole job whose rollouts are a user's agent function against the sampler's endpoint
(``[agent.rollout]``), on the tiny random model: the function makes two chat calls per episode
with the real ``openai`` client (the second sends the first answer back with a new user turn,
so the two merge into one sample token in and token out) and returns its own reward; the job
learns it, the counters balance, the recording keeps every turn, and ``rerun --step`` is exact.

A second job kills the sampler with SIGKILL while episodes are between their two calls:
nothing of them is recorded, the runner restarts the sampler, their prompts are issued again,
and every recorded group is whole.

The reward is the share of the answers' characters among ``a`` to ``m`` (about a third by
chance on the random model's character vocabulary): smooth enough to go up in a short run.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from actors.offline.recorded import open_run
from actors.offline.rerun import rerun
from actors.runtime.recording import decode_group, read_table
from tests.jobs import (
    FAST,
    ROOT,
    actor_pids,
    alive,
    balanced,
    command,
    metrics,
    pids_of,
    status_lines,
    validations,
)
from tests.tiny_model import build_tiny_model

STEPS = 16  # the reward rises by about 0.35 in 15 steps (0.1 is asked)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("endpoint_job")
    model = build_tiny_model(base / "model")
    (base / "my_agent.py").write_text(textwrap.dedent('''
        LOW = set("abcdefghijklm")


        def share(text):
            return sum(c in LOW for c in text) / max(len(text), 1)


        async def rollout(client, row):
            messages = list(row["prompt"])
            first = await client.chat.completions.create(model="policy", messages=messages,
                                                         max_tokens=6)
            answer = first.choices[0].message.content
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "more"}]
            second = await client.chat.completions.create(model="policy", messages=messages)
            return (share(answer) + share(second.choices[0].message.content)) / 2
    '''))
    run = base / "run"
    res = subprocess.run(command(
        model, run, f"learner.total_steps={STEPS}", "sampler.max_tokens=16",
        f"agent.rollout.path={base / 'my_agent.py'}", "agent.processes=4",
        "learner.save_every=10", 'validation.datasets=[{builtin="repeat_letter", size=2}]',
        "validation.every=8"), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return run


def first_last(rows: list[dict], key: str) -> tuple[float, float]:
    values = [r[key] for r in rows]
    return sum(values[:5]) / 5, sum(values[-5:]) / 5


def test_it_learns_the_functions_reward_and_the_counters_balance(run_dir):
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    reward = first_last(rows, "critic/score/mean")
    print(f"reward first/last 5 steps: {reward[0]:.3f} / {reward[1]:.3f}")
    assert reward[1] > reward[0] + 0.1, f"reward did not go up: {reward}"
    assert all(balanced(r) for r in rows)
    last = status_lines(run_dir)[-1]
    assert last["outcome"] == "finished" and set(last["returncodes"].values()) == {0}
    sampler = last["sampler-0"]
    assert sampler["endpoint_episodes"] >= STEPS and sampler["endpoint_episode_errors"] == 0
    assert sampler["endpoint_calls"] == 2 * sampler["endpoint_episodes"]
    assert not actor_pids(run_dir)
    # live validation runs the same function: its rewards are shares, not the scorer's 0 or 1
    assert [v["step"] for v in validations(run_dir)] == [0, 8, 16]
    rewards = [r for row in read_table(run_dir, "validation").to_pylist() for r in row["rewards"]]
    assert len(rewards) == 3 * 2 * 4 and any(0 < r < 1 for r in rewards), rewards


def test_the_recording_keeps_both_calls_in_one_sample(run_dir):
    groups = [decode_group(r["message"]) for r in read_table(run_dir, "groups").to_pylist()]
    merged = 0
    for g in groups:
        for s in g.samples:
            ids = torch.frombuffer(bytearray(s.response_ids.data), dtype=torch.int32)
            mask = torch.frombuffer(bytearray(s.loss_mask.data), dtype=torch.int8)
            assert s.turns[0].start == 0 and s.turns[-1].end == len(ids)
            for a, b in zip(s.turns, s.turns[1:], strict=False):
                assert a.end == b.start
            for t in s.turns:
                assert bool((mask[t.start:t.end] == int(t.role == "assistant")).all())
            merged += [t.role for t in s.turns] == ["assistant", "user", "assistant"]
            assert 0.0 <= s.reward <= 1.0 and not s.reward_error
    assert merged >= len(groups)  # most episodes' two calls are one sample


def test_rerun_of_an_endpoint_step_is_exact(run_dir):
    out = io.StringIO()
    assert rerun(run_dir, STEPS, out=out) == 0, out.getvalue()
    assert "result: match — all" in out.getvalue()


def test_offline_validate_runs_the_same_rollout_function(run_dir, tmp_path):
    out = tmp_path / "val.json"
    res = subprocess.run([sys.executable, "runner.py", "validate", str(run_dir), "--checkpoint",
                          "step_10", "validation.n=2", "--out", str(out),
                          'validation.datasets=[{builtin="repeat_letter", size=4}]'],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["metrics"]["val-aux/samples"] == 8
    rewards = [r for s in got["samples"] for r in s["rewards"]]
    errors = [e for s in got["samples"] for e in s["errors"]]
    # the function's reward (the share of characters among a to m), not the repeat_letter
    # scorer's (the share of the asked letter): a share strictly between 0 and 1, or (a policy
    # that learned the function, 1.0 each) not what that scorer gives the same completions
    from actors.scoring.rules import repeat_letter_score

    assert not any(errors) and all(0 <= r <= 1 for r in rewards)
    rule = [repeat_letter_score(s["data_source"], c, s["ground_truth"], None)
            for s in got["samples"] for c in s["completions"]]
    assert any(0 < r < 1 for r in rewards) or rewards != rule, (rewards, rule)


BLOCKING_AGENT = '''
import asyncio
import os
from pathlib import Path

FLAG = Path({flag!r})


async def rollout(client, row):
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    if FLAG.exists():  # mid-episode: one call served, the second waits for FLAG to go
        (FLAG.parent / f"in_flight-{{os.getpid()}}").touch()
        while FLAG.exists():
            await asyncio.sleep(0.05)
    messages += [{{"role": "assistant", "content": first.choices[0].message.content}},
                 {{"role": "user", "content": "more"}}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return 1.0
'''


def test_a_sampler_killed_mid_episode_leaves_nothing_half_recorded(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    flag = tmp_path / "block"
    flag.touch()
    agent = tmp_path / "blocking_agent.py"
    agent.write_text(BLOCKING_AGENT.format(flag=str(flag)))
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    cmd = command(model, run_dir, *FAST, "learner.total_steps=6", "sampler.max_tokens=16",
                  f"agent.rollout.path={agent}", "agent.processes=2")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("in_flight-*")):  # an episode is between its calls now
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        children = [int(p.name.split("-")[1]) for p in tmp_path.glob("in_flight-*")]
        (sampler,) = pids_of(run_dir, "sampler")
        os.kill(sampler, signal.SIGKILL)
        flag.unlink()  # the restarted sampler's episodes run through
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()[-4000:]
    status = status_lines(run_dir)
    (exited,) = [line for line in status if line["event"] == "exited"]
    assert exited["actor"] == "sampler-0" and exited["returncode"] == -signal.SIGKILL
    assert status[-1]["sampler-0"]["restarts"] == 1
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(balanced(r) for r in rows)
    n = open_run(run_dir).topology.algorithm.n
    for r in read_table(run_dir, "groups").to_pylist():
        g = decode_group(r["message"])
        # whole groups only: every episode's samples (one more per branch, when a call's text
        # did not extend the previous call's exactly: agent.rollout.branches = "train")
        assert len(g.samples) >= n
        for s in g.samples:  # whole episodes only: the function returned after its second call
            assert s.turns[-1].role == "assistant" and not any(t.failure for t in s.turns)
            assert s.reward == 1.0 and not s.reward_error
    deadline = time.monotonic() + 10  # the killed sampler's episode children follow it
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children)
    assert not actor_pids(run_dir)
