"""Bad input, as a new user makes it, through ``runner.py`` as a subprocess.

Before start: each row of ``ROWS`` is one mistake; the runner must exit with the row's status,
print one line ``error: ...`` naming the row's key, no Python traceback, and start nothing (the
run directory is not even made). At run time: a reward function that fails on every item stops
the job after its first step with the count and the function's own traceback, and a resume after
the fix trains from there; one that fails on 1 call in 100 trains with the failures counted; one
that hangs on 1 call in 50 is killed at ``reward.timeout_s`` and counted.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from actors.runtime.recording import read_table
from tests.jobs import ROOT, TINY, metrics, status_lines
from tests.tiny_vlm import solid_png

SYNTAX = "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0 +\n"
GOOD = ("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(ground_truth in solution_str)\n")
RAISES = ("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
          "    return extra_info[\"missing_key\"]\n")
COUNTED = '''import os, time
CALLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.txt")


def _call() -> int:  # calls counted across the worker's children (reward.processes = 1)
    n = int(open(CALLS).read()) + 1 if os.path.exists(CALLS) else 1
    with open(CALLS, "w") as f:
        f.write(str(n))
    return n


def compute_score(data_source, solution_str, ground_truth, extra_info):
    if _call() % EVERY == 1:
        FAIL
    return float(ground_truth in solution_str)
'''
FLAKY = COUNTED.replace("EVERY", "100").replace("FAIL", 'raise ValueError("flaky")')
HANGS = COUNTED.replace("EVERY", "50").replace("FAIL", "time.sleep(3600)")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model) -> Path:
    """A folder of bad inputs: files, and model directories broken in the ways users break them."""
    from tests.tiny_model import build_tiny_reward_model

    d = tmp_path_factory.mktemp("bad")
    (d / "syntax.py").write_text(SYNTAX)
    (d / "imports.py").write_text("import no_such_module_here\n")
    (d / "one_arg.py").write_text("def compute_score(solution):\n    return 1.0\n")
    (d / "env.py").write_text("class Env:\n    def reset(self, prompt):\n        return ''\n")
    (d / "junk.parquet").write_text("this is not a parquet file")
    (d / "bad.jsonl").write_text('{"prompt": "hi", "data_source": "x", "reward_model": '
                                 '{"ground_truth": "1"}}\n{"prompt": \n')
    (d / "no_prompt.jsonl").write_text('{"question": "hi", "data_source": "x", "answer": "1"}\n')
    (d / "broken.toml").write_text((ROOT / "topology.toml").read_text() + "\n[learner\n")
    build_tiny_reward_model(d / "reward_model")
    (d / "red.png").write_bytes(solid_png((220, 30, 30)))
    (d / "junk.png").write_bytes(b"GIF89a-truncated")
    for name, content, image in (("image_missing", "<image>colour?", "gone.png"),
                                 ("image_placeholders", "<image><image>colour?", "red.png"),
                                 ("image_unreadable", "<image>colour?", "junk.png")):
        rows = [{"prompt": [{"role": "user", "content": c}], "images": [i], "data_source": "x",
                 "reward_model": {"ground_truth": "red"}}
                for c, i in (("<image>colour?", "red.png"), (content, image))]
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    no_tokenizer = d / "no_tokenizer"
    no_tokenizer.mkdir()
    for f in tiny_model.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, no_tokenizer / f.name)
    no_template = shutil.copytree(tiny_model, d / "no_template")
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    return d


START = ["topology.toml", "model.path={model}", "run.dir={run}", *TINY]
# (id, the command's arguments after runner.py, exit status, what the error line must contain)
ROWS = [
    # the table (its second row, a function raising on every item, is a run-time error:
    # test_a_function_failing_on_every_item_stops_the_job_and_a_resume_after_the_fix_trains)
    ("syntax_error", [*START, "reward.functions=[{{path='{d}/syntax.py'}}]"], 2,
     "reward.functions[0].path: syntax.py line 2: SyntaxError: invalid syntax"),
    ("model_missing", [*START, "model.path=/nonexistent/model"], 2,
     "model.path: '/nonexistent/model' does not exist"),
    ("not_parquet", [*START, "task.datasets=[{{path='{d}/junk.parquet'}}]"], 2,
     "task.datasets[0].path: not a parquet file ("),
    # the rest of user code, model and data
    ("import_error", [*START, "reward.functions=[{{path='{d}/imports.py'}}]"], 2,
     "reward.functions[0].path: imports.py line 1: ModuleNotFoundError"),
    ("no_such_name", [*START, "reward.functions=[{{path='{d}/one_arg.py', name='score'}}]"], 2,
     "reward.functions[0].path: one_arg.py has no 'score' (it defines: compute_score)"),
    ("wrong_signature", [*START, "reward.functions=[{{path='{d}/one_arg.py'}}]"], 2,
     "reward.functions[0].path: compute_score(solution) cannot be called"),
    ("batch_signature", [*START, "reward.functions=[{{path='{d}/one_arg.py', batch=true}}]"], 2,
     "reward.functions[0].path: compute_score(solution) cannot be called as a batch"),
    ("tool_syntax", [*START, "agent.tools=[{{path='{d}/syntax.py', name='compute_score'}}]"], 2,
     "agent.tools[0].path: syntax.py line 2: SyntaxError"),
    ("env_no_step", [*START, "agent.env.path={d}/env.py", "agent.env.name=Env"], 2,
     "agent.env.path: class Env has no step method"),
    ("rollout_not_async", [*START, "agent.rollout.path={d}/one_arg.py",
                           "agent.rollout.name=compute_score"], 2,
     "agent.rollout.path: compute_score is not an async def"),
    ("rollout_branches_estimator", [*START, "agent.rollout.path={d}/one_arg.py",
                                    "algorithm.adv_estimator=reinforce_plus_plus_baseline"], 2,
     "agent.rollout.branches: train gives groups of unequal size, which "
     "reinforce_plus_plus_baseline cannot take"),
    ("rollout_branches_teacher", [*START, "agent.rollout.path={d}/one_arg.py",
                                  "teacher.path={model}"], 2,
     "agent.rollout.branches: train gives samples on prompts of their own, which the teacher's"),
    ("rollout_and_env", [*START, "agent.rollout.path={d}/env.py", "agent.env.path={d}/env.py",
                         "agent.env.name=Env"], 2,
     "agent.rollout.path: a rollout function replaces tools and environments"),
    ("not_causal_lm", [*START, "model.path={d}/reward_model"], 2,
     "not a causal language model"),
    ("no_tokenizer", [*START, "model.path={d}/no_tokenizer"], 2,
     "model.path: {d}/no_tokenizer: the tokenizer does not load"),
    ("no_chat_template", [*START, "model.path={d}/no_template"], 2,
     "model.path: {d}/no_template: the tokenizer has no chat template"),
    ("jsonl_bad_line", [*START, "task.datasets=[{{path='{d}/bad.jsonl'}}]"], 2,
     "task.datasets[0].path: {d}/bad.jsonl: line 2 is not JSON"),
    ("validation_not_parquet", [*START, "validation.datasets=[{{path='{d}/junk.parquet'}}]"], 2,
     "validation.datasets[0].path: not a parquet file ("),
    # what worked before and must stay
    ("unknown_key", [*START, "learner.total_stepz=3"], 2, "learner.total_stepz: unknown key"),
    ("wrong_type", [*START, "learner.lr=fast"], 2, "learner.lr: Expected `float`"),
    ("enum", [*START, "sampler.engine=turbo"], 2, "sampler.engine.name: 'turbo' is not one of auto, hf, vllm"),
    ("range", [*START, "learner.total_steps=0"], 2, "learner.total_steps: must be >= 1"),
    ("error_share_range", [*START, "reward.max_error_share=1.5"], 2,
     "reward.max_error_share: must be in [0, 1]"),
    ("missing_dataset", [*START, "task.datasets=[{{path='{d}/nope.parquet'}}]"], 2,
     "task.datasets[0].path: no file"),
    ("missing_prompt_column", [*START, "task.datasets=[{{path='{d}/no_prompt.jsonl'}}]"], 2,
     "task.datasets[0].prompt_key: no column 'prompt'"),
    # a row's images (vision-language models): every row is read before the job starts
    ("image_missing", [*START, "task.datasets=[{{path='{d}/image_missing.jsonl'}}]"], 2,
     "task.datasets[0] ({d}/image_missing.jsonl row 1) column 'images': image 0: no file "
     "'gone.png'"),
    ("image_placeholders", [*START, "task.datasets=[{{path='{d}/image_placeholders.jsonl'}}]"], 2,
     "row 1) column 'images': 2 <image> placeholder(s) in the prompt for 1 image(s)"),
    ("image_unreadable", [*START, "task.datasets=[{{path='{d}/image_unreadable.jsonl'}}]"], 2,
     "row 1) column 'images': image 0 (16 bytes) is not an image PIL can read"),
    ("broken_toml", ["{d}/broken.toml", "model.path={model}", "run.dir={run}"], 2,
     "broken.toml: not valid TOML"),
    ("missing_topology", ["{d}/nope.toml", "run.dir={run}"], 2, "nope.toml does not exist"),
    ("rerun_missing_run", ["rerun", "{run}", "--step", "1"], 2, "{run}"),
    ("attach_missing_run", ["attach", "reward", "--to", "{run}"], 2, "{run}"),
    ("check_subcommand", ["check", "topology.toml", "model.path={model}", *TINY,
                          "reward.functions=[{{path='{d}/syntax.py'}}]"], 2,
     "reward.functions[0].path: syntax.py line 2"),
]


def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "runner.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_stops_before_start_with_one_line_naming_the_key(row, inputs, tiny_model,
                                                                   tmp_path):
    _, args, status, expected = row
    fill = {"d": inputs, "model": tiny_model, "run": tmp_path / "run"}
    res = run([a.format(**fill) for a in args])
    output = res.stdout + res.stderr
    assert res.returncode == status, output
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected.format(**fill) in errors[0], output
    assert "Traceback" not in output, output
    assert not (tmp_path / "run").exists(), "a run directory was made: something started"


def test_check_passes_a_good_topology(tiny_model, inputs):
    (inputs / "good.py").write_text(GOOD)
    res = run(["check", "topology.toml", f"model.path={tiny_model}", *TINY,
               f"reward.functions=[{{path='{inputs}/good.py'}}]"])
    assert res.returncode == 0 and res.stdout.startswith("ok: "), res.stdout + res.stderr
    # the learner's memory table, for the largest micro-batch the token budget allows
    assert "memory estimate per rank" in res.stdout and "<- this run" in res.stdout


def job(model: Path, run_dir: Path, function: Path, *overrides: str,
        timeout: float = 240) -> subprocess.CompletedProcess:
    """A tiny job scored by ``function`` alone, in one child, its output captured."""
    return run(["topology.toml", f"model.path={model}", f"run.dir={run_dir}", *TINY,
                "run.heartbeat_interval=0.5", "reward.processes=1",
                f"reward.functions=[{{path='{function}'}}]", *overrides], timeout=timeout)


def fates(run_dir: Path) -> list[tuple[str, str]]:
    return [(f["fate"], f["reason"]) for f in read_table(run_dir, "fates", None).to_pylist()]


def recorded_errors(run_dir: Path, trained_only: bool = False) -> list[str]:
    """The failed samples' errors in the recording (of the groups trained on, or of all)."""
    trained = {f["group_id"] for f in read_table(run_dir, "fates", None).to_pylist()
               if f["fate"] == "trained"}
    return [e for g in read_table(run_dir, "groups", ["group_id", "reward_errors"]).to_pylist()
            if not trained_only or g["group_id"] in trained for e in g["reward_errors"] if e]


