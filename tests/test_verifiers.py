"""verifiers environments as a task source: prompts from the taskset (system prompt and few-shot
turns as its tasks give them), scores equal to the library's own rubric on every kind of reply
(scored through the reward worker's children, each reward under its name), a bad name, arg,
package or kind of environment one line at ``check``, and a whole tiny job that trains,
validates and reruns exactly on one whose reward raises on some tasks.

The fixture environment is ``tests/verifiers_addition.py``, in memory. verifiers 0.4.0 pins
``openai<3``, which the dev extra's openai-agents refuses, so ``.ci/setup.sh --tests`` installs
it the way it installs verl: without its declared dependencies into ``.venv/verifiers-0.4.0``
(plus the ones the venv lacks), put on the path here and in the job's processes.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import textwrap

import pytest

from actors.data.verifiers_env import VerifiersTask, environment, spec_of
from actors.job.config.load import apply_overrides, decode_topology
from actors.offline.rerun import rerun
from actors.runtime.config import DatasetConfig, VerifiersSource
from actors.runtime.recording import decode_group, read_table
from actors.scoring.items import ScoreItem
from actors.scoring.rules import scorer_of
from actors.scoring.scorer import Scoring
from tests.jobs import ROOT, balanced, command, metrics, validations

VF_DIR = ROOT / ".venv" / "verifiers-0.4.0"
if VF_DIR.is_dir() and str(VF_DIR) not in sys.path:
    sys.path.append(str(VF_DIR))
vf = pytest.importorskip("verifiers.v1", reason="verifiers is an optional extra: bash "
                                                ".ci/setup.sh --tests installs it")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
    os.environ.get("PYTHONPATH"), str(VF_DIR)]))}
FIXTURE = "tests/verifiers_addition.py"


def replies(answer: str) -> list[str]:
    """Right, right with text and spaces around, wrong, malformed (no tags), two tags (the last
    counts for ``correct``, ``formatted`` wants one), empty."""
    return [f"<answer>{answer}</answer>", f"so... <answer> {answer} </answer> done",
            "<answer>-1</answer>", f"the answer is {answer}",
            f"<answer>1</answer> then <answer>{answer}</answer>", ""]


async def library_score(task, reply: str):
    """The library's own: the reply committed to a trace as verifiers records a model's turn,
    then ``Task.score`` (on asyncio, verifiers' loop)."""
    from verifiers.v1.graph import prepare_turn
    from verifiers.v1.harnesses.null import NullHarness, NullHarnessConfig
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, TraceTask

    system, prompt = NullHarness(NullHarnessConfig(id="null")).resolve_prompt(task.data)
    messages = ([vf.SystemMessage(content=system)] if system else []) + (
        [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt))
    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                    hash=task.hash),
                     state=state_cls(type(task))(), agent=AgentInfo(config=vf.AgentConfig()))
    prepare_turn(trace, messages).commit(vf.Response(
        id="r", created=0, model="m", message=vf.AssistantMessage(content=reply),
        finish_reason="stop"))
    await task.score(trace)
    return trace


@pytest.mark.anyio
async def test_scores_equal_the_librarys_own(monkeypatch):
    """120 replies (10 tasks, with and without few-shot turns, six replies each) through the
    reward worker's scoring, in its children, against verifiers' own."""
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])  # for the scoring children
    items, expected = [], []
    for few_shot in (False, True):
        source = VerifiersSource(path=FIXTURE, args={"size": 10, "few_shot": few_shot})
        task = VerifiersTask(DatasetConfig(verifiers=source, shuffle=False), 0,
                             "task.datasets[0]")
        for row in range(10):
            prompt = task.prompt_at(task.name, row, prompt_id=row)
            theirs = task.environment.tasks[row]
            assert prompt.messages[0].role == "system"
            assert prompt.messages[0].content == theirs.data.system_prompt
            assert [m.role for m in prompt.messages[1:]] == (
                ["user", "assistant", "user"] if few_shot else ["user"])
            assert prompt.messages[-1].content == theirs.data.prompt_text.split("\n\n")[-1]
            assert prompt.data_source == "verifiers/verifiers_addition"
            assert scorer_of(prompt.data_source) == "verifiers"
            for reply in replies(theirs.data.answer):
                items.append(ScoreItem(prompt.data_source, reply, prompt.ground_truth,
                                       prompt.extra_info))
                expected.append(asyncio.run(library_score(theirs, reply)))
    topology = decode_topology(apply_overrides({}, []))
    scoring = Scoring(topology.reward)  # no [[reward.functions]]: by data source, in children
    try:
        results = await scoring.score(items)
    finally:
        await scoring.aclose()
    assert len(results) == 120
    for item, ours, trace in zip(items, results, expected, strict=True):
        assert not ours.error, ours.error
        assert ours.score == trace.reward, (item.solution_str, ours, trace.rewards)
        assert {k: ours.extra[k] for k in ("correct", "formatted")} == {
            name: r.score for name, r in trace.rewards.items()}
        assert ours.extra["metric/length"] == trace.metrics["length"]
    assert {r.score for r in results} == {0.0, 0.25, 1.0, 1.25}


