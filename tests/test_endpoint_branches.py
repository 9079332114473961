"""A whole job whose user agent branches (``agent.rollout.branches = "train"``, the default): in
about half of the episodes the second call does not send the first answer back but a summary
of it as a new conversation, so the episode yields two samples (each on its own prompt) and its
group has more than ``n``. The groups of unequal size are trained on (GRPO normalised over each
group's own samples: ``kernels/advantages/unequal.py``, compared with verl in
``tests/test_verl_parity.py``), recorded whole, shown by ``inspect`` and rerun exactly by
``rerun --step``. The tiny random model, the real ``openai`` client in sandboxed children."""

from __future__ import annotations

import io
import subprocess
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch

from actors.data.chat import ChatTokenizer
from actors.offline.inspection import inspect_run
from actors.offline.recorded import open_run
from actors.offline.rerun import rerun
from actors.offline.rescore import score_recorded
from actors.runtime.config import RewardFunction
from actors.runtime.recording import decode_group, read_table
from tests.jobs import ROOT, balanced, command, metrics, status_lines
from tests.tiny_model import build_tiny_model

STEPS = 8  # about half the episodes branch: unequal groups and summaries in every run
N = 4  # algorithm.n


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("endpoint_branches")
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
            if sum(map(ord, answer)) % 2:  # summarised (about half the episodes): a new conversation
                messages = [{"role": "user", "content": "summary: " + answer[:4]}]
            else:  # the answer sent back: the same sample goes on
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": "more"}]
            second = await client.chat.completions.create(model="policy", messages=messages)
            return (share(answer) + share(second.choices[0].message.content)) / 2
    '''))
    run = base / "run"
    res = subprocess.run(command(
        model, run, f"learner.total_steps={STEPS}", "sampler.max_tokens=16", f"algorithm.n={N}",
        f"agent.rollout.path={base / 'my_agent.py'}", "agent.processes=4",
        "validation.every=0"), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return run


def test_branched_episodes_train_in_groups_of_unequal_size(run_dir):
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(balanced(r) for r in rows)
    first = sum(r["critic/score/mean"] for r in rows[:5]) / 5
    last = sum(r["critic/score/mean"] for r in rows[-5:]) / 5
    print(f"reward first/last 5 steps: {first:.3f} / {last:.3f}")
    status = status_lines(run_dir)[-1]
    assert status["outcome"] == "finished"
    sampler = status["sampler-0"]
    assert sampler["endpoint_branches"] > 0 and sampler["endpoint_episode_errors"] == 0
    groups = [decode_group(r["message"]) for r in read_table(run_dir, "groups").to_pylist()]
    tok = ChatTokenizer(run_dir.parent / "model").tokenizer
    sizes = [len(g.samples) for g in groups]
    summaries = 0
    assert min(sizes) >= N and len(set(sizes)) > 1, sizes  # unequal groups, none short
    for g in groups:
        for s in g.samples:
            ids = torch.frombuffer(bytearray(s.response_ids.data), dtype=torch.int32)
            mask = torch.frombuffer(bytearray(s.loss_mask.data), dtype=torch.int8)
            assert s.turns[0].start == 0 and s.turns[-1].end == len(ids)
            for t in s.turns:  # the model's own tokens only are trained on
                assert bool((mask[t.start:t.end] == int(t.role == "assistant")).all())
            assert 0.0 <= s.reward <= 1.0 and not s.reward_error
        # each sample on its own prompt: the group's (the dataset prompt's tokens) or, for a
        # call that rendered another conversation, its own (Sample.prompt_ids); a branched
        # episode's two samples: the first call's answer, then the summary's answer; both carry
        # the episode's reward; every response keeps to the budget (sampler.max_tokens = 16)
        roles = [[t.role for t in s.turns] for s in g.samples]
        rest = roles
        assert all(r in (["assistant"], ["assistant", "user", "assistant"]) for r in rest), roles
        group_prompt = torch.frombuffer(bytearray(g.prompt_ids.data), dtype=torch.int32)
        for j, s in enumerate(g.samples):
            assert s.response_ids.shape[0] <= 16
            if s.prompt_ids is None:
                continue
            own = torch.frombuffer(bytearray(s.prompt_ids.data), dtype=torch.int32)
            assert not torch.equal(own, group_prompt)
            if "summary" in tok.decode(own.tolist()):  # the tiny vocabulary has no ":"
                summaries += 1
                assert rest[j] == rest[j - 1] == ["assistant"]
                assert g.samples[j - 1].reward == s.reward and g.samples[j - 1].reward_of == j
            if s.reward_of >= 0:  # two calls an episode: its last sample comes next (a call
                # whose text did not extend the previous one exactly branches too: the
                # episode's second sample then holds the conversation in its own prompt)
                assert s.reward_of == j + 1 and g.samples[j + 1].reward_of == -1
                assert s.reward == g.samples[j + 1].reward and rest[j] == ["assistant"]
    assert summaries > 0
    print(f"group sizes (n = {N}): {sorted(sizes)}; summarised episodes: {summaries}")


def test_rerun_and_inspect_of_a_step_with_unequal_groups(run_dir):
    run = open_run(run_dir)
    step = next(s for s in reversed(run.steps)
                if len({len(g.samples) for g in run.batch_groups(s)}) > 1)
    out = io.StringIO()
    assert rerun(run_dir, step, out=out) == 0, out.getvalue()
    assert "result: match — all" in out.getvalue(), out.getvalue()
    text = io.StringIO()
    assert inspect_run(run_dir, step=step, plots=str(run_dir / "plots2"), out=text) == 0
    total = sum(len(g.samples) for g in run.batch_groups(step))
    assert f"samples of step {step} (of {total})" in text.getvalue(), text.getvalue()


def test_rescore_scores_a_branched_episode_as_the_live_job_does(run_dir, tmp_path):
    """``rerun --rescore`` goes through the live scoring path (``Rollout.score_group``): an
    episode's earlier segment takes the score of the episode's last sample, as live."""
    fn = tmp_path / "length.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                  "    return len(solution_str) / 100\n")
    run = open_run(run_dir)
    groups = run.batch_groups(run.steps[-1])
    topo = msgspec.structs.replace(run.topology, reward=msgspec.structs.replace(
        run.topology.reward, functions=[RewardFunction(path=str(fn))]))
    again = score_recorded(topo, 16, groups)
    shared = 0
    for g, h in zip(groups, again, strict=True):
        for s, t in zip(g.samples, h.samples, strict=True):
            assert t.reward_of == s.reward_of
            own = h.samples[s.reward_of] if s.reward_of >= 0 else t
            assert t.reward == own.reward == len(own.text) / 100
            shared += s.reward_of >= 0
    assert shared
