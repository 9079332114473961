"""Checks before any actor starts, of what the topology's types and ranges cannot show: that the
model, the data files and the user's code will load the way the actors load them.

``preflight(topology)`` raises ``ConfigError`` naming the key (``error: bad topology: KEY:
reason``, exit 2 from the runner) when:

- ``model.path`` is not a model directory, is not a causal LM, its tokenizer does not load, or
  it has no chat template (every prompt is chat messages rendered by it); or it is a text-only
  model and a training dataset has images;
- ``teacher.path`` (on-policy distillation) is not a causal LM, or its tokenizer is not the
  student's (the error names both models); with images in the data, it is a text-only model
  (it would read the student's image tokens without their images) or its processor counts an
  image's tokens otherwise than the student's;
- a file of ``task.datasets`` or ``validation.datasets`` does not read whole the way the replay
  buffer reads it (not a parquet file, a jsonl line that is not a JSON object, a first prompt
  that is not a prompt); in a file with images, any row whose ``<image>`` placeholders do not
  match its images, or whose image is missing or does not decode (the error names the row and
  the column: found here, never mid-run);
- a user's reward function, tool, environment, policy loss or advantage estimator does not
  import (the file's own error with its line), does not define the name, or cannot be called as
  its role calls it (verl's ``compute_score(data_source, solution_str, ground_truth,
  extra_info)`` for rewards, the built-ins' arguments and its ``kwargs`` for a loss).

The model and user code are checked in sandboxed children (``actors/sandbox/preflight.py``,
through ``Children``): the runner never imports a user's file or transformers. Results are
kept per input in this process, so checking many topologies that share a model and code (the
property test) starts the children once; a model directory that passed is remembered on disk
(``FLOWRL_CACHE/checked/``, keyed by its files' names, sizes and times and the transformers
version), so a restart or resume of the same job does not load its tokenizer again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any

import anyio
import msgspec

from actors.runtime.config import ConfigError, CustomEstimator, CustomLoss, Topology

PREFLIGHT_TIMEOUT_S = 120.0  # per child call: importing torch-heavy user code, loading a tokenizer
_MODULE = "actors.sandbox.preflight"
_done: dict[tuple, list[str]] = {}  # (what was checked) -> problems, per key: "" when fine


def user_code(topology: Topology) -> list[tuple[str, dict[str, Any]]]:
    """(key, check_function's arguments) of every piece of user code the topology names."""
    out: list[tuple[str, dict[str, Any]]] = []
    for i, fn in enumerate(topology.reward.functions):
        if fn.path and not fn.builtin:
            out.append((f"reward.functions[{i}].path", {
                "path": fn.path, "module": "", "name": fn.name,
                "role": "reward_batch" if fn.batch else "reward", "kwargs": sorted(fn.kwargs)}))
    A = topology.agent
    for i, tool in enumerate(A.tools):
        if tool.path:
            out.append((f"agent.tools[{i}].path", {
                "path": tool.path, "module": "", "name": tool.name, "role": "tool",
                "kwargs": sorted(tool.kwargs)}))
    if A.env.path:
        out.append(("agent.env.path", {"path": A.env.path, "module": "", "name": A.env.name,
                                       "role": "env", "kwargs": sorted(A.env.kwargs)}))
    if A.rollout.path:
        out.append(("agent.rollout.path", {"path": A.rollout.path, "module": "",
                                           "name": A.rollout.name, "role": "rollout",
                                           "kwargs": []}))
    for role, row in (("policy_loss", topology.algorithm.policy_loss),
                      ("adv_estimator", topology.algorithm.adv_estimator)):
        if isinstance(row, (CustomLoss, CustomEstimator)):
            out.append((f"algorithm.{role}", {"path": row.path, "module": "",
                                              "name": row.function, "role": role,
                                              "kwargs": sorted(row.kwargs)}))
    return [(key, {**args, "index": n}) for n, (key, args) in enumerate(out)]


async def _in_children(checks: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Each (key, function, arguments) run in a sandboxed child; the problems found, in order."""
    from actors.sandbox.children import Children
    from actors.sandbox.protocol import Call, FunctionSpec

    names = sorted({fn for _, fn, _ in checks})
    children = Children([FunctionSpec(module=_MODULE, name=n, returns="text") for n in names],
                     size=len(names), timeout_s=PREFLIGHT_TIMEOUT_S, memory_mb=0, cpu_s=0,
                     limits_key="preflight")
    problems = [""] * len(checks)
    try:
        async def run(name: str) -> None:
            mine = [i for i, (_, fn, _) in enumerate(checks) if fn == name]
            outcomes = await children.call(Call(names.index(name), [checks[i][2] for i in mine],
                                            len(mine)))
            for i, o in zip(mine, outcomes, strict=True):
                if o.failure == "timeout":
                    problems[i] = (f"loading it took longer than {PREFLIGHT_TIMEOUT_S:g} s "
                                   "(does the file run something at import?)")
                else:
                    problems[i] = o.error or o.text

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(run, name)
    finally:
        await children.aclose()
    return problems


def _check_in_children(topology: Topology, model_path: str, images: str = "") -> None:
    """The checks that load models and user code; ``images``: the first dataset key whose rows
    have images ("" when none)."""
    checks = [("model.path", "check_model", {"path": model_path, "needs_chat": True})]
    checks += [(key, "check_function", args) for key, args in user_code(topology)]
    if topology.teacher.path:  # on-policy distillation: the teacher reads the student's ids
        checks.append(("teacher.path", "check_teacher",
                       {"path": _directory(topology.teacher.path, "teacher.path"),
                        "student": model_path, "images": images}))
    passed = _passed_marker(model_path)
    if passed is not None and passed.exists():
        _done.setdefault(_memo(checks[0]), [""])
    todo = [c for c in checks if _memo(c) not in _done]
    if todo:
        for c, problem in zip(todo, anyio.run(_in_children, todo, backend="trio"), strict=True):
            _done[_memo(c)] = [problem]
            if c is checks[0] and not problem and passed is not None:
                try:
                    passed.parent.mkdir(parents=True, exist_ok=True)
                    passed.touch()
                except OSError:
                    pass  # only a cache: the check runs again next time
    for c in checks:
        problem = _done[_memo(c)][0]
        if problem:
            raise ConfigError(f"{c[0]}: {problem}")


def _passed_marker(model_path: str) -> Path | None:
    """Where a pass of the model check for this directory, as its files are now, is noted."""
    from actors.model_store import cache_dir

    try:
        root = Path(model_path).resolve()
        files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                       for f in root.iterdir() if f.is_file())
        version = importlib.metadata.version("transformers")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    stamp = msgspec.json.encode([str(root), files, version])
    return cache_dir() / "checked" / hashlib.sha256(stamp).hexdigest()


def _memo(check: tuple[str, str, dict[str, Any]]) -> tuple:
    return check[1], msgspec.json.encode(check[2])


def check_data(topology: Topology) -> str:
    """Every dataset file read whole as the replay buffer reads it, and its first prompt built;
    returns the key of the first training dataset whose rows have images ("" when none)."""
    import pyarrow as pa  # type: ignore[import-untyped]

    from actors.data.datasets import FileDataset
    from actors.validation.prompts import validation_prompts

    images = ""
    for where, datasets in (("task.datasets", topology.task.datasets),
                            ("validation.datasets", topology.validation.datasets)):
        for i, d in enumerate(datasets):
            if not d.path:
                continue
            key = f"{where}[{i}]"
            try:
                data = FileDataset(d, topology.run.seed, key)
                data.prompt_at(data.name, 0, prompt_id=0)
                if data.image_key:  # every row's images against its placeholders
                    for row in range(data.size):
                        data.prompt_at(data.name, row, prompt_id=0)
                    images = images or key
            except pa.ArrowException as exc:
                suffix = ".parquet" if d.path.endswith(".parquet") else ""
                raise ConfigError(f"{key}.path: {'not a parquet file' if suffix else 'unreadable'}"
                                  f" ({str(exc).strip()})") from None
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{key}.path: cannot read {d.path}: {exc}") from None
            except ValueError as exc:  # FileDataset's and prompt_at's errors name the key
                text = str(exc)
                raise ConfigError(text if text.startswith(where) else f"{key}.path: {text}") \
                    from None
    if topology.validation.datasets:
        try:
            validation_prompts(topology)  # every row of every file, as the replay buffer does
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return images


def model_directory(topology: Topology) -> str:
    """``model.path`` as a local directory (the embedded default converted once), or the
    ConfigError naming the key."""
    return _directory(topology.model.path, "model.path")


def _directory(path: str, key: str) -> str:
    from actors.model_store import resolve_model_path

    try:
        return str(resolve_model_path(path))
    except FileNotFoundError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def preflight(topology: Topology) -> None:
    """Raise ``ConfigError`` (naming the key) for a model, data file or user code the job's
    actors would fail to load; nothing is started."""
    images = check_data(topology)
    model = model_directory(topology)
    if images:
        from actors.data.vision import is_vision_model  # (reads config.json: no torch)

        if not is_vision_model(model):
            raise ConfigError(
                f"model.path: {topology.model.path} is a text-only model (its config.json has no "
                f"vision_config) and {images} has images: the policy must see them. Use a "
                "vision-language model (a Qwen2.5-VL directory: docs/vision.md) or a dataset "
                "without images")
    _check_in_children(topology, model, images)
