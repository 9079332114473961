"""A user's environment class, one object per episode, in sandboxed children.

``[agent.env]`` names a class with ``reset(prompt) -> observation`` and ``step(action) ->
(observation, reward, done)`` (gymnasium's five-tuple works too). Each episode's object lives
in one child (``actors.sandbox.tools.env_*``), so every call of an episode goes to that child:
the host keeps ``agent.processes`` lanes, each one child, and gives a new episode the
lane with the fewest episodes open. ``prompt`` is a dict of the prompt's fields (``messages``
as role/content dicts, ``data_source``, ``ground_truth``, ``extra_info``).

A step that raises is an error observation the model reads, and the episode goes on; a step
that hangs past ``agent.tool_timeout_s`` or crashes its child ends the episode (the child, and
every object in it, is replaced), as does a reset that fails, or a step that reports an error
as done (gymnasium's info ``error``). ``agent.env.verifiers`` hosts each prompt's verifiers
environment the same way (``actors/data/verifiers_episode.py``), and ``agent.env.openenv`` a
session with an OpenEnv server (``actors/data/openenv_episode.py``; the server its ``app``
names is served by this host, ``env_server.py``).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

from actors.data.chat import as_dicts
from actors.runtime.config import AgentConfig
from actors.sampler.agent.env_server import EnvServer
from actors.sandbox.children import Children
from actors.sandbox.protocol import Call, FunctionSpec
from messages.rollout import Prompt

TOOLS_MODULE = "actors.sandbox.tools"
VERIFIERS_MODULE = "actors.data.verifiers_episode"  # agent.env.verifiers: its episodes' class
OPENENV_MODULE = "actors.data.openenv_episode"  # agent.env.openenv: its episodes' class
RESET, STEP, CLOSE = 0, 1, 2  # function indices in every lane


@dataclass(frozen=True)
class StepResult:
    text: str
    """The observation (or ``Error: ...``): what the model reads next."""
    reward: float = 0.0
    done: bool = False
    error: str = ""
    failure: str = ""
    """raised, timeout or crash ("" when the step succeeded)."""
    latency_s: float = 0.0


class EnvHost:
    """Lanes of one child each, holding episodes' environment objects."""

    def __init__(self, cfg: AgentConfig) -> None:
        env, openenv = cfg.env, cfg.env.openenv
        self.server = EnvServer(openenv.app) if openenv.app else None
        if env.verifiers:
            kwargs = {"env_path": "", "env_module": VERIFIERS_MODULE,
                      "env_name": "VerifiersEpisode", "env_kwargs": {"max_turns": cfg.max_turns}}
        elif openenv.enabled:
            kwargs = {"env_path": "", "env_module": OPENENV_MODULE, "env_name": "OpenEnvEpisode",
                      "env_kwargs": {
                          "url": self.server.url if self.server else openenv.url,
                          "action_key": openenv.action_key,
                          "observation_key": openenv.observation_key,
                          "reset_kwargs": dict(openenv.reset_kwargs),
                          "timeout_s": cfg.tool_timeout_s}}
        else:
            kwargs = {"env_path": env.path, "env_module": "", "env_name": env.name,
                      "env_kwargs": dict(env.kwargs)}
        # the library is imported as a child starts, off the clock of its first reset
        preload = ((VERIFIERS_MODULE, "verifiers.v1") if env.verifiers else
                   (OPENENV_MODULE, "openenv.core.generic_client") if openenv.enabled else ())
        specs = [FunctionSpec(module=TOOLS_MODULE, name="env_reset", kwargs=kwargs,
                              returns="text", preload=preload),
                 FunctionSpec(module=TOOLS_MODULE, name="env_step", returns="step"),
                 FunctionSpec(module=TOOLS_MODULE, name="env_close", returns="text")]
        self.lanes = [Children(specs, size=1, timeout_s=cfg.tool_timeout_s,
                                memory_mb=cfg.memory_mb, cpu_s=cfg.cpu_s, limits_key="agent",
                              timeout_key="tool_timeout_s")
                      for _ in range(cfg.processes)]
        self._open = [0] * len(self.lanes)  # episodes open per lane
        self._ids = itertools.count()
        self._prefix = f"{os.getpid()}-{time.time_ns()}"
        self.steps = self.errors = 0
        self.retried = 0  # episodes played again after the served app died under them

    def episode(self) -> Episode:
        if self.server is not None:
            self.server.keep_up()
        lane = min(range(len(self.lanes)), key=self._open.__getitem__)
        self._open[lane] += 1
        return Episode(self, lane, f"{self._prefix}-{next(self._ids)}")

    async def aclose(self) -> None:
        for lane in self.lanes:
            await lane.aclose()
        if self.server is not None:
            self.server.close()


class Episode:
    """One sample's environment object: ``reset``, ``step``s, then ``close``."""

    def __init__(self, host: EnvHost, lane: int, instance: str) -> None:
        self.host, self.lane, self.instance = host, lane, instance
        self.child = host.lanes[lane]  # the lane's one child, which holds the episode's object
        self.closed = False
        # the served app this episode's session is with (none: a class, or a server at a url)
        self.process = host.server.process if host.server is not None else None
        self.server_lost = False  # a call failed because that server had died

    def _failed(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            self.server_lost = True

    async def reset(self, prompt: Prompt) -> StepResult:
        row = {"messages": as_dicts(prompt.messages), "data_source": prompt.data_source,
               "ground_truth": prompt.ground_truth, "extra_info": dict(prompt.extra_info)}
        started = time.monotonic()
        (o,) = await self.child.call(Call(RESET, [{"instance": self.instance, "prompt": row}], 1))
        if o.error:
            self._failed()
            return StepResult(f"Error: {o.error}", done=True, error=o.error,
                              failure=o.failure or "raised", latency_s=time.monotonic() - started)
        return StepResult(o.text, latency_s=time.monotonic() - started)

    async def step(self, action: str) -> StepResult:
        self.host.steps += 1
        started = time.monotonic()
        (o,) = await self.child.call(Call(STEP, [{"instance": self.instance, "action": action}], 1))
        latency = time.monotonic() - started
        if o.error:
            self.host.errors += 1
            self._failed()
            # a killed or dead child took the object with it: the episode cannot go on
            done = o.failure in ("timeout", "crash") or bool(o.extra.get("done"))
            return StepResult(f"Error: {o.error}", done=done,
                              error=o.error, failure=o.failure or "raised", latency_s=latency)
        return StepResult(o.text, o.score, bool(o.extra.get("done")), latency_s=latency)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.host._open[self.lane] -= 1
        await self.child.call(Call(CLOSE, [{"instance": self.instance}], 1))
