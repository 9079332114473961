"""The environment half of a multi-turn verifiers source: an ``Env``'s ``run`` as flowrl's
reset/step environment, one object per episode in a sandboxed child (``[agent.env] verifiers =
true``; ``actors/sampler/agent/env.py`` hosts it, ``actors/data/verifiers_env.py`` loads it).

verifiers' ``run(task, agents)`` is the caller of its conversation: it opens an interaction,
takes the model's reply with ``turn()``, answers with ``turn(message)``, and returns when the
episode is over. flowrl's agent loop is a caller too (it generates, then steps), so the two meet
here: ``run`` is a task on one event loop of the child's (a thread of its own), and each of its
``turn`` calls parks until the agent loop's next ``step`` brings the model's reply. ``reset``
runs it to its first ``turn``; ``step(reply)`` hands the reply over and runs it to its next
``turn`` (whose message is the observation) or to its end (done). The model's turns stop at
``max_turns`` (``agent.max_turns``, or the role's own when smaller): the next ``turn`` comes
back ``terminated``, as verifiers' does at a turn limit, and ``run`` finishes.

The reward is the reward worker's (``verifiers_env.score``, the rubric over the turns); the
rewards ``run`` or ``finalize`` record on the trace themselves are the last step's reward,
weighted as verifiers sums them (``agent.env.reward = "add"``). A ``setup``, ``run`` or
``finalize`` that raises ends the episode with its error: the step reports it (an environment
error, counted) and the reward worker records the sample's reward as failed, since verifiers
does not score a failed rollout.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from actors.data import verifiers_env
from actors.sandbox.protocol import describe

_loop: asyncio.AbstractEventLoop | None = None  # the child's episodes' loop, started once


def _episodes_loop() -> asyncio.AbstractEventLoop:
    """The loop every episode of this child runs on: a ``run`` lives across many calls into
    the child, so it cannot live on a call's own loop."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, name="verifiers-episodes", daemon=True).start()
    return _loop


class Exchange:
    """What an ``Env``'s ``run`` holds as its interaction: ``turn`` hands its message to the
    agent loop as an observation and returns the model's reply; ``trace`` is recorded as
    verifiers records a harness's turns, so ``run`` may read it and record rewards on it."""

    def __init__(self, episode: VerifiersEpisode, task: Any, limit: int) -> None:
        vf = verifiers_env._library()
        self.vf, self.episode, self.limit = vf, episode, limit
        self.trace = verifiers_env.trace_of(vf, task, None)
        self.messages = verifiers_env.prompt_messages(vf, task.data)
        self.replies = 0  # the model's turns so far
        self.started = self.over = False

    async def turn(self, message: Any = None) -> Any:
        from verifiers.v1.agent import Segment
        from verifiers.v1.graph import prepare_turn
        from verifiers.v1.types import content_text

        if self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        if (message is None) == self.started:  # verifiers' rule: a prompted task speaks first
            raise ValueError("a bare turn() takes the task's opening reply, once, first; each "
                             "later turn answers with a message")
        self.started = True
        if self.replies >= self.limit:  # the message goes unconsumed, as at verifiers' limit
            self.over = True
            self.trace.stop("max_turns")
            return Segment(messages=[], terminated=True)
        said = [] if message is None else [self.vf.UserMessage(content=message)] \
            if isinstance(message, str) else list(message)
        reply = await self.episode.ask("\n\n".join(content_text(m.content) or "" for m in said))
        self.messages += said
        answer = self.vf.AssistantMessage(content=reply)
        prepare_turn(self.trace, self.messages).commit(self.vf.Response(
            id=f"turn-{self.replies}", created=0, model="flowrl", message=answer,
            finish_reason="stop"))
        self.messages.append(answer)
        self.replies += 1
        return Segment(messages=[answer])


class Player:
    """The env's one agent: its ``interaction(task)`` is the episode's one ``Exchange``."""

    def __init__(self, episode: VerifiersEpisode, limit: int) -> None:
        self.episode, self.limit = episode, limit
        self.trainable = True  # an env's setup may set it; flowrl trains the model's turns
        self.exchange: Exchange | None = None

    @asynccontextmanager
    async def interaction(self, task: Any, **_: Any) -> AsyncIterator[Exchange]:
        if self.exchange is not None:
            raise RuntimeError("flowrl runs one interaction per episode")
        self.exchange = Exchange(self.episode, task, self.limit)
        yield self.exchange


