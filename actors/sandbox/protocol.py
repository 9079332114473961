"""What crosses the pipe between an actor and a sandboxed child: msgspec, length-framed.

Actor -> child: one ``Setup`` on start, then ``Call``s, one at a time. Child -> actor: one
``Ready`` after loading every function, then one ``Outcomes`` per ``Call``. A call carries the
keyword arguments of each invocation (the caller decides their names: verl's
``compute_score`` ones for rewards, a tool's own parameters for tools); return values are
turned into ``Outcome``s inside the child (``run_call``), so nothing but numbers and strings
ever leaves it. What a return value means is the function's ``returns``: a score (verl's
conventions, ``to_outcome``), a text (a tool's result, ``to_text_outcome``) or an environment
step (``to_step_outcome``).
``run_call`` is also how a reward worker calls its in-thread rule scorers, so both paths follow
one calling convention.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import struct
import traceback
from collections.abc import Callable
from typing import Any

import msgspec

HEADER = struct.Struct("<I")  # frame length, then the msgpack body
MAX_FRAME = 256 * 1024 * 1024
ERROR_CHARS = 500  # errors travel with every sample: keep them short
TRACE_CHARS = 2000  # a traceback's last characters kept (its innermost frames and the error)
_OWN_FILES = (__file__.rsplit("/", 1)[0], asyncio.__file__.rsplit("/", 1)[0])  # the sandbox's
# and asyncio's frames are left out of a user's traceback


class FunctionSpec(msgspec.Struct, frozen=True):
    """One function a child can call: ``name`` in the Python file ``path`` or in the importable
    ``module`` (built-ins)."""

    path: str = ""
    module: str = ""
    name: str = "compute_score"
    batch: bool = False  # called once with lists for a whole call, returning a list
    kwargs: dict[str, Any] = {}  # appended to every invocation's keyword arguments
    preload: tuple[str, ...] = ()  # modules imported when the child starts (not on the clock)
    returns: str = "score"  # "score" (a reward), "text" (a tool's result), "step" (an
    # environment's (observation, reward, done)) or "episode" (a user rollout's reward, dict
    # or None): how the child reads the return value

    @property
    def label(self) -> str:
        return f"{self.path or self.module}:{self.name}"


class Setup(msgspec.Struct, tag=True):
    """Worker -> child: what to load and the limits to put on itself first."""

    functions: list[FunctionSpec]
    memory_mb: int = 0  # RLIMIT_AS in MiB (0: none)
    cpu_s: int = 0  # RLIMIT_CPU per call in seconds (0: none)
    limits_key: str = "reward"  # the config section of the limits, named in errors


class Call(msgspec.Struct, tag=True):
    """Actor -> child: call ``functions[function]`` once per ``arguments`` entry (its keyword
    arguments); a batch function is called once, with ``arguments[0]``, and returns a list of
    ``items`` values. Either way the answer has ``items`` outcomes."""

    function: int
    arguments: list[dict[str, Any]]
    items: int


class Outcome(msgspec.Struct, array_like=True, omit_defaults=True):
    """One item's value from one function: a finite score, or 0.0 and what went wrong."""

    score: float = 0.0  # a reward; an environment step's reward
    error: str = ""
    extra: dict[str, float] = {}  # a reward's numeric extras; a step's ``done`` (1.0 or 0.0)
    text: str = ""  # a tool's result; an environment's observation
    failure: str = ""  # with an error: "raised" (an exception or a bad value), "timeout" or
    # "crash" (the child was killed or died), "" when the function loaded badly
    answer: str = ""  # a string ``pred`` the function returned (verl's name for its answer)
    trace: str = ""  # with failure "raised" by an exception: its traceback, the user code's own
    # frames only (``user_trace``), for the message that stops a job whose scoring fails


class Ready(msgspec.Struct, tag=True):
    """Child -> worker: loaded; ``load_errors[i]`` is non-empty when function ``i`` failed."""

    load_errors: list[str]


class Outcomes(msgspec.Struct, tag=True):
    """Child -> worker: one outcome per item of the call."""

    outcomes: list[Outcome]


ToChild = Setup | Call
FromChild = Ready | Outcomes


def frame(message: msgspec.Struct) -> bytes:
    body = msgspec.msgpack.encode(message)
    return HEADER.pack(len(body)) + body


