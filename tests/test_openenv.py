"""OpenEnv environment servers as an agent's environment (``[agent.env.openenv]``): observations,
rewards and ends equal to the library's own client's on every kind of action, bad keys one line
at ``check``, a server a sampler serves itself started again when it dies, and a whole tiny job
that trains on one and reruns exactly.

The server is openenv's own (``create_app``, served by uvicorn) for ``tests/openenv_guess.py``.
``.ci/setup.sh --tests`` installs openenv-core the way it installs verifiers: into
``.venv/openenv-0.3.0`` without its declared gradio, put on the path here and in the job's
processes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import pytest

from actors.data.openenv_episode import observation_text
from actors.job.config.load import apply_overrides, decode_topology
from actors.offline.rerun import rerun
from actors.runtime.config import ConfigError
from actors.sampler.agent.env import EnvHost
from actors.sampler.agent.env_server import EnvServer
from actors.sampler.agent.loop import AgentLoop
from messages.rollout import ChatMessage, Prompt
from tests.jobs import ROOT, trained_groups

OE_DIR = ROOT / ".venv" / "openenv-0.3.0"
if OE_DIR.is_dir() and str(OE_DIR) not in sys.path:
    sys.path.append(str(OE_DIR))
pytest.importorskip("openenv.core.generic_client", reason="openenv-core is an optional extra: "
                                                         "bash .ci/setup.sh --tests installs it")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
    os.environ.get("PYTHONPATH"), str(ROOT), str(OE_DIR)]))}
APP = "tests.openenv_guess:app"


@pytest.fixture
def library_path(monkeypatch):
    """The library and the tests' app on the path of every process started here (the server,
    the sandboxed children)."""
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])


@pytest.fixture
def server(library_path):
    served = EnvServer(APP)
    yield served
    served.close()


def agent(*overrides: str):
    return decode_topology(apply_overrides({}, ["agent.processes=2", *overrides])).agent


@asynccontextmanager
async def hosted(*overrides: str) -> AsyncIterator[EnvHost]:
    """An environment host for the agent section of ``overrides``, closed after."""
    host = EnvHost(agent(*overrides))
    try:
        yield host
    finally:
        await host.aclose()


# easy (the digit), hard (the digit inside text, after another), malformed (no digit), empty
ACTIONS = ["7", "I think 3, no: 5", "no idea", "", "0", "9 then 2", "  8  ", "twelve"]


SEEDS = (3, 7, 0, 9)  # the digit to guess (reset_kwargs), one host each


def episodes(k: int) -> list[list[str]]:
    """Five episodes of three actions for the ``k``-th seed: 60 steps in all, every kind of
    action in every place."""
    return [[ACTIONS[(5 * k + e + j) % len(ACTIONS)] for j in range(3)] for e in range(5)]


def library_steps(url: str, seed: int, actions: list[str]) -> list[tuple[str, float, bool]]:
    """The library's own client on one session: reset, then each action."""
    from openenv.core.generic_client import GenericEnvClient

    with GenericEnvClient(base_url=url).sync() as env:
        first = env.reset(seed=seed)
        out = [(first.observation["message"], float(first.reward or 0.0), first.done)]
        for action in actions:
            r = env.step({"message": action})
            out.append((r.observation["message"], float(r.reward or 0.0), r.done))
        return out


@pytest.mark.anyio
async def test_steps_equal_the_librarys_own(server):
    """Sixty steps through flowrl's sandboxed episodes (all at once: each its own session) and
    through openenv's client: the same observations, rewards and ends."""
    ours: dict[tuple[int, int], list[tuple[str, float, bool]]] = {}
    prompt = Prompt(0, [ChatMessage("user", "guess")], "guess", "")

    async def play(host: EnvHost, key: tuple[int, int], actions: list[str]) -> None:
        episode = host.episode()
        first = await episode.reset(prompt)
        steps = [(first.text, first.reward, first.done)]
        for action in actions:
            s = await episode.step(action)
            assert not s.error, s
            steps.append((s.text, s.reward, s.done))
        await episode.close()
        ours[key] = steps

    async with AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(hosted(
            f"agent.env.openenv.url='{server.url}'",
            f"agent.env.openenv.reset_kwargs={{seed={seed}}}")) for seed in SEEDS]
        async with anyio.create_task_group() as tg:
            for k, host in enumerate(hosts):
                for e, actions in enumerate(episodes(k)):
                    tg.start_soon(play, host, (k, e), actions)
    theirs = {(k, e): await anyio.to_thread.run_sync(library_steps, server.url, seed, actions)
              for k, seed in enumerate(SEEDS) for e, actions in enumerate(episodes(k))}
    assert sum(len(v) - 1 for v in ours.values()) == 60
    assert ours == theirs
    rewards = [r for steps in ours.values() for _, r, _ in steps]
    assert 0 < rewards.count(1.0) < len(rewards)  # right and wrong guesses both among them


