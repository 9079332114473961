"""The ``[agent]`` section of the topology: multi-turn rollouts with tools or an environment.

Its own module so the topology's schema stays one screenful per concern; ``schema.Topology``
holds it as ``agent``. Every field has a one-line docstring below it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from actors.runtime.config.constraints import (
    FilePath,
    NonNegInt,
    Port,
    PositiveFloat,
    PositiveInt,
    PythonName,
    PythonNameOrUnset,
    one_of,
)
from actors.runtime.config.schema_base import ConfigError, _Section, need, need_child_memory

BUILTIN_TOOLS = ("calculator", "python")


class AgentTool(_Section, frozen=True):
    builtin: Annotated[str, one_of(BUILTIN_TOOLS, unset=True)] = ""
    """A built-in tool: ``calculator`` (exact arithmetic on an expression) or ``python`` (runs a
    program in a new interpreter, returns what it printed); set this or ``path``."""
    path: FilePath = ""
    """A Python file (relative to where the runner is started) holding the tool function; its
    signature, type hints and docstring make the JSON schema the model is shown."""
    name: PythonNameOrUnset = ""
    """The function in ``path``, and the name the model calls the tool by."""
    kwargs: dict[str, str | int | float | bool] = {}
    """Keyword arguments added to every call (not shown to the model)."""

    def __post_init__(self) -> None:
        if bool(self.builtin) == bool(self.path):
            raise ConfigError("set either builtin or path (one of them)")
        need(bool(self.builtin or self.name), "name", "must name the tool's function in path")


class OpenEnvSource(_Section, frozen=True):
    """An OpenEnv environment server (``[agent.env.openenv]``; openenv-core, the ``openenv``
    extra): each episode a session of its own over the library's client."""

    url: str = ""
    """A running server's address (``http://host:port``; its ``/ws`` sessions); set this or
    ``app``."""
    app: str = ""
    """The server's ASGI app, ``package.module:attribute`` (what ``uvicorn`` takes, importable
    from where the runner is started): each sampler serves it itself on a port of its own, and
    starts it again if it dies."""
    action_key: PythonName = "message"
    """The action is ``{action_key: the model's turn}`` (the field of the environment's action
    type that holds text: ``message`` for echo and textarena, ``code`` for coding)."""
    observation_key: str = ""
    """The observation's field the model reads ("": its only field when it has one that is
    text, else all its fields as JSON)."""
    reset_kwargs: dict[str, str | int | float | bool] = {}
    """Keyword arguments of every episode's ``reset`` (``seed``, an environment's own); a
    prompt's ``extra_info.reset_kwargs`` adds to them and wins (a seed or puzzle per row, the
    same for every sample of its group)."""

    def __post_init__(self) -> None:
        need(not (self.url and self.app), "url", "set either url or app (one of them)")
        need(not self.url or self.url.startswith(("http://", "https://", "ws://", "wss://")),
             "url", f"{self.url!r} is not an http:// or ws:// address")
        module, _, attribute = self.app.partition(":")
        need(not self.app or (all(p.isidentifier() for p in module.split("."))
                              and attribute.isidentifier()),
             "app", f"{self.app!r} is not package.module:attribute")

    @property
    def enabled(self) -> bool:
        return bool(self.url or self.app)


class AgentEnv(_Section, frozen=True):
    path: FilePath = ""
    """A Python file holding the environment class: ``reset(prompt) -> observation`` and
    ``step(action) -> (observation, reward, done)``; one object per sample, in a sandboxed child."""
    name: PythonNameOrUnset = ""
    """The class in ``path``."""
    kwargs: dict[str, str | int | float | bool] = {}
    """Keyword arguments of the class's constructor."""
    reward: Literal["add", "replace"] = "add"
    """add: a sample's reward is the scorer's plus the sum of the environment's step rewards;
    replace: that sum alone (no scoring request is sent)."""
    openenv: OpenEnvSource = OpenEnvSource()
    """An OpenEnv environment server instead of a class in ``path``: reset and step over its
    client, one session per episode, in a sandboxed child (``actors/data/openenv_episode.py``)."""
    verifiers: bool = False
    """Each prompt's own verifiers environment instead of a class in ``path``: its ``Env``'s
    turns (``run``) answer the model, in a sandboxed child, and its rubric scores the whole
    conversation (every dataset must be ``verifiers = {...}``; ``actors/data/verifiers_env.py``)."""

    def __post_init__(self) -> None:
        need(bool(self.name) or not self.path, "name", "must name the environment's class in path")
        need(not self.name or bool(self.path), "name", "needs agent.env.path")
        need(not (self.verifiers and self.path), "verifiers",
             "the prompts' verifiers environments replace agent.env.path: set one of them")
        need(not self.verifiers or self.reward == "add", "reward",
             "a verifiers environment's rubric scores the conversation: set add")
        need(not (self.openenv.enabled and (self.path or self.verifiers)), "openenv",
             "an OpenEnv server replaces agent.env.path and agent.env.verifiers: set one of them")

    @property
    def enabled(self) -> bool:
        """An environment is configured: a class, the prompts' verifiers environments or an
        OpenEnv server."""
        return bool(self.path or self.verifiers or self.openenv.enabled)

    @property
    def key(self) -> str:
        """The key that configures it, for a message naming it."""
        return ("agent.env.path" if self.path else "agent.env.verifiers" if self.verifiers
                else "agent.env.openenv")


