"""Multi-turn verifiers environments in flowrl's agent loop: an ``Env``'s ``run`` answers the
model's turns in a sandboxed child (``agent.env.verifiers``), the reward worker scores the
conversation with the task's rubric, and the sum equals verifiers' own on the same
conversations; a raising ``run`` or reward and an endless game are recorded errors or a clean
stop at the turn limit; what flowrl cannot run is one line at ``check``; a whole tiny job trains
on the environment, validates on its held-out games and reruns a step exactly.

The fixture environment is ``tests/verifiers_guess.py`` (a number-guessing game, in memory);
verifiers comes from ``.venv/verifiers-0.4.0`` as in ``tests/test_verifiers.py``.
"""

from __future__ import annotations

import asyncio
import io
import re
from contextlib import asynccontextmanager

import anyio
import pytest

from actors.data.verifiers_env import VerifiersTask, environment, prompt_messages, spec_of
from actors.job.config.load import apply_overrides, decode_topology
from actors.offline.rerun import rerun
from actors.runtime.config import AgentConfig, ConfigError, DatasetConfig, VerifiersSource
from actors.runtime.config.agent import AgentEnv
from actors.runtime.tensors import from_wire
from actors.sampler.agent.loop import AgentLoop
from actors.scoring.items import items_of
from actors.scoring.scorer import Scoring
from messages.reward import Response, ScoreRequest
from messages.rollout import SamplingParams
from tests.jobs import trained_groups, validations
from tests.test_agent import EOS, ScriptedEngine
from tests.test_verifiers import ENV, check

vf = pytest.importorskip("verifiers.v1", reason="verifiers is an optional extra: bash "
                                                ".ci/setup.sh --tests installs it")
FIXTURE = "tests/verifiers_guess.py"


def source(**args) -> VerifiersSource:
    return VerifiersSource(path=FIXTURE, args=args)


def play(context: str) -> str:
    """The scripted player of game ``N``, by ``N % 5``: follows the hints from 5 (one step a
    turn), always guesses 7 (wrong ones run to the turn limit), writes no tag, writes nothing,
    or writes two tags (the last is its guess)."""
    game = int(re.search(r"ame (\d+)", context).group(1))  # the tiny tokenizer has no "G", ":"
    hints = re.findall(r"\b(higher|lower)\b", context)
    guess = 5 + hints.count("higher") - hints.count("lower")
    return [f"<guess>{guess}</guess>", "<guess>7</guess>", f"it is {guess}", "",
            f"<guess>1</guess> no, <guess>{guess}</guess>"][game % 5] + EOS


GAMES = {"scored": {"size": 50}, "failing": {"size": 12, "endless": True}}  # their args
SECRETS = [t.data.secret for t in environment(spec_of(source(size=12))).tasks]
BROKEN = SECRETS[0]  # the failing games' run raises on this number, their reward on the next
UNSCORED = next(s for s in SECRETS if s != BROKEN)
GAMES["failing"].update(raise_on=BROKEN, reward_raise_on=UNSCORED)


async def play_and_score(tok) -> dict:
    """Every game of ``GAMES`` played through one agent loop (four turns at most) with the
    scripted player and scored by one reward worker's scoring, in their children:
    {name: (prompts, completions, results)} and the loop's statistics."""
    cfg = AgentConfig(env=AgentEnv(verifiers=True), processes=1, max_turns=4)
    sets = {}
    for name, args in GAMES.items():
        task = VerifiersTask(DatasetConfig(verifiers=source(**args), shuffle=False), 0,
                             "task.datasets[0]")
        sets[name] = [task.prompt_at(task.name, row, row) for row in range(task.size)]
    prompts = [p for ps in sets.values() for p in ps]
    loop = AgentLoop(ScriptedEngine(tok, play), tok, cfg)
    await loop.start()
    try:
        out = await loop.generate(prompts, [loop.prompt_ids(p) for p in prompts], 1,
                                  SamplingParams(max_tokens=200))
    finally:
        await loop.aclose()
    completions = [g for (g,) in out]
    items = [item for p, c in zip(prompts, completions, strict=True)
             for item in items_of(ScoreRequest(p.data_source, p.ground_truth, [
                 Response("", len(c.token_ids), c.turns)], p.extra_info))]
    scoring = Scoring(decode_topology(apply_overrides({}, ["reward.processes=1"])).reward)
    try:
        results = await scoring.score(items)
    finally:
        await scoring.aclose()
    played, k = {}, 0
    for name, ps in sets.items():
        played[name] = (ps, completions[k:k + len(ps)], results[k:k + len(ps)])
        k += len(ps)
    return {**played, "statistics": loop.statistics()}


