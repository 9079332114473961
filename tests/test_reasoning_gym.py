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
from actors.scoring.rules import BUILTINS, INVALID, extract_answer, scorer_of
from tests.jobs import ROOT, balanced, command, metrics, validations

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym is the envs extra: "
                                                 "pip install -e '.[envs]'")


def replies(answer: str) -> list[str]:
    """Right, right with spaces and text around, wrong, malformed (no tags), two tags (the last
    counts), empty."""
    return [f"<answer>{answer}</answer>", f"so... <answer> {answer} </answer> done",
            "<answer>0</answer>", f"the answer is {answer}",
            f"<answer>1</answer> then <answer>{answer}</answer>", ""]


@pytest.mark.parametrize("answer", ["tags", "reply"])
@pytest.mark.parametrize("name, config", [("leg_counting", {}),
                                          ("basic_arithmetic", {"min_terms": 2, "max_terms": 3})])
def test_scores_equal_the_librarys_own(name, config, answer):
    """The library's own score of the answer it reads (``tags``: its ``extract_answer``), or of
    the whole reply stripped (``reply``, for models that write no tags)."""
    source = ReasoningGymSource(name=name, config=config, size=100, answer=answer)
    task = ReasoningGymTask(source, seed=7, label=name, key="task.datasets[0]")
    library = rg.create_dataset(name, size=100, seed=7, **config)
    system = (rg.utils.SYSTEM_PROMPTS["default"] if answer == "tags"
              else "Reply with the answer alone.")
    scored = []
    for row in range(10):
        prompt = task.prompt_at(name, row, prompt_id=row)
        entry = library[row]
        assert [m.content for m in prompt.messages] == [system, entry["question"]]
        assert prompt.ground_truth == str(entry["answer"])
        assert prompt.data_source == f"reasoning_gym/{name}"
        rule = BUILTINS[scorer_of(prompt.data_source)]
        right = str(entry["answer"])
        for reply in [*replies(right), f" {right}\n", f"It is {right}."]:
            ours = rule(prompt.data_source, reply, prompt.ground_truth, prompt.extra_info)
            read = rg.utils.extract_answer(reply) if answer == "tags" else reply.strip()
            theirs = library.score_answer(answer=read, entry=entry)
            assert ours == float(theirs), (row, reply, ours, theirs)
            assert extract_answer("reasoning_gym", reply, extra_info=prompt.extra_info) \
                == (read or INVALID)
            scored.append(ours)
    assert len(scored) == 80 and 1.0 in scored and 0.0 in scored
    if answer == "reply":  # partial credit for the answer among other text: a shaped reward
        assert any(0.0 < x < 1.0 for x in scored)


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


@pytest.mark.slow
def test_the_default_model_learns_one_digit_sums(tmp_path):
    """docs/data.md's curve, its first 15 steps: the embedded model on basic_arithmetic with
    ``answer = "reply"``, scored by the generator's own ``score_answer`` (which credits a reply
    that holds the sum by its share of the reply): the reward rises as the replies shrink to
    the sum (0.015 over steps 1-5 and 0.111 over 11-15 in the documented run)."""
    config = ('config = { min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1, '
              'operators = ["+"], allow_parentheses = false, allow_negation = false }')
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "runner.py", "topology.toml", f"run.dir={run_dir}",
                          "run.status_interval=0", "learner.total_steps=15",
                          # the curve is the training reward's: no validation rounds
                          "validation.every=0", "validation.before_training=false",
                          "task.datasets=[{reasoning_gym = { name = \"basic_arithmetic\", "
                          f"answer = \"reply\", {config} }}}}]"],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 16)) and all(map(balanced, rows))
    rewards = [r["critic/score/mean"] for r in rows]
    lengths = [r["response_length/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"\nreward steps 1-5 {first:.3f}, 11-15 {last:.3f}; reply tokens "
          f"{sum(lengths[:5]) / 5:.1f} -> {sum(lengths[-5:]) / 5:.1f}")
    assert last > max(3 * first, 0.06), f"reward did not clearly rise: {rewards}"
    assert sum(lengths[-5:]) < sum(lengths[:5]), lengths
