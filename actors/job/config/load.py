"""Loading a topology: TOML file, verl-style dotted overrides, validation, absolute paths.

``load_topology(path, overrides)`` applies the overrides (``learner.total_steps=3``) to the raw
TOML before validation, so an error always names the full key path (``learner.total_stepz``)
whichever way the value came in.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from actors.job.config.checks import check
from actors.job.launchers.table import LAUNCHERS
from actors.model_store import DEFAULT_MODEL
from actors.runtime.config import (
    ENGINES,
    ESTIMATOR_ROWS,
    FALLBACK,
    LOSS_ROWS,
    AlgorithmConfig,
    ConfigError,
    CustomEstimator,
    CustomLoss,
    LearnerConfig,
    SamplerConfig,
    Topology,
    file_sha256,
    refusal,
    sampler_engine,
    visible_gpus,
)
from actors.runtime.transports.table import resolve_transport


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:  # a TOML value: 3, 1e-5, true, "text", [1, 2]; anything else is a bare string
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each ``a.b.c=value`` in the raw TOML dict (before validation)."""
    for text in overrides:
        path, value = _parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            tag = NAMED_TABLES.get(".".join(path[: i + 1]))
            if isinstance(child, str) and tag:  # a name alone, then one of its options
                child = node[part] = {tag: child}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[: i + 1])} is not a table")
            node = child
        node[path[-1]] = value
    return data



def _key_path_message(msg: str, data: Any = None) -> str:
    """Restate msgspec's "what - at `$.a.b`" as "a.b: what" (unknown and missing keys get their
    own name; a value its field's constraint refuses reads as the checks do: "must be >= 1"; a
    section's ``__post_init__`` saying "key: why" of its key reads "a.b.key: why")."""
    where = ""
    if " - at `$." in msg:
        msg, where = msg.rsplit(" - at `$.", 1)
        where = where.rstrip("`")
    named = re.fullmatch(r"Object (contains unknown|missing required) field `(.+)`", msg)
    if named:
        key = f"{where}.{named.group(2)}" if where else named.group(2)
        return f"{key}: {'unknown key' if named.group(1) == 'contains unknown' else 'must be set'}"
    if where and re.match(r"Expected `\w+` (>|<|matching|of length)", msg):
        msg = refusal(where, data, Topology) or msg
    # a section's own check (``__post_init__``) names its key within the section
    within = re.fullmatch(r"([A-Za-z_]\w*(?:\[\d+\])?(?:\.[A-Za-z_]\w*(?:\[\d+\])?)*): (.*)", msg,
                          re.DOTALL)
    if where and within:
        return f"{where}.{within.group(1)}: {within.group(2)}"
    return f"{where}: {msg}" if where else msg


ROWS: dict[str, tuple[Mapping[str, type[msgspec.Struct]], str]] = {
    "adv_estimator": (ESTIMATOR_ROWS, AlgorithmConfig().adv_estimator.name),
    "policy_loss": (LOSS_ROWS, AlgorithmConfig().policy_loss.name)}
# tables a name alone may stand for (``policy_loss = "sapo"`` is ``{name = "sapo"}``)
NAMED_TABLES = {f"algorithm.{key}": "name" for key in ROWS} | {"sampler.engine": "name"}
AUTO = str(SamplerConfig().engine.name)  # sampler.engine's default: chosen for the device


def _named_table(table: Any, key: str, names: Sequence[str], default: str, hint: str = ""
                 ) -> Any:
    """``KEY = "name"`` is ``{name = "name"}``; a table without a name is ``default``'s, and a
    name not in ``names`` is refused naming the key (``hint`` after the choices)."""
    if isinstance(table, str):
        table = {"name": table}
    if not isinstance(table, dict):  # not a table (msgspec names that)
        return table
    name = table.setdefault("name", default)
    if name not in names:
        raise ConfigError(f"{key}.name: {name!r} is not one of {', '.join(names)}{hint}")
    return table


def _named_tables(data: dict[str, Any]) -> None:
    """The estimator's, the policy loss's and the engines' tables, each a row's name and its
    options."""
    algorithm = data.get("algorithm")
    for key, (rows, default) in ROWS.items():
        if isinstance(algorithm, dict) and key in algorithm:
            table = algorithm[key]
            mine = (f" (a function of your own from a file: name = \"custom\", function = "
                    f"{table.get('name', default)!r})"
                    if isinstance(table, dict) and "path" in table else "")
            algorithm[key] = _named_table(table, f"algorithm.{key}", list(rows), default, mine)
    sampler = data.get("sampler")
    if isinstance(sampler, dict):
        for name in ENGINES:
            if name in sampler:  # the engines' options were sections of [sampler] once
                raise ConfigError(f"sampler.{name}: an engine's options are its own table's: "
                                  f"sampler.engine = {{name = \"{name}\", ...}}")
        if "engine" in sampler:
            engine = sampler["engine"] = _named_table(sampler["engine"], "sampler.engine",
                                                      [AUTO, *ENGINES], AUTO)
            if isinstance(engine, dict) and engine["name"] == AUTO and len(engine) > 1:
                options = ", ".join(sorted(k for k in engine if k != "name"))
                raise ConfigError(f"sampler.engine: {options}: an engine's options need the "
                                  f"engine named (sampler.engine.name = {' or '.join(ENGINES)}); "
                                  f"{AUTO} takes none")
    models = data.get("reward", {}).get("models") if isinstance(data.get("reward"), dict) \
        else None
    for i, model in enumerate(models if isinstance(models, list) else []):
        if isinstance(model, dict) and "engine" in model:
            model["engine"] = _named_table(model["engine"], f"reward.models[{i}].engine",
                                           list(ENGINES), FALLBACK)