def test_a_function_failing_on_every_item_stops_the_job_and_a_resume_after_the_fix_trains(
        tiny_model, tmp_path):
    function, run_dir = tmp_path / "my_reward.py", tmp_path / "run"
    function.write_text(RAISES)
    res = job(tiny_model, run_dir, function, "learner.total_steps=3")
    output = res.stdout + res.stderr
    assert res.returncode == 1, output
    assert "scoring failed on 32 of 32 samples (100%) of the batch of step 1, over " \
        "reward.max_error_share = 0.5" in output
    assert "my_reward.compute_score: KeyError: 'missing_key'" in output  # the first failure ...
    assert f'File "{function}", line 2, in compute_score' in output  # ... and its traceback,
    assert 'File "' + str(ROOT) not in output  # the user's frames only
    (line,) = [x for x in output.splitlines() if x.startswith("    resume with: ")]
    resume = shlex.split(line.split(": ", 1)[1])  # the job's own command, run.dir named
    assert resume[:3] == ["python", "runner.py", "topology.toml"], line
    assert resume[-1] == f"run.dir={run_dir}" and f"model.path={tiny_model}" in resume, line
    assert metrics(run_dir) == []  # no step trained on those zeros
    dropped = fates(run_dir)
    assert dropped and set(dropped) == {("dropped", "score_errors")}  # recorded as such
    errors = read_table(run_dir, "groups", ["reward_errors"])["reward_errors"].to_pylist()
    assert all(e.endswith("KeyError: 'missing_key'") for row in errors for e in row)

    function.write_text(GOOD)  # the fix, then the same command with the same run.dir
    res = job(tiny_model, run_dir, function, "learner.total_steps=2")
    assert res.returncode == 0, res.stdout + res.stderr
    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["replay/score_errors"] == 0 and m["replay/dropped_score_errors"] == len(dropped)
               for m in steps)
    assert sorted(set(fates(run_dir))) == [("dropped", "score_errors"), ("trained", "")]