class AgentRollout(_Section, frozen=True):
    path: str = ""
    """A Python file holding ``async def rollout(client, row)``: the user's own agent, run in a
    sandboxed child against an OpenAI-compatible endpoint the sampler serves per episode
    (``actors/sampler/endpoint/``); set instead of tools or an environment."""
    name: PythonName = "rollout"
    """The function in ``path``: ``(client: openai.AsyncOpenAI, row: dict) -> float | dict |
    None`` (None: the configured scorer scores the transcript; a dict: reward components)."""
    max_calls: PositiveInt = 16
    """Model calls one episode may make; the call past them is refused (400) and the episode
    recorded as failed."""
    episode_timeout_s: PositiveFloat = 300.0
    """Seconds one episode may run; past them its child is killed and the episode is recorded
    as failed (``timeout``)."""
    on_failure: Literal["zero", "drop"] = "zero"
    """An episode that raised, timed out or exceeded max_calls: zero: its samples are trained on
    with reward 0, the failure recorded in their turns; drop: its samples carry the error as a
    reward error, so the replay buffer records and drops their group."""
    branches: Literal["train", "last"] = "train"
    """A call that does not extend the episode's previous one (the agent edited its history,
    summarised, branched): train: the episode yields one more sample in its group, each on
    its own prompt (groups of unequal size: needs a learner of one rank and an estimator that
    groups per prompt, as verl's index does); last: only the episode's last segment trains."""
    host: str = "127.0.0.1"
    """Address the endpoint listens on (the children reach it there)."""
    port: Port = 0
    """TCP port of the endpoint (0: a free one, chosen when the sampler starts)."""


class AgentConfig(_Section, frozen=True):
    tools: list[AgentTool] = []
    """Tools the model may call (``[[agent.tools]]``). With tools or an environment, rollouts
    are multi-turn (``actors/sampler/agent/``)."""
    env: AgentEnv = AgentEnv()
    """An environment instead of tools (``[agent.env]``)."""
    rollout: AgentRollout = AgentRollout()
    """A user's agent function served by an OpenAI-compatible endpoint (``[agent.rollout]``),
    instead of tools or an environment."""
    max_turns: PositiveInt = 4
    """The model's turns per sample; a tool call made in the last one is not run."""
    max_tool_response_tokens: PositiveInt = 256
    """Longer tool output (or environment observation) is cut in the middle to this many tokens."""
    tool_timeout_s: PositiveFloat = 10.0
    """Seconds per tool call or environment step, in a sandboxed child; past them the child is
    killed and the model reads a timeout error."""
    parser: Literal["hermes", "xml"] = "hermes"
    """How the model calls tools: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>``) or ``xml`` (``<NAME>text</NAME>``, the text as the tool's first parameter:
    Search-R1's format)."""
    stop_at_call: bool = True
    """End the model's turn where its first tool call closes (the tokens that end a turn are
    then added as tool tokens); false: the turn runs to EOS and every call in it is run."""
    processes: PositiveInt = 4
    """Sandboxed child processes for tools (or environments) per sampler."""
    memory_mb: NonNegInt = 2048
    """Address-space limit (RLIMIT_AS) of each tool child in MiB (0: none)."""
    cpu_s: NonNegInt = 30
    """CPU seconds one tool call may use in its child (RLIMIT_CPU, re-armed per call; 0: none)."""
    max_tool_failures: NonNegInt = 20
    """A tool that fails (raises, times out or crashes its child; not the model's bad calls)
    this many calls in a row is broken: the job stops (0: never). Below it every failure is an
    error the model reads, counted in the sampler's ``tool_errors``."""

    def __post_init__(self) -> None:
        need_child_memory(self.memory_mb)
        need(not (self.tools and self.env.enabled), self.env.key.removeprefix("agent."),
             "an environment replaces tools: set agent.tools or agent.env, not both")
        names: dict[str, int] = {}
        for i, tool in enumerate(self.tools):
            name = tool.name or tool.builtin
            need(name not in names, f"tools[{i}].name",
                 f"{name!r} is already the name of agent.tools[{names.get(name)}]")
            names[name] = i
        need(not self.rollout.path or not (self.tools or self.env.enabled),
             "rollout.path",
             "a rollout function replaces tools and environments: set one of agent.tools, "
             "agent.env, agent.rollout")

    @property
    def enabled(self) -> bool:
        """Tools, an environment or a rollout function are configured: rollouts are multi-turn."""
        return bool(self.tools or self.env.enabled or self.rollout.path)