def to_outcome(value: Any) -> Outcome:
    """verl return conventions: a number, or a dict with ``score``, numeric extras and
    optionally ``pred``, the extracted answer (a string)."""
    extra: dict[str, float] = {}
    answer = ""
    if isinstance(value, dict):
        if "score" not in value:
            return Outcome(error=f"returned a dict without 'score' (keys: {sorted(map(str, value))[:8]})")
        extra = {str(k): float(v) for k, v in value.items()
                 if k != "score" and isinstance(v, int | float) and math.isfinite(v)}
        if isinstance(value.get("pred"), str):
            answer = value["pred"][:ERROR_CHARS]
        value = value["score"]
    if isinstance(value, bool | int | float) or _is_numpy_number(value):
        score = float(value)
        if math.isfinite(score):
            return Outcome(score, extra=extra, answer=answer)
        return Outcome(error=f"returned a non-finite score {score}")
    return Outcome(error=f"returned {type(value).__name__}, not a number")


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if _is_numpy_number(value):
        value = value.item()
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def to_text_outcome(value: Any) -> Outcome:
    """A tool's return value as the text the model reads: a string as is, ``None`` as nothing,
    anything JSON can hold as JSON, anything else as ``str()``."""
    return Outcome(text=_text(value))


def to_step_outcome(value: Any) -> Outcome:
    """An environment step's ``(observation, reward, done)`` (gymnasium's ``(observation,
    reward, terminated, truncated, info)`` too): the observation as text, the reward as the
    score, ``done`` in ``extra``. An ``error`` in the info dict ends the episode with that error
    (an environment whose own code failed past recovery, not a bad action)."""
    if not isinstance(value, tuple | list) or len(value) not in (3, 5):
        return Outcome(error=f"step returned {type(value).__name__}, not (observation, reward, "
                             "done)", failure="raised")
    observation, reward = value[0], value[1]
    done = bool(value[2]) or (len(value) == 5 and bool(value[3]))
    info = value[4] if len(value) == 5 and isinstance(value[4], dict) else {}
    if info.get("error"):
        return Outcome(error=_text(info["error"])[:ERROR_CHARS], failure="raised",
                       extra={"done": 1.0})
    scored = to_outcome(0.0 if reward is None else reward)
    if scored.error:
        return Outcome(error=f"step reward: {scored.error}", failure="raised")
    return Outcome(scored.score, extra={"done": float(done)}, text=_text(observation))


TO_SCORER = "to the scorer"  # an episode's ``Outcome.text`` when it returned None


def to_episode_outcome(value: Any) -> Outcome:
    """A user rollout's return value (``actors/sampler/endpoint``): ``None`` leaves the reward
    to the configured scorer (``text`` is ``TO_SCORER``); a number is the reward; a dict is
    reward components, its ``score`` the reward (the sum of its numbers when it has none)."""
    if value is None:
        return Outcome(text=TO_SCORER)
    if isinstance(value, dict) and "score" not in value:
        numbers = [v for v in value.values() if isinstance(v, int | float) and not isinstance(v, bool)]
        value = {**value, "score": float(sum(numbers))}
    return to_outcome(value)


CONVERTERS: dict[str, Callable[[Any], Outcome]] = {
    "score": to_outcome, "text": to_text_outcome, "step": to_step_outcome,
    "episode": to_episode_outcome}


def _is_numpy_number(value: Any) -> bool:
    # numpy scalars and 0-d tensors without importing numpy or torch here
    return hasattr(value, "item") and getattr(value, "shape", None) == () and \
        isinstance(value.item(), bool | int | float)


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def user_trace(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it, without the sandbox's own frames (the call into
    the user's function, an ``async def``'s event loop), cut to its last ``TRACE_CHARS``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_OWN_FILES)]
    text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) + \
        "".join(traceback.format_exception_only(exc))
    return text if len(text) <= TRACE_CHARS else "..." + text[-TRACE_CHARS:]


def _resolve(value: Any) -> Any:
    if inspect.isawaitable(value):  # ``async def`` scorers run to completion on a fresh loop

        async def wait() -> Any:
            return await value

        return asyncio.run(wait())
    return value


def run_call(fn: Callable[..., Any], spec: FunctionSpec, call: Call) -> list[Outcome]:
    """Call ``fn`` with keyword arguments (``spec.kwargs`` appended): once per entry of
    ``call.arguments``, or once when ``spec.batch``. Exceptions and bad values become error
    outcomes."""
    n = call.items
    convert = CONVERTERS[spec.returns]
    if spec.batch:
        try:
            values = _resolve(fn(**call.arguments[0], **spec.kwargs))
        except (Exception, SystemExit) as exc:
            return [Outcome(error=describe(exc), failure="raised", trace=user_trace(exc))] * n
        if not isinstance(values, list | tuple) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, list | tuple) else type(values).__name__
            return [Outcome(error=f"batch function returned {got} for {n} items",
                            failure="raised")] * n
        return [_raised(convert(v)) for v in values]
    outcomes = []
    for arguments in call.arguments:
        try:
            outcomes.append(_raised(convert(_resolve(fn(**arguments, **spec.kwargs)))))
        except (Exception, SystemExit) as exc:
            outcomes.append(Outcome(error=describe(exc), failure="raised", trace=user_trace(exc)))
    return outcomes


def _raised(outcome: Outcome) -> Outcome:
    """A bad return value is the function's fault, like an exception."""
    if outcome.error and not outcome.failure:
        outcome.failure = "raised"
    return outcome