def test_a_function_failing_on_one_call_in_100_trains_with_the_failures_counted(tiny_model,
                                                                                tmp_path):
    function, run_dir = tmp_path / "flaky.py", tmp_path / "run"
    function.write_text(FLAKY)
    res = job(tiny_model, run_dir, function, "learner.total_steps=4")
    assert res.returncode == 0, res.stdout + res.stderr
    steps = metrics(run_dir)
    assert len(steps) == 4 and all(m["replay/score_error_share"] < 0.5 for m in steps)
    errors = recorded_errors(run_dir)  # call 1 fails: its group is the first scored
    assert errors and all(e == "flaky.compute_score: ValueError: flaky" for e in errors)
    # the steps counted exactly the failed samples of the groups they trained on
    assert sum(m["replay/score_errors"] for m in steps) == len(recorded_errors(run_dir, True))
    assert status_lines(run_dir)[-1]["sampler-0"]["score_errors"] >= 1


def test_a_function_that_hangs_is_killed_at_its_timeout_and_counted(tiny_model, tmp_path):
    function, run_dir = tmp_path / "hangs.py", tmp_path / "run"
    function.write_text(HANGS)
    res = job(tiny_model, run_dir, function, "learner.total_steps=3", "reward.timeout_s=2")
    assert res.returncode == 0, res.stdout + res.stderr
    steps = metrics(run_dir)
    assert len(steps) == 3
    errors = recorded_errors(run_dir)  # call 1 hangs: its group is the first scored
    assert errors and all("timed out after 2 s (reward.timeout_s); child killed" in e
                          for e in errors)
    assert sum(m["replay/score_errors"] for m in steps) == len(recorded_errors(run_dir, True))
    assert status_lines(run_dir)[-1]["reward-0"]["score_timeouts"] >= 1