class Agents:
    """``agents.ROLE`` for the env's one role."""

    def __init__(self, role: str, player: Player) -> None:
        setattr(self, role, player)


class VerifiersEpisode:
    """One episode of a prompt's verifiers environment (its spec and task index travel in the
    prompt's ``extra_info``): ``reset``, ``step``s, ``close``, called from the child's thread;
    the ``run`` they drive lives on the episodes' loop."""

    def __init__(self, max_turns: int = 4) -> None:
        self.max_turns = max_turns
        self.loop = _episodes_loop()
        self.events: asyncio.Queue[tuple[str, Any]] | None = None  # run -> the calls
        self.replies: asyncio.Queue[str] | None = None  # the calls -> run
        self.driver: asyncio.Task[None] | None = None

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def reset(self, prompt: dict[str, Any]) -> str:
        info = prompt.get("extra_info") or {}
        if verifiers_env.SPEC not in info:
            raise ValueError(f"prompt of {prompt.get('data_source')!r} is not a verifiers "
                             "environment's (agent.env.verifiers needs every dataset to be one)")
        loaded = verifiers_env.environment(str(info[verifiers_env.SPEC]))
        task = loaded.tasks[int(info["index"])]
        kind, value = self._call(self._start(loaded, task))
        if kind != "turn":
            raise RuntimeError(value if kind == "error" else
                               "the environment ended before the model's first turn")
        return value

    def step(self, action: str) -> tuple[Any, ...]:
        kind, value = self._call(self._reply(action))
        if kind == "turn":
            return value, 0.0, False
        if kind == "done":
            return "", value, True
        return "", 0.0, True, False, {"error": value}

    def close(self) -> None:
        if self.driver is not None and not self.driver.done():
            self.loop.call_soon_threadsafe(self.driver.cancel)

    async def ask(self, observation: str) -> str:
        """In ``run``'s ``turn``: the observation out to the agent loop, the reply back."""
        assert self.events is not None and self.replies is not None
        await self.events.put(("turn", observation))
        return await self.replies.get()

    async def _start(self, loaded: verifiers_env.Environment, task: Any) -> tuple[str, Any]:
        self.events, self.replies = asyncio.Queue(maxsize=1), asyncio.Queue(maxsize=1)
        own = loaded.max_turns
        limit = self.max_turns if own is None else min(own, self.max_turns)
        self.driver = asyncio.ensure_future(self._drive(loaded, task, limit))
        return await self.events.get()

    async def _reply(self, action: str) -> tuple[str, Any]:
        assert self.events is not None and self.replies is not None
        if self.driver is None or self.driver.done():
            return "error", "the environment's episode is over"
        await self.replies.put(action)
        return await self.events.get()

    async def _drive(self, loaded: verifiers_env.Environment, task: Any, limit: int) -> None:
        """``setup``, ``run`` and ``finalize`` of the env (a single-turn taskset: one bare
        turn), then the rewards they recorded; an exception is the episode's error."""
        assert self.events is not None
        player = Player(self, limit)
        try:
            if loaded.env is None:
                async with player.interaction(task) as exchange:
                    await exchange.turn()
            else:
                agents = Agents(loaded.role, player)
                await loaded.env.setup(agents)
                await loaded.env.run(task, agents)
            if player.exchange is None:
                raise ValueError(f"{type(loaded.env).__name__}.run() ran no agent")
            if loaded.env is not None:
                await loaded.env.finalize(task, _episode(task, player.exchange.trace))
            outcome: tuple[str, Any] = ("done", player.exchange.trace.reward)
        except Exception as exc:  # the env's own code failed: the episode's error
            outcome = ("error", describe(exc))
        await self.events.put(outcome)


def _episode(task: Any, trace: Any) -> Any:
    """The finished episode ``finalize`` judges: the one trace."""
    from verifiers.v1.episode import Episode
    from verifiers.v1.trace import TraceTask

    return Episode(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                  hash=task.hash), traces=[trace], ok=True)