def test_what_the_model_reads_of_an_observation():
    assert observation_text({"message": "Higher."}) == "Higher."
    assert observation_text({"board": [1, 2], "message": "go"}) == \
        '{"board": [1, 2], "message": "go"}'
    assert observation_text({"n": 3}) == '{"n": 3}'
    assert observation_text({"board": [1, 2], "message": "go"}, "message") == "go"
    with pytest.raises(KeyError, match="no field 'text'.*its fields: board, message"):
        observation_text({"board": [1], "message": "go"}, "text")


@pytest.mark.anyio
async def test_a_prompts_own_reset_arguments_win(server):
    """``extra_info.reset_kwargs`` of a dataset row (a table there: JSON text on the wire, as
    every nested extra_info value) updates ``agent.env.openenv.reset_kwargs``: its seed picks
    the digit for every sample of its group. One that is not a table is the reset's error."""
    async def reward_of(host: EnvHost, extra_info: dict, guess: str) -> float:
        episode = host.episode()
        first = await episode.reset(Prompt(0, [], "g", "", extra_info=extra_info))
        assert not first.error, first
        step = await episode.step(guess)
        await episode.close()
        return step.reward

    async with hosted(f"agent.env.openenv.url='{server.url}'",
                      "agent.env.openenv.reset_kwargs={seed=3}") as host:
        assert await reward_of(host, {}, "3") == 1.0
        assert await reward_of(host, {"reset_kwargs": json.dumps({"seed": 5})}, "5") == 1.0
        assert await reward_of(host, {"reset_kwargs": json.dumps({"seed": 5})}, "3") == 0.0
        episode = host.episode()
        bad = await episode.reset(Prompt(0, [], "g", "", extra_info={"reset_kwargs": "[5]"}))
        assert bad.done and "extra_info['reset_kwargs'] is a list" in bad.error, bad
        await episode.close()


@pytest.mark.anyio
async def test_a_refused_action_is_an_error_the_model_reads(server):
    """An action under a field the environment's action type lacks: the server's validation
    error, as the step's error; the episode goes on."""
    async with hosted(f"agent.env.openenv.url='{server.url}'",
                      "agent.env.openenv.action_key=code") as host:
        episode = host.episode()
        assert (await episode.reset(Prompt(0, [], "g", ""))).text == "Guess a digit from 0 to 9."
        step = await episode.step("7")
        assert step.failure == "raised" and not step.done and "message" in step.error, step
        assert host.errors == 1
        await episode.close()


@pytest.mark.anyio
async def test_a_served_app_that_dies_is_started_again(library_path):
    async with hosted(f"agent.env.openenv.app={APP}") as host:
        assert host.server is not None
        before = host.episode()
        assert (await before.reset(Prompt(0, [], "g", ""))).text == "Guess a digit from 0 to 9."
        host.server.process.kill()
        await anyio.to_thread.run_sync(host.server.process.wait)
        step = await before.step("7")  # its session went with the server
        assert step.error and step.failure == "raised", step
        await before.close()
        after = host.episode()  # the next episode finds it dead: served again, same address
        assert host.server.restarts == 1
        assert (await after.reset(Prompt(0, [], "g", ""))).text == "Guess a digit from 0 to 9."
        assert (await after.step("7")).reward == 1.0
        await after.close()
    assert host.server.process.poll() is not None  # gone with the host