@pytest.mark.anyio
async def test_a_tool_failing_every_call_is_broken_while_the_models_bad_calls_are_not(tmp_path):
    from actors.job.config.load import load_topology
    from actors.sampler.agent.parsers import ToolCall
    from actors.sampler.agent.toolbox import ToolBox

    tool = tmp_path / "tools.py"
    tool.write_text("def lookup(query: str) -> str:\n"
                    "    if query == 'raise':\n        raise KeyError(query)\n    return query\n")
    cfg = load_topology(ROOT / "topology.toml", [
        f"agent.tools=[{{path='{tool}', name='lookup'}}]", "agent.max_tool_failures=3",
        "agent.processes=1"]).agent
    box = ToolBox(cfg)
    try:
        await box.start()
        calls = [ToolCall("lookup", {"query": "raise"}, ""), ToolCall("lookup", {"query": "raise"}, ""),
                 ToolCall("lookup", {"query": "ok"}, "")]  # a success resets the count
        calls += [ToolCall("nope", {}, ""), ToolCall("lookup", {"q": 1}, "")] * 3  # the model's
        calls += [ToolCall("lookup", {"query": "raise"}, "")] * 2
        for call in calls:
            await box.call(call)
        assert box.broken == ""  # 2 in a row, a success, the model's 6 bad calls, 2 in a row
        result = await box.call(ToolCall("lookup", {"query": "raise"}, ""))
        assert result.text == "Error: KeyError: 'raise'"  # still an answer the model reads
        assert box.broken == ("tool agent.tools[0] (lookup) failed on 3 calls in a row "
                              "(agent.max_tool_failures = 3); last: KeyError: 'raise'")
        assert box.statistics().errors == 11
    finally:
        await box.aclose()