def test_an_installed_environment_is_named_by_its_id(monkeypatch):
    """``id`` imports the package as verifiers' loader does (a Hub id's owner, its version and
    dashes aside): here the fixture's module, put on the path as an installed package is."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    by_id = environment(spec_of(VerifiersSource(id="someone/verifiers-addition@0.1",
                                                args={"size": 5})))
    by_path = environment(spec_of(VerifiersSource(path=FIXTURE, args={"size": 5})))
    assert by_id.name == by_path.name == "verifiers_addition"
    assert [t.data.model_dump() for t in by_id.tasks] == [
        t.data.model_dump() for t in by_path.tasks]


LOADER = '''
from verifiers_addition import AdditionConfig, AdditionTaskset

def load_environment(size=3, **args):
    return AdditionTaskset(AdditionConfig(size=size, **args))
'''


def test_a_file_may_define_load_environment(monkeypatch, tmp_path):
    """A file without an exported Taskset: ``load_environment(**args)`` makes it."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    (tmp_path / "loader_env.py").write_text(LOADER)
    made = environment(spec_of(VerifiersSource(path=str(tmp_path / "loader_env.py"),
                                               args={"size": 4, "few_shot": True})))
    direct = environment(spec_of(VerifiersSource(path=FIXTURE,
                                                 args={"size": 4, "few_shot": True})))
    assert made.name == "loader_env"
    assert [t.data.model_dump() for t in made.tasks] == [
        t.data.model_dump() for t in direct.tasks]
    with pytest.raises(ValueError, match=r"loader_env.py: load_environment\(\*\*\{'sise': 3\}\) "
                                         "failed: sise: Extra inputs are not permitted"):
        environment(spec_of(VerifiersSource(path=str(tmp_path / "loader_env.py"),
                                            args={"sise": 3})))


def check(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "runner.py", "check", "topology.toml", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, env=ENV)


TOOLS_ENV = '''
import verifiers.v1 as vf

class Calculator(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        return a + b

class CalcTask(vf.Task):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        yield CalcTask(vf.TaskData(prompt="What is 2 + 3? Use the tool."))

__all__ = ["CalcTaskset"]
'''
MISSING_ENV = '''
import flowrl_no_such_package
'''
UNSEEDED_ENV = '''
import random
import verifiers.v1 as vf

class Draws(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        for _ in range(8):
            yield vf.Task(vf.TaskData(prompt=f"Say {random.random()}"))

__all__ = ["Draws"]
'''


@pytest.mark.parametrize("spec, message", [
    ('{id="no_such_env"}', "no verifiers environment 'no_such_env': no installed package "
                           "'no_such_env'"),
    (f'{{path="{FIXTURE}", args={{sise=3}}}}',
     "refused its args {'sise': 3}: sise: Extra inputs are not permitted"),
    ('{path="{tmp}/tools_env.py"}', "not supported (it has tools (Calculator), which "
                                     "verifiers serves to its harness as MCP servers)"),
    ('{path="{tmp}/missing_env.py"}', "needs a package that is not installed: No module named "
                                      "'flowrl_no_such_package' (pip install "
                                      "flowrl_no_such_package)"),
    ('{path="{tmp}/unseeded_env.py"}', "unseeded_env: its tasks differ from one load to the "
                                        "next"),
    ('{id="x", path="y.py"}', "set either id or path"),
])
def test_bad_input_is_one_line_at_check(tmp_path, spec, message):
    (tmp_path / "tools_env.py").write_text(TOOLS_ENV)
    (tmp_path / "missing_env.py").write_text(MISSING_ENV)
    (tmp_path / "unseeded_env.py").write_text(UNSEEDED_ENV)
    done = check(f"task.datasets=[{{verifiers={spec.replace('{tmp}', str(tmp_path))}}}]")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "task.datasets[0].verifiers" in done.stderr and message in done.stderr, done.stderr


def test_without_the_package_the_error_names_the_install_line():
    code = textwrap.dedent(f"""
        import sys; sys.modules['verifiers'] = None
        from actors.data.verifiers_env import environment
        try:
            environment('{{"id": "", "path": "{FIXTURE}", "args": {{}}, "size": 0}}')
        except ValueError as exc:
            print(exc)
        """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert "verifiers is not installed: pip install 'flowrl[verifiers]' (verifiers==0.4.0)" \
        in done.stdout, done


def test_a_job_trains_and_validates_on_an_environment(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run(command(
        tiny_model, run_dir, "learner.total_steps=4", "learner.save_every=2",
        f'task.datasets=[{{verifiers={{path="{FIXTURE}", args={{size=40, raise_on=7}}}}}}]',
        f'validation.datasets=[{{verifiers={{path="{FIXTURE}", args={{split="test", size=4}}}}}}]',
        "validation.every=4", "validation.n=2"),
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(balanced(r) for r in rows)
    groups = [decode_group(r["message"]) for r in read_table(run_dir, "groups").to_pylist()]
    assert {g.prompt.data_source for g in groups} == {"verifiers/verifiers_addition"}
    samples = [s for g in groups for s in g.samples]
    failed = [s for s in samples if s.reward_error]
    scored = [s for s in samples if not s.reward_error]
    assert scored and all({"correct", "formatted", "metric/length"} <= set(s.reward_extra)
                          for s in scored)
    assert all(s.reward == s.reward_extra["correct"] + 0.25 * s.reward_extra["formatted"]
               for s in scored)
    # the raising reward: a recorded error (0.0) on every sample of its tasks and only there,
    # counted per step; the groups are accounted for like any other (the counters balance)
    for g in groups:
        sevens = g.prompt.messages[-1].content.startswith("What is 7 +")
        assert all(bool(s.reward_error) == sevens for s in g.samples), g.prompt
    assert failed and all("no sums starting with 7" in s.reward_error and s.reward == 0.0
                          for s in failed)
    assert sum(r["replay/score_errors"] for r in rows) > 0
    assert [v["step"] for v in validations(run_dir)] == [0, 4]
    out = io.StringIO()
    assert rerun(run_dir, 4, out=out) == 0, out.getvalue()