def recorded(data: dict[str, Any]) -> dict[str, Any]:
    """A run's recorded ``topology.json`` as the schema reads it now. A run recorded before an
    engine's options were its row's holds every engine's section beside the name of the one it
    ran (``sampler.engine = "hf"``, ``sampler.hf``, ``sampler.vllm``); that engine's section
    becomes its row's options, and the others go (nothing read them)."""
    sampler = data.get("sampler")
    if isinstance(sampler, dict) and isinstance(sampler.get("engine"), str):
        sections = {name: sampler.pop(name) for name in ENGINES if name in sampler}
        if sections:
            chosen = sections.get(sampler["engine"])
            sampler["engine"] = {**(chosen if isinstance(chosen, dict) else {}),
                                 "name": sampler["engine"]}
    return data


def decode_topology(data: dict[str, Any]) -> Topology:
    """Validate a raw dict into a Topology; errors name the full key path."""
    _named_tables(data)
    try:
        topology = msgspec.convert(data, Topology)
    except msgspec.ValidationError as exc:
        # msgspec reports "... - at `$.learner.total_stepz`"; restate it as a key path
        raise ConfigError(_key_path_message(str(exc), data)) from None
    check(topology)
    return _derived(_absolute_paths(topology))


def _derived(topology: Topology) -> Topology:
    """Defaults that follow from other keys, filled in so each actor reads its own section."""
    s = topology.sampler
    if s.score_timeout_s == 0:
        timeout = topology.router.request_timeout + topology.reward.timeout_s + 10.0
        s = msgspec.structs.replace(s, score_timeout_s=timeout)
    s = msgspec.structs.replace(s, engine=sampler_engine(s))
    L = topology.learner  # auto: shm on one host, zmq across hosts (or nodes of a cluster),
    # the engine's own choice when it shares the learner's GPU (ipc for hf)
    across = bool(topology.hosts) or LAUNCHERS[topology.run.launcher].across_nodes
    beside = (L.weights_transport == "auto" and s.engine.beside_learner
              and shares_learners_gpu(L, s))
    L = msgspec.structs.replace(L, weights_transport=resolve_transport(
        L.weights_transport, weights_address=L.weights_address, hosts=across, beside=beside))
    a = topology.algorithm  # a user's own loss or estimator: its file's content, recorded
    a = msgspec.structs.replace(a, **{key: _hashed(getattr(a, key)) for key in ROWS})
    v = topology.validation  # validation samples like the sampler unless told otherwise
    v = msgspec.structs.replace(
        v, temperature=s.temperature if v.temperature is None else v.temperature,
        top_p=s.top_p if v.top_p is None else v.top_p,
        max_tokens=s.max_tokens if v.max_tokens is None else v.max_tokens)
    return msgspec.structs.replace(topology, sampler=s, learner=L, validation=v, algorithm=a)


def _hashed(row: msgspec.Struct) -> msgspec.Struct:
    """A ``custom`` row with its file's sha256 (the learner refuses another content); a row
    that has one (a recorded run's topology) keeps it."""
    if not isinstance(row, CustomLoss | CustomEstimator) or row.sha256:
        return row
    return msgspec.structs.replace(row, sha256=file_sha256(row.path))


def shares_learners_gpu(learner: LearnerConfig, sampler: SamplerConfig,
                        gpus: Sequence[str] | None = None) -> bool:
    """Whether every sampler computes on the learner's one GPU (``gpus``: those the runner sees,
    ``visible_gpus``): one learner rank, full weights (LoRA adapters are megabytes), one-GPU
    engines, and either a single GPU for all or the same ``cuda:N`` named on both sides."""
    if (not sampler.count or learner.nproc_per_node * learner.nnodes != 1 or learner.lora.rank
            or sampler_engine(sampler).gpus() != 1
            or "cpu" in (learner.device, sampler.device)):
        return False
    gpus = visible_gpus() if gpus is None else gpus
    if len(gpus) == 1:
        return True
    return bool(gpus) and learner.device == sampler.device and ":" in learner.device


def _absolute_paths(value: Any) -> Any:
    """Every ``FilePath`` and ``ModelPath`` field (files and directories named relative to where
    the job is started) made absolute: the actors run elsewhere and read the resolved topology."""
    if isinstance(value, list):
        return [_absolute_paths(item) for item in value]
    if not isinstance(value, msgspec.Struct):
        return value
    changes = {}
    for field in msgspec.structs.fields(value):
        old = getattr(value, field.name)
        kind = next((m.extra["path"] for m in getattr(field.type, "__metadata__", ())
                     if (m.extra or {}).get("path")), None)
        if kind == "model" and old == DEFAULT_MODEL:
            new = old  # the embedded model: a name, not a path
        else:
            new = _absolute(old) if kind else _absolute_paths(old)
        if new is not old:
            changes[field.name] = new
    return msgspec.structs.replace(value, **changes) if changes else value


def _absolute(path: str) -> str:
    return str(Path(path).resolve()) if path else path


def load_topology(path: str | Path, overrides: Sequence[str] = ()) -> Topology:
    """Read a topology TOML file, apply dotted overrides, validate."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"topology file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return decode_topology(_beside(apply_overrides(data, list(overrides)), path.parent))


def _beside(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A user's own loss or estimator file (``algorithm.policy_loss.path``) is named relative
    to the topology file's directory: it belongs with the topology, wherever the job starts."""
    algorithm = data.get("algorithm")
    for key in ROWS:
        row = algorithm.get(key) if isinstance(algorithm, dict) else None
        if isinstance(row, dict) and isinstance(row.get("path"), str) and row["path"]:
            row["path"] = str((folder / Path(row["path"]).expanduser()).resolve())
    return data