def test_a_tool_failing_every_call_stops_the_job(tmp_path):
    """The tiny model with ``<lookup>`` tokens calls its tool by chance in about a quarter of its
    samples (tests/test_agent_job.py); this tool raises on every call."""
    from tests.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", words=("<lookup>", "</lookup>"))
    tool = tmp_path / "tools.py"
    tool.write_text("def lookup(query: str) -> str:\n    raise ConnectionError('no service')\n")
    res = run(["topology.toml", f"model.path={model}", f"run.dir={tmp_path / 'run'}", *TINY,
               "run.heartbeat_interval=0.5", "learner.total_steps=20", "sampler.max_tokens=48",
               f"agent.tools=[{{path='{tool}', name='lookup'}}]", "agent.parser=xml",
               "agent.max_turns=3", "agent.max_tool_failures=5"], timeout=240)
    output = res.stdout + res.stderr
    assert res.returncode == 1, output
    assert "tool agent.tools[0] (lookup) failed on 5 calls in a row (agent.max_tool_failures " \
        "= 5); last: ConnectionError: no service" in output
    assert len(metrics(tmp_path / "run")) < 20


def test_validation_scoring_failing_past_the_bound_stops_the_job(tiny_model, tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"say {c}", "data_source": "val_src",
                                       "reward_model": {"ground_truth": c}}) + "\n"
                           for c in "abcd"))
    function = tmp_path / "val_only.py"
    function.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                        "    if data_source == 'val_src':\n"
                        "        raise RuntimeError('no validation scorer')\n"
                        "    return float(ground_truth in solution_str)\n")
    res = job(tiny_model, tmp_path / "run", function, "learner.total_steps=20",
              f"validation.datasets=[{{path='{val}'}}]", "validation.every=10")
    output = res.stdout + res.stderr
    assert res.returncode == 1, output
    assert "scoring failed on 16 of 16 samples (100%) of the validation round of step 0" in output
    assert "RuntimeError: no validation scorer" in output
