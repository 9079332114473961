"""A user's own policy loss or advantage estimator, from a Python file: what the learner calls it
with, the file's hash, and its loader.

``algorithm.policy_loss = {name = "custom", path = "my_loss.py", function = "my_loss"}`` (and
the same for ``algorithm.adv_estimator``) names a function the learner calls exactly as it calls
the built-ins, with the row's ``kwargs`` as keyword arguments. The runner checks the file, the
function and its signature before a job starts (``actors/sandbox/preflight.py``, in a child:
the runner never imports a user's file) and records the file's sha256 in the resolved topology;
the learner loads the file only when the hash still matches, so a run, a restarted learner and a
``runner.py rerun`` of a step all compute with the same code, or say that it changed.

Torch-free: the learner imports the file (which imports torch itself) only when it loads it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

# How the learner calls a policy loss (``kernels.policy_losses.policy_loss``): these positional
# tensors (B, T), then these keywords, then the row's kwargs
LOSS_ARGUMENTS = ("logprobs", "old_logprobs", "advantages", "mask")
LOSS_KEYWORDS = ("clip_low", "clip_high", "dual_clip", "weights", "loss_agg_mode", "token_count",
                 "seq_count", "norm_constant")
# How it calls an advantage estimator (``kernels.advantages.compute_advantages``): rewards and
# mask (N, T) and the ``AdvantageParams``, then the row's kwargs
ESTIMATOR_ARGUMENTS = ("token_level_rewards", "response_mask", "params")
ROLES = {"policy_loss": (LOSS_ARGUMENTS, LOSS_KEYWORDS, "a policy loss"),
         "adv_estimator": (ESTIMATOR_ARGUMENTS, (), "an advantage estimator")}


class UserCodeError(RuntimeError):
    """A user's loss or estimator that cannot be loaded, or that failed when called; the message
    names the key, the file and the function."""


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def call_problem(fn: Callable, role: str, kwargs: Sequence[str]) -> str:
    """"" when ``fn`` can be called as the learner calls ``role`` (``ROLES``) with the options
    ``kwargs``; else one line saying why not."""
    arguments, keywords, what = ROLES[role]
    name = getattr(fn, "__name__", repr(fn))
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: nothing to check
        return ""
    params = signature.parameters.values()
    passed = [k for k in kwargs if k in (*arguments, *keywords)]
    if passed:
        return (f"its kwargs name {', '.join(map(repr, passed))}, which the learner passes "
                f"itself to {what} (the [algorithm] keys set them)")
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        takes = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
        unknown = [k for k in kwargs if k not in takes]
        if unknown:
            return (f"{name}{signature} takes no option {', '.join(map(repr, unknown))} "
                    "(kwargs); add it as a keyword parameter")
    try:
        signature.bind(*arguments, **dict.fromkeys((*keywords, *kwargs)))
    except TypeError as exc:
        shown = ", ".join((*arguments, *(f"{k}=..." for k in (*keywords, *kwargs))))
        return (f"{name}{signature} cannot be called as the learner calls {what}: "
                f"{name}({shown}): {exc}")
    return ""


def where_raised(exc: BaseException, path: str) -> str:
    """``FILE line N: Error: message``, the line the innermost frame in ``path`` was at (the
    file's own code, not the torch it called)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    line = f" line {frames[-1].lineno}" if frames else ""
    return f"{Path(path).name}{line}: {text}"


class UserFunction:
    """A user's function as the learner calls it: its ``kwargs`` bound, and whatever it raises
    (or a result of the wrong shape) turned into a ``UserCodeError`` naming the file, so the
    learner's failure says whose code failed and where."""

    def __init__(self, key: str, path: str, fn: Callable, kwargs: Mapping[str, Any],
                 role: str) -> None:
        self.key, self.path, self.fn, self.kwargs, self.role = key, path, fn, dict(kwargs), role
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        try:
            out = self.fn(*args, **kw, **self.kwargs)
        except Exception as exc:
            raise UserCodeError(f"{self.key}: {self.__name__} in {self.path} raised: "
                                f"{where_raised(exc, self.path)}") from exc
        problem = self._unlike(out, args[0])
        if problem:
            raise UserCodeError(f"{self.key}: {self.__name__} in {self.path} returned {problem}")
        return out

    def _unlike(self, out: Any, first: Any) -> str:
        """What is wrong with the result ``out`` of a call whose first argument is ``first``
        (the estimator's rewards, whose shape the advantages have): "" when nothing."""
        if not (isinstance(out, tuple) and len(out) == 2):
            got = type(out).__name__
        elif self.role == "policy_loss":
            if getattr(out[0], "ndim", None) == 0 and isinstance(out[1], dict):
                return ""
            got = f"({_shape(out[0])}, {type(out[1]).__name__})"
        else:
            if all(getattr(t, "shape", None) == first.shape for t in out):
                return ""
            got = f"({_shape(out[0])}, {_shape(out[1])})"
        wanted = ("(loss, metrics): a scalar tensor and a dict" if self.role == "policy_loss"
                  else f"(advantages, returns): two tensors of the rewards' shape "
                       f"{tuple(first.shape)}")
        return f"{got}, not {wanted}"


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"a tensor of shape {tuple(shape)}" if shape is not None else type(value).__name__


# what load_function returned, by its arguments: a row's code is read from its file once per
# process, so a file edited while the run goes on neither changes nor stops the run
_LOADED: dict[tuple[str, ...], UserFunction] = {}


def load_function(key: str, path: str, function: str, sha256: str, kwargs: Mapping[str, Any],
                  role: str) -> UserFunction:
    """The function ``function`` of the file ``path``, checked against the hash the topology
    recorded and against ``role``'s call, the first time this process asks for it (then the
    same function again); a ``UserCodeError`` naming ``key`` and the file when it is not the
    same file, does not import, or does not fit."""
    memo = (key, str(Path(path).resolve()), function, sha256, repr(sorted(kwargs.items())), role)
    if memo not in _LOADED:
        _LOADED[memo] = _load(key, path, function, sha256, kwargs, role)
    return _LOADED[memo]


def _load(key: str, path: str, function: str, sha256: str, kwargs: Mapping[str, Any],
          role: str) -> UserFunction:
    now = file_sha256(path) if Path(path).is_file() else ""
    if not now:
        raise UserCodeError(f"{key}.path: no file {path}")
    if sha256 and now != sha256:
        raise UserCodeError(
            f"{key}.path: {path} changed since the topology was loaded (sha256 {sha256[:12]}... "
            f"recorded, {now[:12]}... now): a rerun would not compute what the run did; restore "
            f"the file, or run the new one on purpose with {key}.sha256=\"\"")
    try:
        module = _imported(path, now)
    except UserCodeError as exc:
        raise UserCodeError(f"{key}.path: {exc}") from exc.__cause__
    fn = getattr(module, function, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise UserCodeError(f"{key}.function: {Path(path).name} has no function {function!r} "
                            f"(it defines: {', '.join(defined) or 'nothing callable'})")
    problem = call_problem(fn, role, list(kwargs))
    if problem:
        raise UserCodeError(f"{key}.function: {problem}")
    return UserFunction(key, path, fn, kwargs, role)


@functools.cache
def _imported(path: str, sha256: str) -> ModuleType:
    """The file imported once per content (a module of its own, its directory on ``sys.path``
    so it can import its neighbours)."""
    module_name = f"_flowrl_custom_{sha256[:16]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = str(Path(path).parent)
    if folder not in sys.path:
        sys.path.append(folder)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise UserCodeError(f"{path} does not import: {where_raised(exc, path)}") from exc
    return module