@pytest.fixture(scope="module")
def played(tok) -> dict:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", ENV["PYTHONPATH"])  # for the environments' and scorers' children
        return anyio.run(play_and_score, tok, backend="trio")


class Replay:
    """verifiers' side, driven by the library's own pieces: the env's ``run`` against an
    interaction that commits the recorded replies as a harness commits turns
    (``prepare_turn(...).commit``) and stops at the turn limit, then ``Task.score`` as a
    rollout's close runs it."""

    def __init__(self, task, replies: list[str], limit: int) -> None:
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, TraceTask

        self.replies, self.limit = list(replies), limit
        self.trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data,
                                             key=task.key, hash=task.hash),
                              state=state_cls(type(task))(), agent=AgentInfo(
                                  config=vf.AgentConfig()))
        self.messages = prompt_messages(vf, task.data)
        self.player = self

    async def turn(self, message=None):
        from verifiers.v1.agent import Segment
        from verifiers.v1.graph import prepare_turn

        if self.trace.num_turns >= self.limit:
            return Segment(messages=[], terminated=True)
        if message is not None:
            self.messages.append(vf.UserMessage(content=message))
        reply = vf.AssistantMessage(content=self.replies.pop(0))
        prepare_turn(self.trace, self.messages).commit(vf.Response(
            id="r", created=0, model="m", message=reply, finish_reason="stop"))
        self.messages.append(reply)
        return Segment(messages=[reply])

    @asynccontextmanager
    async def interaction(self, task):
        yield self
        await task.score(self.trace)


async def library_trace(loaded, index: int, replies: list[str], limit: int):
    """The trace verifiers leaves (on asyncio, verifiers' loop)."""
    task = loaded.tasks[index]
    replay = Replay(task, replies, limit)
    await loaded.env.run(task, replay)
    return replay.trace


def test_scores_equal_the_librarys_own(played):
    """50 games (right at once, after hints, never, untagged, empty, two tags; some cut at the
    turn limit) played through the agent loop and scored by the reward worker, against the
    same replies played and scored by verifiers: the sum, each reward and the metric."""
    prompts, completions, results = played["scored"]
    loaded = environment(spec_of(source(**GAMES["scored"])))
    assert len(results) == 50
    seen = set()
    for p, c, ours in zip(prompts, completions, results, strict=True):
        assert not ours.error, ours.error
        replies = [t.content for t in c.turns if t.role == "assistant"]
        assert 1 <= len(replies) <= 4
        theirs = asyncio.run(library_trace(loaded, p.extra_info["index"], replies, 4))
        assert ours.score + c.env_reward == theirs.reward, (replies, ours, theirs.rewards)
        assert c.env_reward == 0.5 * theirs.rewards["first_try"].score
        for name in ("solved", "quick", "formatted", "digits"):
            assert ours.extra[name] == theirs.rewards[name].score, name
        assert ours.extra["metric/turns"] == theirs.metrics["turns"] == len(replies)
        assert c.loss_mask.sum() == sum(t.end - t.start for t in c.turns if t.role == "assistant")
        seen.add(theirs.reward)
    assert len(seen) >= 6  # easy, hard, malformed and empty games score apart


def test_failures_are_recorded_and_an_endless_game_stops_at_max_turns(played):
    """A ``run`` that raises ends its episode with the error (counted; the reward worker
    records the sample as failed), a reward that raises is the sample's recorded error, and a
    game that never ends stops at the turn limit and is scored."""
    _, completions, results = played["failing"]
    assert played["statistics"]["env_errors"] == SECRETS.count(BROKEN) > 0
    for s, c, r in zip(SECRETS, completions, results, strict=True):
        assert len([t for t in c.turns if t.role == "assistant"]) == (1 if s == BROKEN else 4)
        if s == BROKEN:
            assert "the environment failed: RuntimeError: the game of" in r.error, r
        elif s == UNSCORED:
            assert "no scoring of" in r.error, r
        else:
            assert not r.error and r.extra["metric/turns"] == 4.0, r


TWO_ROLES = '''
import verifiers.v1 as vf

class Chats(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="Hello"))

class TalkConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    user: vf.AgentConfig = vf.AgentConfig()

class Talk(vf.Env[TalkConfig]):
    async def run(self, task, agents):
        pass

__all__ = ["Chats", "Talk"]
'''


def test_a_multi_turn_environment_without_the_agent_loop_is_one_line_at_check():
    done = check(f'task.datasets=[{{verifiers={{path="{FIXTURE}"}}}}]')
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.strip() == (
        "error: bad topology: task.datasets[0].verifiers: verifiers_guess is multi-turn (its "
        "GuessEnv plays the turns): set agent.env.verifiers = true"), done.stderr


GAME = f'{{verifiers={{path="{FIXTURE}"}}}}'


