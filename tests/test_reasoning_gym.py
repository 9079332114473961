"""reasoning-gym generators as a task source: prompts and answers from the generator, scores
equal to the library's own ``score_answer`` on every kind of reply, a bad name or option one
line at ``check``, and a whole tiny job that trains and validates on one (its replies scored by
the reward worker's child through the same function)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from actors.data.reasoning_gym import ReasoningGymTask
from actors.offline.rerun import rerun
from actors.runtime.config import ReasoningGymSource
from actors.runtime.recording import decode_group, read_table
from actors.scoring.rules import BUILTINS, extract_answer, scorer_of
from tests.jobs import ROOT, balanced, command, metrics, validations

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym is the envs extra: "
                                                 "pip install -e '.[envs]'")


def replies(answer: str) -> list[str]:
    """Right, right with spaces and text around, wrong, malformed (no tags), two tags (the last
    counts), empty."""
    return [f"<answer>{answer}</answer>", f"so... <answer> {answer} </answer> done",
            "<answer>0</answer>", f"the answer is {answer}",
            f"<answer>1</answer> then <answer>{answer}</answer>", ""]


@pytest.mark.parametrize("name, config", [("leg_counting", {}),
                                          ("basic_arithmetic", {"min_terms": 2, "max_terms": 3})])
def test_scores_equal_the_librarys_own(name, config):
    source = ReasoningGymSource(name=name, config=config, size=100)
    task = ReasoningGymTask(source, seed=7, label=name, key="task.datasets[0]")
    library = rg.create_dataset(name, size=100, seed=7, **config)
    scored = []
    for row in range(10):
        prompt = task.prompt_at(name, row, prompt_id=row)
        entry = library[row]
        assert prompt.messages[-1].content == entry["question"]
        assert prompt.ground_truth == str(entry["answer"])
        assert prompt.data_source == f"reasoning_gym/{name}"
        rule = BUILTINS[scorer_of(prompt.data_source)]
        for reply in replies(str(entry["answer"])):
            ours = rule(prompt.data_source, reply, prompt.ground_truth, prompt.extra_info)
            theirs = library.score_answer(answer=rg.utils.extract_answer(reply), entry=entry)
            assert ours == float(theirs), (row, reply, ours, theirs)
            scored.append(ours)
        assert extract_answer("reasoning_gym", replies(str(entry["answer"]))[0]) \
            == str(entry["answer"]).strip()
    assert len(scored) == 60 and 1.0 in scored and 0.0 in scored


def test_a_bad_name_or_option_is_one_line_at_check():
    for spec, message in (('{name="leg_countin"}', "no reasoning-gym dataset 'leg_countin'"),
                          ('{name="leg_counting", config={min_animalz=3}}',
                           "reasoning-gym dataset 'leg_counting' refused its config "
                           "{'min_animalz': 3}")):
        done = subprocess.run([sys.executable, "runner.py", "check", "topology.toml",
                               f"task.datasets=[{{reasoning_gym={spec}}}]"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stdout[-2000:]
        assert f"task.datasets[0].reasoning_gym: {message}" in done.stderr, done.stderr


def test_without_the_package_the_error_names_the_install_line():
    code = ("import sys; sys.modules['reasoning_gym'] = None\n"
            "from actors.data.reasoning_gym import generator\n"
            "try:\n    generator('{\"name\": \"leg_counting\", \"config\": {}, \"size\": 5, "
            "\"seed\": 0}')\n"
            "except ValueError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert "reasoning-gym is not installed: pip install 'flowrl[envs]'" in done.stdout, done


def test_a_job_trains_and_validates_on_a_generator(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run(command(
        tiny_model, run_dir, "learner.total_steps=4", "learner.save_every=2",
        'task.datasets=[{reasoning_gym={name="leg_counting", size=50}}]',
        'validation.datasets=[{reasoning_gym={name="leg_counting"}, size=4}]',
        "validation.every=4", "validation.n=2"),
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(balanced(r) for r in rows)
    groups = [decode_group(r["message"]) for r in read_table(run_dir, "groups").to_pylist()]
    assert {g.prompt.data_source for g in groups} == {"reasoning_gym/leg_counting"}
    assert all(not s.reward_error for g in groups for s in g.samples)  # scored by the library
    assert [v["step"] for v in validations(run_dir)] == [0, 4]
    out = io.StringIO()
    assert rerun(run_dir, 4, out=out) == 0, out.getvalue()
