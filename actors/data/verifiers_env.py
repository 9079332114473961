"""verifiers environments as prompt sources, scored by their own rewards.

``[[task.datasets]] verifiers = { id = "my_env", args = { ... } }`` (an installed environment
package, as ``vf-eval`` and prime-rl name it) or ``verifiers = { path = "my_env.py" }`` (a file):
either exports its ``Taskset`` subclass in ``__all__``, which is what verifiers' own
``load_environment`` reads, or defines ``load_environment(**args)`` returning one. ``args``
are the taskset config's fields (a split, a size, ...), so validation names the same
environment with its held-out args in ``[[validation.datasets]]``.
A draw takes one of the taskset's tasks (in a seeded order per pass with ``shuffle``, as a
file's rows): its system prompt (``TaskData.system_prompt``) and its prompt (a text, or messages
with few-shot turns) become the chat messages, as verifiers' chat harness (``null``) sends them.

The data source is ``verifiers/NAME`` and each prompt carries the environment's spec in
``extra_info``, so the reward worker's child rebuilds the same taskset once (a taskset loads the
same tasks in every process: a ``load()`` that draws must be seeded) and scores a reply
as verifiers does: a trace of the prompt and the reply, ``Task.score`` over it (every
``@vf.reward`` and every reward its config plugs in), the weighted sum as the score and each
reward's own value recorded under its name.

A multi-turn environment is a module that also exports its ``Env`` (one agent role, as
verifiers' TextArena games are): its ``run(task, agents)`` is the environment's side of the
conversation. Its turns are driven by flowrl's agent loop (``[agent.env] verifiers = true``,
``actors/data/verifiers_episode.py``): the model's replies are the sample's trained tokens,
what ``run`` sends back between them are observations (loss mask 0), and its returning ends
the episode. The reward worker scores the whole conversation as verifiers does: a trace of the
prompt and every turn, then ``Task.score``; rewards ``run`` records itself are the
environment's reward, added to the rubric's (``agent.env.reward = "add"``).

What flowrl cannot run is refused at ``check`` in one line: tools (verifiers serves them as MCP
servers), a container, its own harness, two or more agent roles (a modeled user), ``@vf.stop``
hooks, tasks without a prompt, judge models or rewards that read a sandbox.
verifiers is an optional extra (``pip install 'flowrl[verifiers]'``), imported only when a
topology names an environment.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from actors.data.files import PassOrder
from actors.data.tasks import Task
from actors.runtime.config import DatasetConfig, VerifiersSource
from messages.rollout import ChatMessage, Prompt

INSTALL = "pip install 'flowrl[verifiers]' (verifiers==0.4.0)"
PREFIX = "verifiers/"  # the data sources of its prompts
SPEC = "verifiers"  # the extra_info key of a prompt's environment spec


def _library() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ValueError(f"verifiers is not installed: {INSTALL}") from None
    return vf


@dataclass(frozen=True)
class Environment:
    """A loaded taskset: its tasks in ``load()`` order (``idx`` set, as verifiers iterates),
    and the ``Env`` that plays them turn by turn (None: single-turn)."""

    name: str
    tasks: list[Any]
    env: Any = None
    role: str = ""
    """The env's one agent role (its ``AgentConfig`` field)."""

    @property
    def multi_turn(self) -> bool:
        return self.env is not None

    @property
    def max_turns(self) -> int | None:
        """The role's own turn limit (None: flowrl's ``agent.max_turns`` alone)."""
        return None if self.env is None else getattr(self.env.config, self.role).max_turns


