"""Scoring: the built-in rules by hand, users' verl-style functions in child processes, weights,
the overlong penalty, and every way a function can go wrong becoming 0.0 plus an error."""

from __future__ import annotations

import os
import textwrap

import anyio
import pytest

import actors.data.tasks
from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.config import BUILTIN_SCORERS, BUILTIN_TASKS, ConfigError, RewardConfig
from actors.sandbox.children import Children
from actors.sandbox.protocol import Call, FunctionSpec, Outcome
from actors.scoring.items import ScoreItem, items_of, verl_arguments
from actors.scoring.rules import (
    BUILTINS,
    DATA_SOURCES,
    answer_tag,
    arithmetic_score,
    exact_match,
    gsm8k,
    math,
    overlong_penalty,
    repeat_letter_score,
)
from actors.scoring.scorer import Scoring, builtin_spec
from messages.reward import Response, ScoreRequest, ScoreResult
from messages.rollout import ChatMessage
from tests.helpers import child_pids

USER_FUNCTIONS = '''
import asyncio, ctypes, math, os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    print("user code may print; the pipe to the worker is not stdout")
    return float(solution_str == ground_truth)

def with_extras(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "acc": True, "pred": solution_str, "len": len(solution_str)}

def batch(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    return [float(s == g) + bonus for s, g in zip(solution_strs, ground_truths)]

def batch_short(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0]

async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return 0.25 * extra_info["k"]

def hangs(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(3600)
    return 1.0

def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("bad input " + solution_str)

def greedy(data_source, solution_str, ground_truth, extra_info=None):
    hoard = []
    while True:
        hoard.append(bytearray(50 * 2**20))

def exits(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "exit":
        os._exit(1)
    return 1.0

def segfaults(data_source, solution_str, ground_truth, extra_info=None):
    ctypes.string_at(0)

def spins(data_source, solution_str, ground_truth, extra_info=None):
    while True:
        pass

def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return {"yes": "yes", "nan": math.nan, "none": None}[solution_str]

def pid(data_source, solution_str, ground_truth, extra_info=None):
    return float(os.getpid())
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(USER_FUNCTIONS))
    return str(path)


def reward_config(*functions: str, **options) -> RewardConfig:
    overrides = [f"reward.functions=[{', '.join(functions)}]"] if functions else []
    overrides += [f"reward.{k}={v}" for k, v in options.items()]
    return decode_topology(apply_overrides({}, overrides)).reward


async def score(cfg: RewardConfig, items: list[ScoreItem], max_tokens: int = 32):
    scoring = Scoring(cfg)
    try:
        return await scoring.score(items, max_tokens), scoring
    finally:
        await scoring.aclose()


def item(solution: str, truth: str = "a", **extra) -> ScoreItem:
    return ScoreItem("test", solution, truth, extra)


def exited(pid: int) -> None:
    """Block until child ``pid`` has exited, without reaping it (its owner still can)."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


# built-in rules --------------------------------------------------------------------------------

def test_gsm8k_strict_is_verls_rule():
    assert gsm8k("openai/gsm8k", "so she has 72 left.\n#### 72", "72") == 1.0
    assert gsm8k("", "#### 1,234", "1234") == 1.0  # commas removed
    assert gsm8k("", "#### 7\nno wait\n#### 8", "8") == 1.0  # the last one counts
    assert gsm8k("", "#### -3", "-3") == 1.0
    assert gsm8k("", "the answer is 72", "72") == 0.0  # no "#### "
    assert gsm8k("", "####72", "72") == 0.0
    assert gsm8k("", "#### 71", "72") == 0.0
    assert gsm8k("", "#### 71", "72", format_score=0.1) == 0.1  # extracted but wrong
    assert gsm8k("", "the answer is 72", "72", format_score=0.1) == 0.0  # nothing extracted
    assert gsm8k("", "#### 72" + " padding" * 40, "72") == 0.0  # outside the last 300 characters
    assert gsm8k("", "x" * 1000 + "#### 72", "72") == 1.0


def test_gsm8k_flexible_is_verls_rule():
    assert gsm8k("", "3 apples and 4 pears make 7", "7", method="flexible") == 1.0
    assert gsm8k("", "it is 7.", "7", method="flexible") == 0.0  # verl keeps the trailing "."
    assert gsm8k("", "1,234 it is", "1234", method="flexible") == 0.0  # flexible keeps commas
    assert gsm8k("", "7 then . ", "7", method="flexible") == 1.0  # a lone "." is skipped
    assert gsm8k("", "seven", "7", method="flexible", format_score=0.2) == 0.0
    assert gsm8k("", "8", "7", method="flexible", format_score=0.2) == 0.2
    with pytest.raises(ValueError, match="strict"):
        gsm8k("", "7", "7", method="loose")


def test_exact_match_and_answer_tag():
    assert exact_match("", "  Paris\n", "Paris") == 1.0
    assert exact_match("", "paris", "Paris") == 0.0
    assert answer_tag("", "think... <answer> 42 </answer>", "42") == 1.0
    assert answer_tag("", "<answer>41</answer> no: <answer>\n42\n</answer>", "42") == 1.0
    assert answer_tag("", "<answer>42</answer> no: <answer>41</answer>", "42") == 0.0
    assert answer_tag("", "<answer>41</answer>", "42", format_score=0.1) == 0.1
    assert answer_tag("", "42", "42", format_score=0.1) == 0.0
    assert answer_tag("", "<answer>42", "42", format_score=0.1) == 0.0


def test_math_equivalence():
    assert math("", "so $x = \\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math("", "The answer is $\\frac{\\sqrt{2}}{2}$", "\\frac{1}{\\sqrt{2}}") == 1.0
    assert math("", "\\boxed{3}", "4") == 0.0


def test_overlong_penalty_numbers():
    # L_max = 20, buffer 4: free up to 16 tokens, then -1/4 per token down to -1 at 20
    assert overlong_penalty(10, 20, 4, 1.0) == 0.0
    assert overlong_penalty(16, 20, 4, 1.0) == 0.0
    assert overlong_penalty(18, 20, 4, 1.0) == -0.5
    assert overlong_penalty(20, 20, 4, 1.0) == -1.0
    assert overlong_penalty(20, 20, 4, 0.5) == -0.5
    assert overlong_penalty(22, 20, 4, 1.0) == -1.5


def test_registries_agree():
    assert set(BUILTINS) == set(BUILTIN_SCORERS)  # a reward model is served: [[reward.models]]
    # the built-in tasks' scorers live with the other rules; BUILTINS is the one table
    assert BUILTINS["arithmetic"] is arithmetic_score
    assert BUILTINS["repeat_letter"] is repeat_letter_score
    assert all(DATA_SOURCES[task] in BUILTINS for task in BUILTIN_TASKS)
    assert not hasattr(actors.data.tasks, "SCORERS")
    assert arithmetic_score("arithmetic", "2 + 2 = 4", "4", {"a": 2, "b": 2}) == 1.0
    assert arithmetic_score("arithmetic", "2 + 3 = 4", "4", {"a": 2, "b": 2}) == 0.0
    assert repeat_letter_score("repeat_letter", "a a b a", "a") == 0.75


def test_a_groups_request_becomes_one_item_per_response():
    prompt = [ChatMessage("user", "1 + 2")]
    request = ScoreRequest("arithmetic", "3", [Response("3", 1), Response("1 + 2 = 3", 7)],
                           extra_info={"a": 1, "b": 2}, prompt=prompt, max_response_length=16)
    items = items_of(request)
    assert items == [ScoreItem("arithmetic", "3", "3", {"a": 1, "b": 2}, 1, prompt),
                     ScoreItem("arithmetic", "1 + 2 = 3", "3", {"a": 1, "b": 2}, 7, prompt)]
    assert verl_arguments(items, batch=False)[1] == {
        "data_source": "arithmetic", "solution_str": "1 + 2 = 3", "ground_truth": "3",
        "extra_info": {"a": 1, "b": 2}}
    assert verl_arguments(items, batch=True) == [{
        "data_sources": ["arithmetic"] * 2, "solution_strs": ["3", "1 + 2 = 3"],
        "ground_truths": ["3", "3"], "extra_infos": [{"a": 1, "b": 2}] * 2}]
    assert items_of(ScoreRequest("d", "g", [])) == []


# through Scoring ------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_default_mode_scores_by_data_source():
    items = [ScoreItem("arithmetic", "2 + 2 = 4", "4", {"a": 2, "b": 2}),
             ScoreItem("openai/gsm8k", "#### 5", "5"),
             ScoreItem("lighteval/MATH", "\\boxed{0.5}", "\\frac{1}{2}"),  # math-verify, in a child
             ScoreItem("nope", "x", "y")]
    results, scoring = await score(reward_config(), items)
    assert [r.score for r in results] == [1.0, 1.0, 1.0, 0.0]
    assert "no scorer for data_source 'nope'" in results[3].error
    assert scoring.statistics().errors == 1


@pytest.mark.anyio
async def test_overlong_penalty_uses_response_length():
    cfg = reward_config('{builtin="exact_match"}', overlong_buffer_len=4, overlong_penalty_factor=1.0)
    items = [ScoreItem("t", "a", "a", {}, 0), ScoreItem("t", "a", "a", {}, 16),
             ScoreItem("t", "a", "a", {}, 18), ScoreItem("t", "b", "a", {}, 20)]
    results, _ = await score(cfg, items, max_tokens=20)
    assert [r.score for r in results] == [1.0, 1.0, 0.5, -1.0]
    assert results[2].extra == {"overlong_penalty": -0.5} and results[0].extra == {}
    results, _ = await score(reward_config('{builtin="exact_match"}', overlong_buffer_len=4,
                                           max_response_length=40), items[3:], max_tokens=20)
    assert results[0].score == 0.0  # L_max from reward.max_response_length, not max_tokens
    results, _ = await score(cfg, items, max_tokens=0)
    assert [r.score for r in results] == [1.0, 1.0, 1.0, 0.0]  # no L_max known: no penalty


@pytest.mark.anyio
async def test_user_function_float_dict_batch_async(user_file):
    items = [item("a", k=1), item("b", k=2), item("a", k=4)]
    results, _ = await score(reward_config(f'{{path="{user_file}"}}'), items)
    assert [r.score for r in results] == [1.0, 0.0, 1.0] and not any(r.error for r in results)
    results, _ = await score(reward_config(f'{{path="{user_file}", name="with_extras"}}'), items[:2])
    assert results[1].score == 0.5 and results[1].extra == {"acc": 1.0, "len": 1.0}  # numbers only
    results, _ = await score(reward_config(
        f'{{path="{user_file}", name="batch", batch=true, kwargs={{bonus=0.5}}}}'), items)
    assert [r.score for r in results] == [1.5, 0.5, 1.5]
    results, _ = await score(reward_config(f'{{path="{user_file}", name="async_score"}}'), items)
    assert [r.score for r in results] == [0.25, 0.5, 1.0]
    results, _ = await score(reward_config(f'{{path="{user_file}", name="batch_short", batch=true}}'),
                             items)
    assert all(r.score == 0.0 and "returned 1 values for 3 items" in r.error for r in results)


@pytest.mark.anyio
async def test_weighted_combination(user_file):
    cfg = reward_config(f'{{path="{user_file}", name="with_extras", weight=2.0}}',
                        '{builtin="exact_match", weight=0.5}',
                        '{builtin="answer_tag", weight=-1.0, kwargs={format_score=0.25}}')
    results, _ = await score(cfg, [item("a"), item("<answer>b</answer>")])
    assert results[0].score == 2.0 * 0.5 + 0.5 * 1.0 - 1.0 * 0.0
    assert results[1].score == 2.0 * 0.5 + 0.5 * 0.0 - 1.0 * 0.25
    assert results[1].extra == {"my_reward.with_extras": 0.5, "my_reward.with_extras/acc": 1.0,
                                "my_reward.with_extras/len": 18.0, "exact_match": 0.0,
                                "answer_tag": 0.25}


# bad functions ---------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_hang_times_out_and_the_next_call_works(user_file):
    cfg = reward_config(f'{{path="{user_file}", name="hangs"}}', timeout_s=0.5, processes=1)
    scoring = Scoring(cfg)
    ticks = 0

    async def ticker() -> None:  # the event loop stays free while a child hangs
        nonlocal ticks
        while True:
            await anyio.sleep(0.02)
            ticks += 1

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            results = await scoring.score([item("ok"), item("hang"), item("ok")])
            tg.cancel_scope.cancel()
        assert [r.score for r in results] == [1.0, 0.0, 1.0]
        assert "timed out after 0.5 s (reward.timeout_s)" in results[1].error and ticks >= 15
        assert (await scoring.score([item("ok")]))[0].score == 1.0
        stats = scoring.statistics()
        assert (stats.timeouts, stats.errors, stats.children) == (1, 1, 1)
        assert stats.children_started == 2  # the hung child was replaced
    finally:
        await scoring.aclose()


@pytest.mark.anyio
async def test_exception_bad_values_and_load_failures_become_errors(user_file, tmp_path):
    results, scoring = await score(reward_config(f'{{path="{user_file}", name="raises"}}'), [item("x")])
    assert results[0].score == 0.0 and results[0].error == "my_reward.raises: ValueError: bad input x"
    assert scoring.statistics().crashes == 0 and scoring.statistics().children_started == 1
    results, _ = await score(reward_config(f'{{path="{user_file}", name="not_a_number"}}'),
                             [item("yes"), item("nan"), item("none")])
    assert [r.score for r in results] == [0.0, 0.0, 0.0]
    assert "returned str" in results[0].error and "non-finite" in results[1].error
    assert "returned NoneType" in results[2].error
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    results, _ = await score(reward_config(f'{{path="{broken}"}}'), [item("x")])
    assert "loading" in results[0].error and "SyntaxError" in results[0].error
    results, _ = await score(reward_config(f'{{path="{user_file}", name="missing"}}'), [item("x")])
    assert "has no function 'missing'" in results[0].error


@pytest.mark.anyio
async def test_memory_limit(user_file):
    cfg = reward_config(f'{{path="{user_file}", name="greedy"}}', memory_mb=256, processes=1)
    scoring = Scoring(cfg)
    try:
        results = await scoring.score([item("x")])
        assert results[0].score == 0.0 and results[0].error.startswith("my_reward.greedy: MemoryError")
        assert "reward.memory_mb = 256" in results[0].error
        assert scoring.statistics().crashes == 0  # the child survived its MemoryError
    finally:
        await scoring.aclose()


@pytest.mark.anyio
async def test_crashes_replace_the_child(user_file):
    cfg = reward_config(f'{{path="{user_file}", name="exits"}}', processes=1)
    scoring = Scoring(cfg)
    try:
        results = await scoring.score([item("ok")])
        (first,) = child_pids(scoring.children)
        results = await scoring.score([item("exit")])
        assert results[0].error == ("my_reward.exits: child process exited with status 1 "
                                    "while running; replaced")
        assert (await scoring.score([item("ok")]))[0].score == 1.0
        assert child_pids(scoring.children) != [first] and scoring.statistics().crashes == 1
        (second,) = child_pids(scoring.children)
        os.kill(second, 9)  # an idle child killed from outside is replaced before its next call
        await anyio.to_thread.run_sync(exited, second)
        assert (await scoring.score([item("ok")]))[0] == ScoreResult(1.0)
        assert child_pids(scoring.children) not in ([first], [second])
        assert scoring.statistics().crashes == 1  # found dead before a call: no call crashed
    finally:
        await scoring.aclose()
    results, _ = await score(reward_config(f'{{path="{user_file}", name="segfaults"}}'), [item("x")])
    assert "killed by SIGSEGV" in results[0].error


@pytest.mark.anyio
async def test_cpu_limit(user_file):
    cfg = reward_config(f'{{path="{user_file}", name="spins"}}', cpu_s=1, timeout_s=30)
    with anyio.fail_after(10):
        results, _ = await score(cfg, [item("x")])
    assert "killed by SIGXCPU (over reward.cpu_s = 1)" in results[0].error


@pytest.mark.anyio
async def test_the_sandbox_serves_any_caller_and_names_its_limits(user_file):
    # the children know nothing of rewards: functions by module or by path, keyword arguments
    # as the caller names them, and errors that name the caller's config section
    children = Children([builtin_spec("exact_match"), FunctionSpec(path=user_file, name="hangs")],
                        size=1, timeout_s=0.5, memory_mb=0, cpu_s=0, limits_key="tools")
    args = {"data_source": "", "solution_str": "x", "ground_truth": "x", "extra_info": {}}
    try:
        assert await children.call(Call(0, [args, {**args, "solution_str": "y"}], 2)) == \
            [Outcome(1.0), Outcome(0.0)]
        (outcome,) = await children.call(Call(1, [{**args, "solution_str": "hang"}], 1))
        assert outcome == Outcome(error="timed out after 0.5 s (tools.timeout_s); child killed "
                                        "and replaced", failure="timeout")
        assert (await children.call(Call(1, [args], 1))) == [Outcome(1.0)]
        stats = children.statistics()
        assert (stats.timeouts, stats.crashes, stats.started, stats.children) == (1, 0, 2, 1)
    finally:
        await children.aclose()
    assert children.statistics().children == 0


@pytest.mark.anyio
async def test_children_are_parallel_and_reaped(user_file):
    cfg = reward_config(f'{{path="{user_file}", name="pid"}}', processes=3)
    scoring = Scoring(cfg)
    results = await scoring.score([item("x")] * 9)
    pids = child_pids(scoring.children)
    assert len(pids) == 3 and {int(r.score) for r in results} <= set(pids)
    await scoring.aclose()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# config ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("override", "message"), [
    ("reward.functions=[{}]", "reward.functions[0]: set either builtin or path"),
    ('reward.functions=[{builtin="gsm8k", path="x.py"}]', "reward.functions[0]: set either"),
    ('reward.functions=[{builtin="gsm9k"}]', "reward.functions[0].builtin: 'gsm9k' is not one of"),
    ('reward.functions=[{builtin="math"}, {path="/no/such.py"}]',
     "reward.functions[1].path: no file '/no/such.py'"),
    ('reward.functions=[{builtin="gsm8k", batch=true}]', "reward.functions[0].batch"),
    ('reward.functions=[{builtin="gsm8k", wieght=2}]', "reward.functions[0].wieght: unknown key"),
    ('reward.functions=[{builtin="gsm8k", name="a b"}]', "reward.functions[0].name"),
    ("reward.timeout_s=0", "reward.timeout_s: must be > 0"),
    ("reward.memory_mb=64", "reward.memory_mb: must be >= 128"),
    ("reward.processes=0", "reward.processes: must be >= 1"),
    ("reward.overlong_buffer_len=64", "reward.overlong_buffer_len: must be <= the response length limit (32)"),
])
def test_bad_reward_config_names_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        decode_topology(apply_overrides({}, [override]))
    assert message in str(info.value)


def test_reward_config_parses(user_file):
    cfg = reward_config(f'{{path="{user_file}", name="batch", batch=true, weight=0.5}}',
                        '{builtin="gsm8k", kwargs={method="flexible", format_score=0.1}}',
                        overlong_buffer_len=8, memory_mb=0, cpu_s=0)
    assert cfg.functions[0].batch and cfg.functions[0].weight == 0.5
    assert cfg.functions[1].kwargs == {"method": "flexible", "format_score": 0.1}
    assert cfg.timeout_s == 15.0 and cfg.overlong_buffer_len == 8


def test_function_paths_become_absolute(tmp_path, monkeypatch):
    # the runner resolves them where the user started it; actors run with another cwd
    (tmp_path / "mine.py").write_text("def compute_score(**kw): return 1.0\n")
    monkeypatch.chdir(tmp_path)
    cfg = reward_config('{path="mine.py"}', '{builtin="gsm8k"}')
    assert cfg.functions[0].path == str(tmp_path / "mine.py") and cfg.functions[1].path == ""


def test_a_scoring_child_imports_only_the_libraries_the_jobs_prompts_can_call_for():
    """With no ``[[reward.functions]]`` every child built-in has a child function, but a child
    imports a library at its start only for the rules the job's datasets can call for
    (``job_rules``): a job without reasoning-gym or verifiers prompts never waits for their
    imports, at its start or at a child's restart."""
    from actors.scoring.scorer import job_rules

    plain = decode_topology(apply_overrides({}, []))
    assert job_rules(plain) == {"math"}
    gym = decode_topology(apply_overrides({}, [
        'task.datasets=[{reasoning_gym={name="leg_counting", size=50}}]']))
    assert job_rules(gym) == {"math", "reasoning_gym"}
    preloads = {s.name: s.preload for s in Scoring(plain.reward, job_rules(plain)).children.functions}
    assert preloads["math"] and not preloads["reasoning_gym"] and not preloads["verifiers"]
    preloads = {s.name: s.preload for s in Scoring(gym.reward, job_rules(gym)).children.functions}
    assert preloads["reasoning_gym"] == ("reasoning_gym",) and not preloads["verifiers"]
