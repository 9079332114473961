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

Only single-turn environments train today: one with tools, a container, its own harness or
``Env``, judge models or rewards that read a sandbox is refused at ``check`` in one line.
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
from actors.runtime.config.schema import DatasetConfig
from actors.runtime.config.sources import VerifiersSource
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
    """A loaded taskset: its tasks in ``load()`` order (``idx`` set, as verifiers iterates)."""

    name: str
    tasks: list[Any]


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
    """Why the environment is not single-turn ("" when it is): what flowrl cannot run yet."""
    task_cls = type(taskset).task_type()
    if _exported(module, vf.Env):
        return "it brings its own Env (multi-agent)"
    if _exported(module, vf.Harness):
        return "it brings its own harness"
    if tools := [*type(taskset).toolsets(taskset.config), *task_cls.toolsets(taskset.config.task)]:
        return f"it has tools ({', '.join(type(t).__name__ for t in tools)})"
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


def _taskset(vf: Any, module: ModuleType, label: str, args: dict[str, Any]) -> Any:
    """The module's taskset made with ``args``: its exported ``Taskset`` class with its own
    config, else what its ``load_environment(**args)`` returns (a taskset, or a single-agent
    env's taskset)."""
    classes = _exported(module, vf.Taskset)
    loader = getattr(module, "load_environment", None)
    if not classes and callable(loader):
        try:
            made = loader(**args)
        except Exception as exc:
            raise ValueError(f"{label}: load_environment(**{args}) failed: "
                             f"{_one_line(exc)}") from None
        if isinstance(made, vf.Env) and type(made) is not vf.SingleAgentEnv:
            raise ValueError(f"{label}: multi-turn and tool verifiers environments are not "
                             f"supported yet (load_environment made a {type(made).__name__})")
        made = made.taskset if isinstance(made, vf.Env) else made
        if not isinstance(made, vf.Taskset):
            raise ValueError(f"{label}: load_environment returned a {type(made).__name__}, not "
                             "a verifiers Taskset or Env")
        return made
    if len(classes) != 1:
        raise ValueError(f"{label} must export one Taskset subclass in __all__ (it exports "
                         f"{len(classes)}: {[c.__name__ for c in classes]}) or define "
                         "load_environment")
    from verifiers.v1.utils.generic import concrete_type

    config_cls = concrete_type(classes[0], vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    try:
        return classes[0](config_cls(**args))
    except Exception as exc:  # pydantic's refusal of an arg, or the taskset's own
        raise ValueError(f"{label} refused its args {args}: {_one_line(exc)}") from None


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
    taskset = _taskset(vf, module, label, fields["args"])
    if why := _unsupported(vf, module, taskset):
        raise ValueError(f"{label}: multi-turn and tool verifiers environments are not supported "
                         f"yet ({why})")
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
    if any(t.data.prompt is None for t in tasks):
        raise ValueError(f"{label}: multi-turn and tool verifiers environments are not supported "
                         "yet (a task with no prompt: the user opens the conversation)")
    name = Path(label).stem if fields["path"] else module.__name__.rsplit(".", 1)[-1]
    return Environment(name, tasks)


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


def trace_of(vf: Any, task: Any, reply: str) -> Any:
    """The trace verifiers' chat harness leaves for one reply: the prompt's messages, then the
    reply as the one sampled assistant message."""
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, TraceTask

    data = task.data
    system = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    user = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else data.prompt
    prompt = [*system, *user]
    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=data, key=task.key,
                                    hash=task.hash),
                     state=state_cls(type(task))(),
                     agent=AgentInfo(config=vf.AgentConfig(), name="flowrl"))
    for i, message in enumerate(prompt):
        trace.nodes.append(MessageNode(parent=i - 1 if i else None, message=message))
    trace.nodes.append(MessageNode(parent=len(prompt) - 1 if prompt else None,
                                   message=vf.AssistantMessage(content=reply), sampled=True))
    trace.is_completed = trace.ok = True
    return trace


async def score(data_source: str, solution_str: str, ground_truth: str,
                extra_info: dict[str, Any] | None = None, **_: Any) -> dict[str, float]:
    """verifiers' own score of a reply: ``Task.score`` over the reply's trace; the weighted sum
    is the score, each reward's value is recorded under its name and each metric's under
    ``metric/NAME`` (a reward that raises raises here: the worker records the item's error)."""
    info = extra_info or {}
    if SPEC not in info:
        raise ValueError(f"data_source {data_source!r}: the prompt carries no verifiers spec "
                         f"(extra_info[{SPEC!r}])")
    vf = _library()
    task = environment(str(info[SPEC])).tasks[int(info["index"])]
    trace = trace_of(vf, task, solution_str)
    await task.score(trace)
    rewards = {("reward/score" if name == "score" else name): r.score  # "score" is the total's
               for name, r in trace.rewards.items() if r is not None}
    metrics = {f"metric/{name}": v for name, v in trace.metrics.items() if v is not None}
    return {"score": trace.reward, **rewards, **metrics}
