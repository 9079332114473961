"""What agent rollouts run inside sandboxed children: the built-in tools, the JSON schema of a
user's tool, and a host for environment instances.

Everything here is imported and called in a child process (``actors.sandbox.child``), under its
memory and CPU limits and the caller's per-call timeout; the sampler only ever sees the text,
numbers and flags that come back in ``Outcome``s.

- ``calculator(expression)``: exact arithmetic on integers and decimals (``+ - * / // % **``,
  parentheses), evaluated from the parsed expression tree, never by ``eval``.
- ``python(code)``: runs ``code`` in a new interpreter (``python -I -c``, its own process, in an
  empty temporary directory, under the child's limits) and returns what it printed; a program
  that fails is an error with the last line of its traceback. Only those limits contain it: it can
  read files and open sockets the sampler's user can.
- ``describe(path, module, name)``: the tool's JSON schema (OpenAI function format) from its
  signature, type hints and docstring.
- ``env_reset`` / ``env_step`` / ``env_close``: one environment object per episode, kept in
  this child by instance id until closed; when the child is killed (a hang) or dies, its
  instances are gone and a later step of theirs is an error.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import operator
import re
import subprocess
import sys
import tempfile
import types
import typing
from fractions import Fraction
from pathlib import Path
from typing import Any

from actors.runtime.lifetime import die_with_parent

# -- built-in tools ------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_MAX_BITS = 700  # about 200 digits: a longer number is refused (``9**9**9`` would never finish)


def _size(x: Fraction) -> int:
    return max(x.numerator.bit_length(), x.denominator.bit_length())


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) \
            and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1:
                raise ValueError("exponents must be whole numbers")
            if left == 0 and right < 0:
                raise ZeroDivisionError("zero to a negative power")
            if abs(right) * _size(left) > _MAX_BITS:
                raise ValueError("the result would have more than about 200 digits")
        result = _BINARY[type(node.op)](left, right)
        if _size(Fraction(result)) > _MAX_BITS:
            raise ValueError("the result has more than about 200 digits")
        return Fraction(result)
    raise ValueError(f"unsupported syntax: {ast.unparse(node)!r} (numbers, + - * / // % ** "
                     "and parentheses only)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(1234 + 5) * 678".
    """
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)  # 12,345 -> 12345
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ZeroDivisionError("division by zero") from None
    if value.denominator == 1:
        return str(value.numerator)
    decimal = f"{float(value):.10f}".rstrip("0")  # exact up to 10 decimal places
    return decimal if abs(value) < 1e15 else repr(float(value))


def python(code: str, timeout_s: float = 60.0) -> str:
    """Run a Python program and return what it printed.

    Args:
        code: the program; each call runs in a new interpreter, so nothing carries over.
    """
    with tempfile.TemporaryDirectory(prefix="flowrl-python-") as cwd:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", code], cwd=cwd, text=True,
                                  capture_output=True, stdin=subprocess.DEVNULL,
                                  # the program dies with this child: none outlives its call
                                  timeout=timeout_s, preexec_fn=die_with_parent)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the program ran for more than {timeout_s:g} s") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()  # a traceback's last line says what failed
        raise RuntimeError(f"exit status {done.returncode}: {lines[-1] if lines else ''}")
    return done.stdout


BUILTIN_TOOLS = ("calculator", "python")  # functions of this module, by the tool's name

# -- user code -----------------------------------------------------------------------------------


def load_object(path: str, module: str, name: str) -> Any:
    """``name`` from the Python file ``path`` or the importable ``module``."""
    if module:
        target = importlib.import_module(module)
    else:
        key = f"_flowrl_user_{abs(hash(path))}"
        target = sys.modules.get(key)  # type: ignore[assignment]
        if target is None:
            spec = importlib.util.spec_from_file_location(key, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path} as a Python module")
            target = importlib.util.module_from_spec(spec)
            sys.modules[key] = target
            sys.path.insert(0, str(Path(path).parent))
            spec.loader.exec_module(target)
    found = getattr(target, name, None)
    if found is None:
        raise AttributeError(f"{path or module} has no {name!r}")
    return found


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               tuple: "array", dict: "object"}


def _json_type(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {}
    if origin in (list, tuple):
        args = typing.get_args(hint)
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    base = origin or hint
    return {"type": _JSON_TYPES[base]} if base in _JSON_TYPES else {}


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The summary (text before an ``Args:`` section) and each argument's description."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    summary: list[str] = []
    params: dict[str, str] = {}
    in_args, in_summary, current = False, True, ""
    for line in lines:
        stripped = line.strip()
        if re.fullmatch(r"[A-Z]\w*( \w+)?:", stripped) and not line.startswith((" ", "\t")):
            in_summary = False  # a section: Args:, Returns:, Raises:, ...
            in_args = stripped.lower() in ("args:", "arguments:", "parameters:")
            continue
        if in_summary:
            summary.append(stripped)
            continue
        if not in_args:
            continue
        found = re.match(r"(\w+)\s*(\([^)]*\))?\s*:\s*(.*)", stripped)
        if found and line.startswith((" ", "\t")) and found.group(1) not in params \
                and len(line) - len(line.lstrip()) <= 8:
            current = found.group(1)
            params[current] = found.group(3)
        elif current and stripped:
            params[current] += " " + stripped
    return " ".join(s for s in summary if s).strip(), params


def schema_of(fn: Any, name: str) -> dict[str, Any]:
    """The OpenAI function-calling schema of ``fn``: parameters from its signature and type
    hints, descriptions from its docstring (Google style ``Args:``)."""
    summary, described = _docstring_parts(inspect.getdoc(fn) or "")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # a hint that does not resolve: leave the types out
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = _json_type(hints[param.name]) if param.name in hints else {}
        if param.name in described:
            prop["description"] = described[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "function", "function": {
        "name": name, "description": summary,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def describe(path: str, module: str, name: str, tool: str) -> str:
    """The JSON schema of the tool ``name`` (in ``path`` or ``module``), called ``tool``."""
    return json.dumps(schema_of(load_object(path, module, name), tool))


# -- environments ---------------------------------------------------------------------------------

_INSTANCES: dict[str, Any] = {}  # instance id -> environment object, until closed


def env_reset(instance: str, prompt: dict[str, Any], env_path: str, env_module: str,
              env_name: str, env_kwargs: dict[str, Any]) -> Any:
    """Make the environment object of ``instance`` and return its first observation."""
    cls = load_object(env_path, env_module, env_name)
    env = cls(**env_kwargs)
    _INSTANCES[instance] = env
    return env.reset(prompt)


def env_step(instance: str, action: str) -> Any:
    """One step of ``instance``: ``(observation, reward, done)``."""
    env = _INSTANCES.get(instance)
    if env is None:
        raise LookupError("the environment is gone (its process was restarted after a timeout "
                          "or a crash)")
    return env.step(action)


def env_close(instance: str) -> None:
    env = _INSTANCES.pop(instance, None)
    close = getattr(env, "close", None)
    if callable(close):
        close()
