"""What crosses the pipe between an actor and a sandboxed child: msgspec, length-framed.

Actor -> child: one ``Setup`` on start, then ``Call``s, one at a time. Child -> actor: one
``Ready`` after loading every function, then one ``Outcomes`` per ``Call``. A call carries the
keyword arguments of each invocation (the caller decides their names: verl's
``compute_score`` ones for rewards); return values are turned into ``Outcome``s inside the
child (``run_call``, ``to_outcome``), so nothing but numbers and strings ever leaves it.
``run_call`` is also how a reward worker calls its in-thread rule scorers, so both paths follow
one calling convention.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import struct
from collections.abc import Callable
from typing import Any

import msgspec

HEADER = struct.Struct("<I")  # frame length, then the msgpack body
MAX_FRAME = 256 * 1024 * 1024
ERROR_CHARS = 500  # errors travel with every sample: keep them short


class FunctionSpec(msgspec.Struct, frozen=True):
    """One function a child can call: ``name`` in the Python file ``path`` or in the importable
    ``module`` (built-ins)."""

    path: str = ""
    module: str = ""
    name: str = "compute_score"
    batch: bool = False  # called once with lists for a whole call, returning a list
    kwargs: dict[str, Any] = {}  # appended to every invocation's keyword arguments
    preload: tuple[str, ...] = ()  # modules imported when the child starts (not on the clock)

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

    score: float = 0.0
    error: str = ""
    extra: dict[str, float] = {}
    answer: str = ""  # a string ``pred`` the function returned (verl's name for its answer)


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


def _is_numpy_number(value: Any) -> bool:
    # numpy scalars and 0-d tensors without importing numpy or torch here
    return hasattr(value, "item") and getattr(value, "shape", None) == () and \
        isinstance(value.item(), bool | int | float)


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


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
    if spec.batch:
        try:
            values = _resolve(fn(**call.arguments[0], **spec.kwargs))
        except (Exception, SystemExit) as exc:
            return [Outcome(error=describe(exc))] * n
        if not isinstance(values, list | tuple) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, list | tuple) else type(values).__name__
            return [Outcome(error=f"batch function returned {got} for {n} items")] * n
        return [to_outcome(v) for v in values]
    outcomes = []
    for arguments in call.arguments:
        try:
            outcomes.append(to_outcome(_resolve(fn(**arguments, **spec.kwargs))))
        except (Exception, SystemExit) as exc:
            outcomes.append(Outcome(error=describe(exc)))
    return outcomes
