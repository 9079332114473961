"""Checks of a decoded topology that look at the world or at the tables above the config:
files that must exist, datasets' columns, what is installed, the actor kinds' counts, the
engines and transports a combination of keys needs. A key's own range is declared on its field,
and a check across keys lives with its section (``__post_init__``, run as msgspec decodes it).
Each failure is a ``ConfigError`` that names the full key path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from actors.data.files import DataFileError, jsonl_rows
from actors.data.vision import is_vision_model
from actors.job.config.agent_checks import check_agent
from actors.job.launchers.table import LAUNCHERS
from actors.registry import KINDS
from actors.runtime.config import (
    ENGINES,
    ActorCommon,
    AutoEngine,
    ConfigError,
    CustomEstimator,
    CustomLoss,
    DatasetConfig,
    EngineRow,
    Topology,
    check_placement,
    check_served,
    check_teacher,
    need,
    sampler_engine,
)
from actors.runtime.transports.table import transport_problem


def check(topology: Topology) -> None:
    """Raise ``ConfigError`` (naming the key path) for what the types alone do not rule out."""
    for kind in KINDS:
        section: ActorCommon = getattr(topology, kind.name)
        if kind.max_count == 1:
            need(section.count == kind.max_count, f"{kind.name}.count", "must be 1 (one owner)")
        else:
            need(section.count >= kind.min_count, f"{kind.name}.count",
                 f"must be >= {kind.min_count}")
    s = topology.sampler
    if not isinstance(s.engine, AutoEngine):
        problem = s.engine.problem()
        need(problem is None, "sampler.engine", f"{s.engine.name}: {problem}")
        need(s.weight_update == "between_batches" or s.engine.continuous,
             "sampler.weight_update", f"in_flight needs a continuous engine (sampler.engine = "
             f"{_engines(lambda r: r.continuous)}): the {s.engine.name} engine loads weights between "
             "batches")
    if s.profile_batches:
        engine = sampler_engine(s)
        need(engine.profiled, "sampler.profile_batches",
             f"the {engine.name} engine's batches are not profiled here (engines that are: "
             f"{_engines(lambda r: r.profiled, ', ')}); vLLM has its own profiler "
             "(VLLM_TORCH_PROFILER_DIR)")
    _check_sleep(s)
    if topology.run.deterministic:
        _check_deterministic(topology)
    L = topology.learner
    if L.lora.rank > 0:
        _check_adapters(topology)
    if L.weights_transport != "auto":
        engine = sampler_engine(s)
        problem = transport_problem(L.weights_transport, engine=engine.name,
                                    weights_address=L.weights_address, learner_device=L.device,
                                    sampler_device=s.device)
        need(problem is None, "learner.weights_transport", str(problem))
    check_placement(topology)
    check_teacher(topology)
    for i, fn in enumerate(topology.reward.functions):
        need(not fn.path or Path(fn.path).is_file(), f"reward.functions[{i}].path",
             f"no file {fn.path!r}")
    for key, row in (("policy_loss", topology.algorithm.policy_loss),
                     ("adv_estimator", topology.algorithm.adv_estimator)):
        if isinstance(row, (CustomLoss, CustomEstimator)):  # a user's own, from a file
            need(Path(row.path).is_file(), f"algorithm.{key}.path", f"no file {row.path!r}")
    check_served(topology)
    _check_datasets(topology.task.datasets)
    _check_datasets(topology.validation.datasets, "validation.datasets")
    check_agent(topology.agent)
    _check_verifiers_turns(topology)
    need(not topology.security.curve or zmq.has("curve"), "security.curve",
         "this libzmq was built without CURVE support (zmq.has('curve') is False)")
    LAUNCHERS[topology.run.launcher].check(topology)  # [hosts], or [ray]


def _check_adapters(topology: Topology) -> None:
    """LoRA publishes the adapters alone: every sampler must apply them to its base, or it
    would sample from the base while the learner trains (a config error, never a quiet run)."""
    from actors.job.config.capacity import linear_modules

    L, s = topology.learner, topology.sampler
    engine = sampler_engine(s)
    need(engine.adapters, "sampler.engine",
         f"{engine.name} cannot apply the LoRA adapters learner.lora.rank = {L.lora.rank} publishes "
         f"(engines that can: {_engines(lambda r: r.adapters, ', ')})")
    need(not engine.max_adapter_rank or L.lora.rank <= engine.max_adapter_rank,
         "learner.lora.rank",
         f"{engine.name} serves LoRA ranks up to {engine.max_adapter_rank} (got {L.lora.rank})")
    need(not L.lora.vision or is_vision_model(topology.model.path), "learner.lora.vision",
         f"{topology.model.path} has no vision tower to put adapters on")
    served = linear_modules(Path(topology.model.path))
    if served is not None:
        missing = [m for m in L.lora.target_modules if m not in served]
        need(not missing, "learner.lora.target_modules",
             f"{missing} are no linear module of {topology.model.path} (it has: "
             f"{', '.join(sorted(served))})")


def _dataset_columns(path: Path) -> set[str]:
    """Top-level column names of a dataset file (parquet schema, or the first jsonl row)."""
    if path.suffix == ".parquet":
        import pyarrow as pa  # type: ignore[import-untyped]
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        try:
            return set(pq.read_schema(path).names)
        except (pa.ArrowException, OSError) as exc:  # junk, truncated or unreadable
            raise ConfigError(f"not a parquet file ({exc})") from None
    try:
        return set(next(jsonl_rows(path), {}))
    except DataFileError as exc:  # a line that is not a JSON object
        raise ConfigError(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not text
        raise ConfigError(f"cannot read {path} as jsonl text ({exc})") from None


def _check_datasets(datasets: Sequence[DatasetConfig],
                    where: str = "task.datasets") -> None:
    for i, d in enumerate(datasets):
        key = f"{where}[{i}]"
        if d.builtin:
            continue
        if d.reasoning_gym is not None:  # the package, the name and the options, at check
            from actors.data.reasoning_gym import generator, spec_of

            try:
                generator(spec_of(d.reasoning_gym, 0))
            except ValueError as exc:
                raise ConfigError(f"{key}.reasoning_gym: {exc}") from None
            continue
        if d.verifiers is not None:  # the package, the environment, its args and its kind
            from actors.data import verifiers_env

            try:
                verifiers_env.check(verifiers_env.spec_of(d.verifiers))
            except ValueError as exc:
                raise ConfigError(f"{key}.verifiers: {exc}") from None
            continue
        path = Path(d.path)
        need(path.is_file(), f"{key}.path", f"no file {d.path!r}")
        try:
            columns = _dataset_columns(path)
        except ConfigError as exc:
            raise ConfigError(f"{key}.path: {exc}") from None
        need(bool(columns), f"{key}.path", f"{d.path!r} holds no rows")
        shown = ", ".join(sorted(columns))
        for field, column in (("prompt_key", d.prompt_key), ("answer_key", d.answer_key),
                              ("image_key", d.image_key)):
            need(not column or column.split(".")[0] in columns, f"{key}.{field}",
                 f"no column {column.split('.')[0]!r} in {d.path!r} (columns: {shown})")
        need(bool(d.data_source) or "data_source" in columns, f"{key}.data_source",
             f"{d.path!r} has no data_source column (columns: {shown}); set data_source")


def _check_verifiers_turns(t: Topology) -> None:
    """A multi-turn verifiers environment plays its turns in the agent loop
    (``agent.env.verifiers``), which then hosts every prompt's environment: each dataset must
    be one (after ``_check_datasets`` loaded them)."""
    need(not t.agent.env.verifiers or bool(t.task.datasets), "agent.env.verifiers",
         "plays the prompts' verifiers environments: task.datasets must name them "
         "(verifiers = {...})")
    sets: list[tuple[str, Sequence[DatasetConfig]]] = [
        ("task.datasets", t.task.datasets), ("validation.datasets", t.validation.datasets)]
    for where, datasets in sets:
        for i, d in enumerate(datasets):
            key = f"{where}[{i}]"
            if t.agent.env.verifiers:
                need(d.verifiers is not None, key, "agent.env.verifiers plays each prompt's "
                     "verifiers environment: every dataset must be verifiers = {...}")
            elif d.verifiers is not None:
                from actors.data import verifiers_env

                loaded = verifiers_env.environment(verifiers_env.spec_of(d.verifiers))
                need(not loaded.multi_turn, f"{key}.verifiers", f"{loaded.name} is multi-turn "
                     f"(its {type(loaded.env).__name__} plays the turns): set "
                     "agent.env.verifiers = true")


def _check_sleep(s: Any) -> None:
    """``sampler.sleep_idle_s``: vLLM's sleep mode, which only its GPU builds have."""
    if s.sleep_idle_s > 0:
        need(s.engine.sleeps, "sampler.sleep_idle_s",
             "sleeping frees GPU memory through the engine's sleep mode: needs sampler.engine "
             f"= {_engines(lambda r: r.sleeps)}")
        need(s.device != "cpu", "sampler.sleep_idle_s",
             f"{s.engine.name} has no sleep mode on a CPU (sampler.device = cpu)")