@pytest.mark.anyio
async def test_a_server_that_never_answers_is_a_timeout_recorded(library_path):
    """A socket that takes connections and never answers: the reset is killed with its child
    at ``agent.tool_timeout_s`` and comes back as a timeout (the agent loop then records it and
    lets the model answer alone)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        async with hosted(f"agent.env.openenv.url='http://127.0.0.1:{silent.getsockname()[1]}'",
                          "agent.tool_timeout_s=2") as host:
            episode = host.episode()
            first = await episode.reset(Prompt(0, [], "g", ""))
            assert first.done and first.failure == "timeout" and first.error, first
            await episode.close()


@pytest.mark.anyio
async def test_an_episode_whose_served_app_died_is_played_again(library_path, monkeypatch,
                                                                 tmp_path):
    """The server dies during an episode's second turn: that episode is played once more from
    its start on the server started again, and the sample is the second play's (no error in
    it); counted in the sampler's status."""
    from actors.data.chat import ChatTokenizer
    from tests.test_agent import EOS, ScriptedEngine, run_loop
    from tests.tiny_model import build_tiny_model

    tok = ChatTokenizer(build_tiny_model(tmp_path / "model"))
    cfg = agent(f"agent.env.openenv.app={APP}", "agent.max_turns=3")
    holder: dict = {}

    def script(context: str) -> str:
        # (the tiny tokenizer has no capitals: "Lower." reads "<pad>ower<pad>")
        if "ower" in context and not holder.get("killed"):  # once, after the first guess
            holder["killed"] = True
            holder["loop"].env.server.process.kill()
            holder["loop"].env.server.process.wait()
        return "9" + EOS if "ower" not in context else "7" + EOS

    engine = ScriptedEngine(tok, script)
    original = AgentLoop.__init__

    def keep(self, *args, **kwargs):
        original(self, *args, **kwargs)
        holder["loop"] = self

    monkeypatch.setattr(AgentLoop, "__init__", keep)
    loop, _, out = await run_loop(tok, engine, cfg, [Prompt(0, [ChatMessage("user", "go")],
                                                            "guess", "")], n=1)
    ((played,),) = out
    assert [t.content for t in played.turns if t.role == "user"] == [
        "Guess a digit from 0 to 9.", "Lower.", "Right."]
    assert not any(t.error for t in played.turns) and played.env_reward == 1.0
    stats = loop.statistics()
    assert stats["env_server_restarts"] == 1 and stats["env_episodes_retried"] == 1, stats


@pytest.mark.parametrize("override, message", [
    (f"agent.env.openenv={{url='http://127.0.0.1:1', app='{APP}'}}",
     "agent.env.openenv.url: set either url or app"),
    ("agent.env.openenv.url=localhost:8000", "agent.env.openenv.url: 'localhost:8000' is not an "
                                             "http:// or ws:// address"),
    ("agent.env.openenv.app=tests.openenv_guess", "agent.env.openenv.app: 'tests.openenv_guess' "
                                                  "is not package.module:attribute"),
    ("agent.env.openenv.action_key='a b'", "agent.env.openenv.action_key: "),
])
def test_bad_keys_are_refused_naming_them(override, message):
    with pytest.raises(ConfigError) as info:
        decode_topology(apply_overrides({}, [override]))
    assert message in str(info.value)
    both = ["agent.env.openenv.url='http://127.0.0.1:1'", "agent.tools=[{builtin='python'}]"]
    with pytest.raises(ConfigError, match="agent.env.openenv: an environment replaces tools"):
        decode_topology(apply_overrides({}, both))


def check(*overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "runner.py", "check", "topology.toml", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, env=env or ENV)


def test_a_missing_module_or_package_is_one_line_at_check():
    done = check("agent.env.openenv.app=no_such_envs.server:app")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "agent.env.openenv.app: no module 'no_such_envs.server' importable from" in done.stderr
    without = {**os.environ, "PYTHONPATH": str(ROOT)}  # not the library's folder
    done = check(f"agent.env.openenv.app={APP}", env=without)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert ("agent.env.openenv: openenv-core is not installed: pip install 'flowrl[openenv]' "
            "(openenv-core==0.3.0)") in done.stderr


def test_a_job_trains_on_a_server_it_serves_and_reruns_exactly(tiny_model, tmp_path):
    """The environment's rewards alone (``reward = "replace"``), from a server each sampler
    serves itself."""
    run_dir = tmp_path / "run"
    groups = trained_groups(tiny_model, run_dir, 3, f"agent.env.openenv.app={APP}",
                            "agent.env.reward=replace", "agent.max_turns=3", "agent.processes=2",
                            "sampler.max_tokens=48", env=ENV)
    samples = [s for g in groups for s in g.samples]
    assert samples and all(s.turns and s.turns[0].role == "user" for s in samples)
    # the server's first observation, then the model's guesses and its answers
    assert all(s.turns[0].content == "Guess a digit from 0 to 9." for s in samples)
    answers = {t.content for s in samples for t in s.turns[1:] if t.role == "user"}
    assert answers <= {"Higher.", "Lower.", "Right.", "No digit in your guess."}, answers
    assert all(s.reward == sum(t.reward or 0.0 for t in s.turns) for s in samples)
    out = io.StringIO()
    assert rerun(run_dir, 3, out=out) == 0, out.getvalue()
