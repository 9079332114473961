"""A whole multi-turn job on the tiny random model: it learns to call its tool, a tool that
hangs on some calls never stalls it, the counters balance, and the offline tools read it.

The tiny model's tokenizer has ``<lookup>`` and ``</lookup>`` as single tokens (``xml``
parser: the text inside the tag is the tool's query), so a random model calls the tool by
chance in about a quarter of its samples. The reward is a format shaping term (1.0 for a
sample whose tool call succeeded): what the job must show is that calls go up with it, through
the whole pipeline (tool tokens masked, rewards on the model's tokens). The tool hangs on a
query starting with x, y or z: the call is killed at ``agent.tool_timeout_s`` and the model
reads a timeout error.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from actors.offline.rerun import rerun
from actors.runtime.recording import decode_group, read_table
from tests.jobs import ROOT, actor_pids, balanced, command, metrics, status_lines
from tests.tiny_model import build_tiny_model

STEPS = 20  # tool calls and reward each rise by about 0.37 in 20 steps (0.2 is asked)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("agent_job")
    model = build_tiny_model(base / "model", words=("<lookup>", "</lookup>"))
    (base / "tools.py").write_text(textwrap.dedent('''
        import time


        def lookup(query: str) -> str:
            """Look a word up.

            Args:
                query: the word.
            """
            if query[:1] in ("x", "y", "z"):
                time.sleep(600)  # hangs: killed at agent.tool_timeout_s
            return "ok " + query[:3]
    '''))
    (base / "reward.py").write_text(textwrap.dedent('''
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            turns = (extra_info or {}).get("turns", [])
            return float(any(t["role"] == "tool" and not t["error"] for t in turns))
    '''))
    run = base / "run"
    res = subprocess.run(command(
        model, run, f"learner.total_steps={STEPS}", "sampler.max_tokens=48",
        f"agent.tools=[{{path='{base / 'tools.py'}', name='lookup'}}]", "agent.parser=xml",
        "agent.max_turns=3", "agent.tool_timeout_s=1", "agent.processes=2",
        f"reward.functions=[{{path='{base / 'reward.py'}'}}]", "learner.save_every=15"),
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return run


def first_last(rows: list[dict], key: str) -> tuple[float, float]:
    values = [r[key] for r in rows]
    return sum(values[:5]) / 5, sum(values[-5:]) / 5


def test_it_learns_to_call_the_tool_and_a_hanging_tool_never_stalls_it(run_dir):
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    share = first_last(rows, "agent/tool_call_share")
    reward = first_last(rows, "critic/score/mean")
    assert share[1] > share[0] + 0.2, f"tool calls did not go up: {share}"
    assert reward[1] > reward[0] + 0.2, f"reward did not go up: {reward}"
    assert sum(r["agent/tool_timeouts"] for r in rows) >= 1  # the tool hung, the job went on
    for r in rows:
        assert balanced(r)
        assert r["agent/tool_timeouts"] <= r["agent/tool_errors"] <= r["agent/tool_calls"]
        assert 1 <= r["agent/num_turns/mean"] <= r["agent/num_turns/max"] <= 3
        assert 0 < r["agent/tool_token_share"] < 1
    # the sampler's own counters, in the runner's record
    last = status_lines(run_dir)[-1]
    assert last["outcome"] == "finished" and set(last["returncodes"].values()) == {0}
    sampler = last["sampler-0"]
    assert sampler["tool_calls"] >= sum(r["agent/tool_calls"] for r in rows)
    assert sampler["tool_calls"] >= sampler["tool_errors"] >= sampler["tool_timeouts"] >= 1
    assert not actor_pids(run_dir)


def test_the_recording_keeps_every_turn(run_dir):
    groups = [decode_group(r["message"]) for r in read_table(run_dir, "groups").to_pylist()]
    calls = 0
    for g in groups:
        assert g.sampling is not None and g.sampling.max_tokens == 48
        for s in g.samples:
            ids = torch.frombuffer(bytearray(s.response_ids.data), dtype=torch.int32)
            mask = torch.frombuffer(bytearray(s.loss_mask.data), dtype=torch.int8)
            assert len(ids) <= 48  # the budget counts every token, the tools' included
            assert s.finish_reason != "length" or len(ids) == 48
            assert s.turns[-1].role == "assistant" or s.finish_reason == "length"
            # the spans tile the response; the loss mask is 0 on exactly the tools' spans
            assert s.turns[0].start == 0 and s.turns[-1].end == len(ids)
            for a, b in zip(s.turns, s.turns[1:], strict=False):
                assert a.end == b.start
            for t in s.turns:
                own = t.role == "assistant"
                assert bool((mask[t.start:t.end] == int(own)).all())
                calls += t.role == "tool"
                if t.role == "tool":
                    assert t.name == "lookup" and (t.error == "") == (t.failure == "")
    assert calls > 100


def test_rerun_of_a_multi_turn_step_is_exact(run_dir):
    out = io.StringIO()
    assert rerun(run_dir, STEPS, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "checkpoints/step_15" in text and "result: match — all" in text
    assert "agent/tool_call_share" in text and "agent/tool_latency_s/p99" in text


def test_inspect_shows_the_turns(run_dir, tmp_path):
    res = subprocess.run([sys.executable, "runner.py", "inspect", str(run_dir), "--plots",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "multi-turn" in res.stdout and "samples calling a tool" in res.stdout
    assert "[model" in res.stdout and "[tool " in res.stdout and "lookup(" in res.stdout