@pytest.mark.parametrize("overrides, message", [
    (["agent.env.verifiers=true"], "agent.env.verifiers: plays the prompts' verifiers "
                                   "environments: task.datasets must name them"),
    ([f"task.datasets=[{GAME}]", "validation.datasets=[{builtin='arithmetic'}]",
      "agent.env.verifiers=true"], "validation.datasets[0]: agent.env.verifiers plays each "
                                   "prompt's verifiers environment: every dataset must be"),
    (['task.datasets=[{verifiers={path="{tmp}/talk.py"}}]', "agent.env.verifiers=true"],
     "task.datasets[0].verifiers: {tmp}/talk.py: Talk has 2 agent roles (player, user)"),
    ([f"task.datasets=[{GAME}]", "agent.env.verifiers=true", "agent.env.reward=replace"],
     "agent.env.reward: a verifiers environment's rubric scores the conversation"),
    ([f"task.datasets=[{GAME}]", "agent.env.verifiers=true", "agent.tools=[{builtin='python'}]"],
     "agent.env.verifiers: an environment replaces tools"),
])
def test_what_flowrl_cannot_run_is_refused_naming_the_key(tmp_path, overrides, message):
    (tmp_path / "talk.py").write_text(TWO_ROLES)
    with pytest.raises(ConfigError) as refused:
        decode_topology(apply_overrides({}, [o.replace("{tmp}", str(tmp_path))
                                             for o in overrides]))
    assert message.replace("{tmp}", str(tmp_path)) in str(refused.value)


@pytest.mark.slow  # a minute and a half on two cores: past what the fast suite may add
def test_a_job_trains_and_validates_on_a_multi_turn_environment(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    groups = trained_groups(
        tiny_model, run_dir, 3,
        f'task.datasets=[{{verifiers={{path="{FIXTURE}", args={{size=32}}}}}}]',
        "agent.env.verifiers=true", "agent.max_turns=3", "agent.processes=1",
        "sampler.max_tokens=32", 'sampler.stop=[" "]',  # a space ends a turn: several a game
        f'validation.datasets=[{{verifiers={{path="{FIXTURE}", args={{split="test", size=4}}}}}}]',
        "validation.every=3", "validation.n=2", env=ENV)
    samples = [s for g in groups for s in g.samples]
    assert {g.prompt.data_source for g in groups} == {"verifiers/verifiers_guess"}
    assert all(not s.reward_error for s in samples)
    assert all({"solved", "quick", "formatted", "digits", "metric/turns"} <= set(s.reward_extra)
               for s in samples)
    assert len({s.reward for s in samples}) > 1  # rewards vary
    for s in samples:  # the trained tokens are the model's turns alone
        mask = from_wire(s.loss_mask).tolist()
        assert [k for k, m in enumerate(mask) if m] == [
            k for t in s.turns if t.role == "assistant" for k in range(t.start, t.end)]
    assert any(t.role == "user" and t.end > t.start for s in samples for t in s.turns)
    assert [v["step"] for v in validations(run_dir)] == [0, 3]
    out = io.StringIO()
    assert rerun(run_dir, 3, out=out) == 0, out.getvalue()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from actors.data.chat import ChatTokenizer
    from tests.test_agent import WORDS
    from tests.tiny_model import build_tiny_model

    return ChatTokenizer(build_tiny_model(tmp_path_factory.mktemp("turns") / "model",
                                          words=(*WORDS, "<guess>", "</guess>")))


def test_run_cannot_outlive_its_episode():
    """Closing an episode mid-game cancels its ``run`` (nothing parks on the child's loop)."""
    from actors.data.verifiers_episode import VerifiersEpisode

    spec = spec_of(source(size=2))
    episode = VerifiersEpisode(max_turns=4)
    assert episode.reset({"extra_info": {"verifiers": spec, "index": 0}}) == ""
    assert episode.step("<guess>0</guess>")[2] is False
    episode.close()
    driver = episode.driver
    assert driver is not None
    asyncio.run_coroutine_threadsafe(asyncio.wait([driver]), episode.loop).result()
    assert driver.cancelled()


def test_a_single_turn_taskset_plays_one_turn():
    """Under ``agent.env.verifiers`` a taskset without an ``Env`` is one model turn, then done
    with no reward of its own (its rubric is the reward worker's)."""
    from actors.data.verifiers_episode import VerifiersEpisode

    spec = spec_of(VerifiersSource(path="tests/verifiers_addition.py", args={"size": 3}))
    episode = VerifiersEpisode(max_turns=4)
    assert episode.reset({"extra_info": {"verifiers": spec, "index": 0}}) == ""
    assert episode.step("<answer>3</answer>") == ("", 0, True)
    episode.close()