def _one_line(exc: BaseException) -> str:
    """An exception as one line: pydantic's validation errors joined ``loc: msg; ...``."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(args)'}: {e['msg']}"
                             for e in errors())
        except (TypeError, KeyError):
            pass
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _module(fields: dict[str, Any]) -> ModuleType:
    """The environment's module: the installed package ``id`` or the file ``path``."""
    if fields["path"]:
        from verifiers.v1.utils.loaders import file_module

        try:
            return file_module(fields["path"])
        except ModuleNotFoundError as exc:
            raise ValueError(f"{fields['path']} needs a package that is not installed: "
                             f"{exc} (pip install {exc.name})") from None
        except Exception as exc:  # the user's file failed to import: its error, one line
            raise ValueError(f"{fields['path']} did not import: {_one_line(exc)}") from None
    # as verifiers' loader: a Hub id's name without owner and version, one of its own tasksets
    # (verifiers.v1.tasksets.NAME) before an installed package
    name = fields["id"].rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    own = f"verifiers.v1.tasksets.{name}"
    try:
        return importlib.import_module(own if importlib.util.find_spec(own) else name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            how = (f"prime env install {fields['id']}" if "/" in fields["id"] else
                   f"pip install {fields['id']}` or `prime env install OWNER/{fields['id']}")
            raise ValueError(f"no verifiers environment {fields['id']!r}: no installed package "
                             f"{name!r} (install it: `{how}`; or give path = a file)") from None
        raise ValueError(f"environment {fields['id']!r} needs a package that is not installed: "
                         f"{exc} (pip install {exc.name})") from None
    except Exception as exc:
        raise ValueError(f"environment {fields['id']!r} did not import: {_one_line(exc)}") from None


def _exported(module: ModuleType, base: type) -> list[type]:
    found = [getattr(module, n, None) for n in getattr(module, "__all__", ())]
    return [c for c in found if isinstance(c, type) and issubclass(c, base) and c is not base]


def _unsupported(vf: Any, module: ModuleType, taskset: Any) -> str:
    """Why flowrl cannot run the environment ("" when it can)."""
    task_cls = type(taskset).task_type()
    if _exported(module, vf.Harness):
        return "it brings its own harness"
    if tools := [*type(taskset).toolsets(taskset.config), *task_cls.toolsets(taskset.config.task)]:
        return (f"it has tools ({', '.join(type(t).__name__ for t in tools)}), which verifiers "
                "serves to its harness as MCP servers")
    if task_cls.NEEDS_CONTAINER:
        return "its tasks need a container"
    return ""


def _scored_offline(task: Any) -> str:
    """Why a task's rubric cannot score a reply alone ("" when it can): a reward that reads the
    runtime (a sandbox) or a judge (a model behind an endpoint)."""
    if task.config.judges:
        return "its rubric calls judge models"
    needs = [fn.__name__ for fn in (*task.hooks("reward"), *task.hooks("metric"))
             if (p := inspect.signature(fn).parameters.get("runtime")) is not None
             and p.default is inspect.Parameter.empty]
    return f"its rewards read a sandbox runtime ({', '.join(needs)})" if needs else ""


def _taskset(vf: Any, module: ModuleType, label: str, args: dict[str, Any]) -> tuple[Any, Any]:
    """The module's taskset made with ``args``, and the ``Env`` made with it (None: a plain
    taskset): its exported ``Taskset`` class with its own config, else what its
    ``load_environment(**args)`` returns (a taskset, or an env and its taskset)."""
    classes = _exported(module, vf.Taskset)
    loader = getattr(module, "load_environment", None)
    if not classes and callable(loader):
        try:
            made = loader(**args)
        except Exception as exc:
            raise ValueError(f"{label}: load_environment(**{args}) failed: "
                             f"{_one_line(exc)}") from None
        if isinstance(made, vf.Env):
            return made.taskset, None if type(made) is vf.SingleAgentEnv else made
        if not isinstance(made, vf.Taskset):
            raise ValueError(f"{label}: load_environment returned a {type(made).__name__}, not "
                             "a verifiers Taskset or Env")
        return made, None
    if len(classes) != 1:
        raise ValueError(f"{label} must export one Taskset subclass in __all__ (it exports "
                         f"{len(classes)}: {[c.__name__ for c in classes]}) or define "
                         "load_environment")
    from verifiers.v1.utils.generic import concrete_type

    config_cls = concrete_type(classes[0], vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    try:
        taskset = classes[0](config_cls(**args))
    except Exception as exc:  # pydantic's refusal of an arg, or the taskset's own
        raise ValueError(f"{label} refused its args {args}: {_one_line(exc)}") from None
    return taskset, _exported_env(vf, module, label)


def _exported_env(vf: Any, module: ModuleType, label: str) -> Any:
    """The ``Env`` the module exports beside its taskset (as verifiers pairs them), on its
    config's defaults, or None. Only its hooks run (``setup``, ``run``, ``finalize``): the
    serving machinery its constructor builds (the taskset by id, harnesses, runtimes) is what
    flowrl's agent loop replaces, so the object is made without it."""
    classes = [c for c in _exported(module, vf.Env) if c is not vf.SingleAgentEnv]
    if not classes:
        return None
    if len(classes) > 1:
        raise ValueError(f"{label} exports {len(classes)} Env classes "
                         f"({[c.__name__ for c in classes]}): export one")
    from verifiers.v1.utils.generic import concrete_type

    config_cls = concrete_type(classes[0], vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    try:
        config = config_cls()
    except Exception as exc:
        raise ValueError(f"{label}: {config_cls.__name__}() failed: {_one_line(exc)}") from None
    cls: Any = classes[0]  # a verifiers Env subclass (untyped here)
    env = cls.__new__(cls)
    env.config = config
    return env


def _role(vf: Any, label: str, env: Any) -> str:
    """The env's one agent role; two or more (a modeled user, a judge) need models flowrl
    does not serve to the environment."""
    from verifiers.v1.configs.agent import agent_config_fields

    roles = list(agent_config_fields(env.config))
    if len(roles) != 1:
        raise ValueError(f"{label}: {type(env).__name__} has {len(roles)} agent roles "
                         f"({', '.join(roles) or 'none'}); flowrl trains one policy against "
                         "the environment, so it runs envs of exactly one role")
    return roles[0]


@functools.lru_cache(maxsize=16)
def environment(spec: str) -> Environment:
    """The environment of a spec (JSON: id or path, args, size), loaded once per process.
    ValueError names what is wrong in one line: the package, the name, an arg, or a kind of
    environment flowrl does not run yet."""
    return load(spec)


def check(spec: str) -> None:
    """What ``check`` asks of an environment: it loads (``environment``), and a second load
    gives the same tasks, as the replay buffer's and each scoring child's will."""
    first, again = environment(spec), load(spec)
    if [t.key for t in first.tasks] != [t.key for t in again.tasks]:
        raise ValueError(f"{first.name}: its tasks differ from one load to the next (the "
                         "replay buffer and the scoring children load it apart): seed what "
                         "its load() draws")


def load(spec: str) -> Environment:
    """The environment of a spec, loaded afresh (``environment`` keeps one per process)."""
    vf = _library()
    fields = json.loads(spec)
    module = _module(fields)
    label = fields["id"] or fields["path"]
    taskset, env = _taskset(vf, module, label, fields["args"])
    if why := _unsupported(vf, module, taskset):
        raise ValueError(f"{label}: not supported ({why})")
    role = _role(vf, label, env) if env is not None else ""
    if not taskset.bounded and not fields["size"]:
        raise ValueError(f"{label} is an infinite taskset: set size (the tasks taken)")
    view = taskset.take(fields["size"]) if fields["size"] else taskset
    try:
        tasks = list(view)
    except Exception as exc:
        raise ValueError(f"{label} failed to load its tasks: {_one_line(exc)}") from None
    if not tasks:
        raise ValueError(f"{label} holds no tasks (args {fields['args']})")
    if why := _scored_offline(tasks[0]):
        raise ValueError(f"{label}: {why} (not supported yet)")
    if stops := [fn.__name__ for fn in tasks[0].hooks("stop")]:
        raise ValueError(f"{label}: not supported (its @vf.stop hooks {', '.join(stops)}: "
                         "end the episode from the Env's run instead)")
    if any(t.data.prompt is None for t in tasks):
        raise ValueError(f"{label}: not supported (a task with no prompt: the user opens the "
                         "conversation)")
    name = Path(label).stem if fields["path"] else module.__name__.rsplit(".", 1)[-1]
    return Environment(name, tasks, env, role)


def spec_of(source: VerifiersSource) -> str:
    path = str(Path(source.path).resolve()) if source.path else ""
    return json.dumps({"id": source.id, "path": path, "args": source.args,
                       "size": source.size}, sort_keys=True)


def chat_messages(data: Any) -> list[ChatMessage]:
    """A task's prompt as chat messages: its system prompt first, then its prompt (a text is one
    user message; messages keep their roles, few-shot assistant turns included)."""
    from verifiers.v1.types import content_text

    out = [ChatMessage("system", data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*out, ChatMessage("user", data.prompt)]
    return [*out, *(ChatMessage(m.role, content_text(m.content) or "") for m in data.prompt)]


class VerifiersTask(Task):
    """The tasks of one verifiers environment, visited in a seeded random order per pass when
    ``shuffle`` (as a file's rows are)."""

    def __init__(self, config: DatasetConfig, seed: int, key: str) -> None:
        assert config.verifiers is not None
        self.seed = seed
        self.shuffle = config.shuffle
        self.name = config.label
        self.spec = spec_of(config.verifiers)
        try:
            self.environment = environment(self.spec)
        except ValueError as exc:
            raise ValueError(f"{key}.verifiers: {exc}") from None
        self.size = len(self.environment.tasks)
        self.data_source = PREFIX + self.environment.name
        self.system_prompt = config.system_prompt  # for tasks that have none
        self.task_index = PassOrder(self.size, self.shuffle, f"{self.seed}:{self.name}")
        """Which task the dataset's ``row``-th draw takes."""

    def prompt_at(self, dataset: str, row: int, prompt_id: int) -> Prompt:
        if dataset != self.name:
            raise ValueError(f"task {self.name!r} has no dataset {dataset!r}")
        index = self.task_index(row)
        data = self.environment.tasks[index].data
        messages = chat_messages(data)
        if self.system_prompt and all(m.role != "system" for m in messages):
            messages.insert(0, ChatMessage("system", self.system_prompt))
        return Prompt(prompt_id=prompt_id, messages=messages, data_source=self.data_source,
                      ground_truth=str(getattr(data, "answer", "") or ""),
                      extra_info={"index": index, SPEC: self.spec})


def prompt_messages(vf: Any, data: Any) -> list[Any]:
    """A task's prompt as verifiers messages: its system prompt, then its prompt."""
    system = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    return [*system, *([vf.UserMessage(content=data.prompt)]
                       if isinstance(data.prompt, str) else data.prompt)]


def trace_of(vf: Any, task: Any, reply: str | None) -> Any:
    """The trace verifiers' chat harness leaves for one reply: the prompt's messages, then the
    reply as the one sampled assistant message (None: an empty trace of the task, which a
    conversation's turns fill)."""
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, TraceTask

    data = task.data
    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=data, key=task.key,
                                    hash=task.hash),
                     state=state_cls(type(task))(),
                     agent=AgentInfo(config=vf.AgentConfig(), name="flowrl"))
    if reply is None:
        return trace
    prompt = prompt_messages(vf, data)
    for i, message in enumerate(prompt):
        trace.nodes.append(MessageNode(parent=i - 1 if i else None, message=message))
    trace.nodes.append(MessageNode(parent=len(prompt) - 1 if prompt else None,
                                   message=vf.AssistantMessage(content=reply), sampled=True))
    trace.is_completed = trace.ok = True
    return trace


def conversation_trace(vf: Any, task: Any, turns: list[dict[str, Any]]) -> Any:
    """The trace verifiers leaves for a multi-turn episode (``extra_info["turns"]``): each
    model turn committed as its harness commits one (``prepare_turn(trace, messages).commit``)
    after the messages the model read before it, the environment's answers as user messages and
    tools' as tool messages. What the model never read (the observation of an ended episode)
    is not in it, as an unconsumed turn is not in verifiers'."""
    from verifiers.v1.graph import prepare_turn

    trace = trace_of(vf, task, None)
    messages = prompt_messages(vf, task.data)
    last = max((k for k, t in enumerate(turns) if t["role"] == "assistant"), default=-1)
    for k, turn in enumerate(turns[:last + 1]):
        content = turn.get("content", "")
        if turn["role"] == "assistant":
            reply = vf.AssistantMessage(content=content)
            prepare_turn(trace, messages).commit(vf.Response(
                id=f"turn-{k}", created=0, model="flowrl", message=reply, finish_reason="stop"))
            messages.append(reply)
        elif turn["role"] == "tool":
            messages.append(vf.ToolMessage(tool_call_id=f"call-{k}", name=turn.get("name") or None,
                                           content=content))
        else:
            messages.append(vf.UserMessage(content=content))
    trace.is_completed = trace.ok = True
    return trace


async def score(data_source: str, solution_str: str, ground_truth: str,
                extra_info: dict[str, Any] | None = None, **_: Any) -> dict[str, float]:
    """verifiers' own score of a reply or a conversation: ``Task.score`` over its trace; the
    weighted sum is the score, each reward's value is recorded under its name and each metric's
    under ``metric/NAME`` (a reward that raises raises here, and so does an episode whose
    environment failed, which verifiers does not score: the worker records the item's error)."""
    info = extra_info or {}
    if SPEC not in info:
        raise ValueError(f"data_source {data_source!r}: the prompt carries no verifiers spec "
                         f"(extra_info[{SPEC!r}])")
    vf = _library()
    task = environment(str(info[SPEC])).tasks[int(info["index"])]
    turns = info.get("turns") or []
    if failed := [t["error"] for t in turns if t.get("error") and t["role"] == "user"]:
        raise RuntimeError(f"the environment failed: {failed[0]}")
    trace = conversation_trace(vf, task, turns) if turns else trace_of(vf, task, solution_str)
    await task.score(trace)
    rewards = {("reward/score" if name == "score" else name): r.score  # "score" is the total's
               for name, r in trace.rewards.items() if r is not None}
    metrics = {f"metric/{name}": v for name, v in trace.metrics.items() if v is not None}
    return {"score": trace.reward, **rewards, **metrics}