def _check_deterministic(t: Topology) -> None:
    """What a fixed schedule cannot fix (``run.deterministic``, ``actors/replay/schedule.py``),
    each refused in one line."""
    why = "run.deterministic"
    engine = sampler_engine(t.sampler)
    need(not engine.continuous, why,
         f"the {engine.name} engine batches requests as they arrive, and a sequence's numbers "
         f"depend on its batch; use an engine that generates one batch at a time "
         f"(sampler.engine = {_engines(lambda r: not r.continuous)})")
    need(not t.algorithm.filter_groups.enable, "algorithm.filter_groups.enable",
         f"{why}: dynamic sampling admits replacement prompts as groups arrive, which no fixed "
         "schedule can place; set it false")
    need(not t.run.deterministic or t.replay.reuse == 1, "replay.reuse",  # a rule of two keys
         f"{why}: a group served in several batches is not one place of the schedule; set 1")
    a = t.agent
    need(not a.enabled, "agent.rollout.path" if a.rollout.path else
         a.env.key if a.env.enabled else "agent.tools",
         f"{why}: a multi-turn rollout sends each turn to the engine as its tool calls (or "
         "the agent's own code) finish, so which sequences share a batch is timing's")
    G, eta = t.learner.groups_per_step, t.algorithm.max_staleness
    need(t.replay.capacity >= max(1, eta) * G, "replay.capacity",
         f"{why}: must hold the max_staleness = {eta} batches generated ahead of the learner "
         f"(>= {max(1, eta) * G} groups)")


def _engines(has: Callable[[type[EngineRow]], bool], join: str = " or ") -> str:
    """The engines whose row ``has`` it (for an error naming what to choose instead)."""
    return join.join(n for n, row in ENGINES.items() if has(row))
