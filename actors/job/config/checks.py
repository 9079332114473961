"""Checks of a decoded topology that its fields' types cannot express (combinations of keys,
files that must exist; a key's own range is declared on its field). Each failure is a
``ConfigError`` that names the full key path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from actors.data.files import DataFileError, jsonl_rows
from actors.data.vision import is_vision_model
from actors.job.config.agent_checks import check_agent, check_branches
from actors.job.launchers.base import LAUNCHERS
from actors.registry import KINDS
from actors.runtime.config.algorithm import AlgorithmConfig
from actors.runtime.config.placement import check_placement
from actors.runtime.config.pools import check_models
from actors.runtime.config.schema import DatasetConfig, Topology
from actors.runtime.config.schema_base import ActorCommon, ConfigError, need
from actors.runtime.config.teacher import check_teacher
from actors.sampler.engines.registry import ENGINES, EngineRow, auto_engine
from kernels import rollout_options  # torch-free: the rules the learner's kernels apply


def check(topology: Topology) -> None:
    """Raise ``ConfigError`` (naming the key path) for what the types alone do not rule out."""
    for kind in KINDS:
        section: ActorCommon = getattr(topology, kind.name)
        if kind.max_count == 1:
            need(section.count == kind.max_count, f"{kind.name}.count", "must be 1 (one owner)")
        else:
            need(section.count >= kind.min_count, f"{kind.name}.count",
                 f"must be >= {kind.min_count}")
    a = topology.algorithm
    _check_correction(a)
    need(a.clip_ratio_low < 1 or not a.policy_loss.clip_is_ratio,
         "algorithm.clip_ratio_low", f"must be < 1 with policy_loss = {a.policy_loss.name!r}")
    need(a.clip_ratio_c == 0 or a.clip_ratio_c > 1, "algorithm.clip_ratio_c", "must be > 1 (or 0: off)")
    need(a.n >= a.adv_estimator.min_group, "algorithm.n",
         f"{a.adv_estimator.name} needs groups of >= {a.adv_estimator.min_group}")
    s = topology.sampler
    if s.engine != "auto":
        problem = ENGINES[s.engine].problem()
        need(problem is None, "sampler.engine", f"{s.engine}: {problem}")
        need(s.weight_update == "between_batches" or ENGINES[s.engine].continuous,
             "sampler.weight_update", f"in_flight needs a continuous engine (sampler.engine = "
             f"{_engines(lambda r: r.continuous)}): the {s.engine} engine loads weights between "
             "batches")
    if s.profile_batches:
        engine = s.engine if s.engine != "auto" else auto_engine(s.device)
        need(ENGINES[engine].profiled, "sampler.profile_batches",
             f"the {engine} engine's batches are not profiled here (engines that are: "
             f"{_engines(lambda r: r.profiled, ', ')}); vLLM has its own profiler "
             "(VLLM_TORCH_PROFILER_DIR)")
    _check_sleep(s)
    L = topology.learner
    need(L.ppo_mini_batches <= L.groups_per_step, "learner.ppo_mini_batches",
         f"must be in [1, groups_per_step = {L.groups_per_step}] (mini-batches hold whole groups)")
    need(not (L.offload and L.lora.rank > 0), "learner.offload",
         "needs full fine-tuning: LoRA trains unsharded (set learner.lora.rank = 0 or offload = false)")
    if L.lora.rank > 0:
        _check_adapters(topology)
    if L.weights_transport != "auto":
        from actors.runtime.transports.base import transport_problem

        engine = s.engine if s.engine != "auto" else auto_engine(s.device)
        problem = transport_problem(L.weights_transport, engine=engine,
                                    weights_address=L.weights_address, learner_device=L.device,
                                    sampler_device=s.device)
        need(problem is None, "learner.weights_transport", str(problem))
    check_placement(topology)
    check_teacher(topology)
    # the two stateful actors resume together or not at all: the replay buffer rebuilds itself as
    # of the learner's checkpoint, which only holds when both start from it
    for name in ("replay", "learner"):
        need(getattr(topology, name).restart == "never", f"{name}.restart",
             "must be \"never\": restarted alone it would not match the other's state; when it "
             "dies the job stops, and starting it again with the same run.dir resumes exactly")
    need(topology.replay.capacity >= L.groups_per_step, "replay.capacity",
         f"must hold at least one batch (learner.groups_per_step = {L.groups_per_step})")
    R = topology.reward
    for i, fn in enumerate(R.functions):
        key = f"reward.functions[{i}]"
        need(bool(fn.builtin) != bool(fn.path), key, "set either builtin or path (one of them)")
        need(not (fn.builtin and fn.batch), f"{key}.batch", "built-ins score one item per call")
        need(not fn.path or Path(fn.path).is_file(), f"{key}.path", f"no file {fn.path!r}")
    check_models(topology)
    need(R.memory_mb == 0 or R.memory_mb >= 128, "reward.memory_mb",
         "must be >= 128 (a Python child needs that much address space) or 0 (no limit)")
    max_length = R.max_response_length or s.max_tokens
    need(R.overlong_buffer_len <= max_length, "reward.overlong_buffer_len",
         f"must be <= the response length limit ({max_length})")
    _check_datasets(topology.task.datasets)
    _check_datasets(topology.validation.datasets, "validation.datasets")
    loggers = topology.run.loggers
    need(len(set(loggers)) == len(loggers), "run.loggers", "names a logger twice")
    F = a.filter_groups
    need(not F.enable or a.n >= 2, "algorithm.filter_groups.enable",
         "needs algorithm.n >= 2 (a group of one always has equal rewards)")
    reuse = topology.replay.reuse
    need(reuse <= a.max_staleness + 1, "replay.reuse",
         f"a group can be served at most once per policy version while it is fresh, so at most "
         f"algorithm.max_staleness + 1 = {a.max_staleness + 1} times; raise max_staleness")
    check_agent(topology.agent)
    check_branches(topology)
    sec = topology.security
    need(not sec.curve or zmq.has("curve"), "security.curve",
         "this libzmq was built without CURVE support (zmq.has('curve') is False)")
    need(sec.curve or not sec.authorized_keys, "security.authorized_keys",
         "needs security.curve = true")
    LAUNCHERS[topology.run.launcher].check(topology)  # [hosts], or [ray]


def _check_adapters(topology: Topology) -> None:
    """LoRA publishes the adapters alone: every sampler must apply them to its base, or it
    would sample from the base while the learner trains (a config error, never a quiet run)."""
    from actors.job.config.capacity import linear_modules

    L, s = topology.learner, topology.sampler
    engine = s.engine if s.engine != "auto" else auto_engine(s.device)
    need(ENGINES[engine].adapters, "sampler.engine",
         f"{engine} cannot apply the LoRA adapters learner.lora.rank = {L.lora.rank} publishes "
         f"(engines that can: {_engines(lambda r: r.adapters, ', ')})")
    row = ENGINES[engine]
    need(not row.max_adapter_rank or L.lora.rank <= row.max_adapter_rank, "learner.lora.rank",
         f"{engine} serves LoRA ranks up to {row.max_adapter_rank} (got {L.lora.rank})")
    need(bool(L.lora.target_modules), "learner.lora.target_modules", "must name a module")
    # the learner's log-probs take the LM head's weight itself (kernels.lm_head_logprobs): an
    # adapter there would never train; embedding adapters have no publish path (nor vLLM's)
    cannot = sorted(set(L.lora.target_modules) & {"lm_head", "embed_tokens"})
    need(not cannot, "learner.lora.target_modules",
         f"{cannot}: adapters on the LM head and embeddings are not supported (the learner's "
         "log-probs read the LM head's weight directly)")
    need(not L.lora.vision or is_vision_model(topology.model.path), "learner.lora.vision",
         f"{topology.model.path} has no vision tower to put adapters on")
    need(not (L.lora.vision and topology.model.freeze_vision), "learner.lora.vision",
         "adapters on the vision tower would not train with model.freeze_vision = true")
    served = linear_modules(Path(topology.model.path))
    if served is not None:
        missing = [m for m in L.lora.target_modules if m not in served]
        need(not missing, "learner.lora.target_modules",
             f"{missing} are no linear module of {topology.model.path} (it has: "
             f"{', '.join(sorted(served))})")


def _check_correction(a: AlgorithmConfig) -> None:
    c = a.correction
    key = "algorithm.correction"
    need(c.is_low is None or 0 < c.is_low <= c.is_cap, f"{key}.is_low",
         f"must be in (0, is_cap = {c.is_cap}]")
    need(c.is_low is None or c.is_level != "none", f"{key}.is_low",
         "an IcePop band needs IS weights: set is_level to token or sequence")
    names: dict[str, str] = {}
    for i, r in enumerate(c.rejection):
        try:
            rule = rollout_options.RejectionRule(r.statistic, r.level, r.low, r.high, r.reduce)
        except ValueError as exc:
            raise ConfigError(f"{key}.rejection[{i}]: {exc}") from None
        need(rule.name not in names, f"{key}.rejection[{i}]",
             f"a second rule for {rule.name} (after {names.get(rule.name)}); merge their bounds")
        names[rule.name] = f"{key}.rejection[{i}]"
    need(bool(c.rollout_rs) or c.rollout_rs_threshold == "", f"{key}.rollout_rs_threshold",
         "is set but rollout_rs is empty")
    if c.rollout_rs:
        need(c.rollout_rs_threshold != "", f"{key}.rollout_rs_threshold",
             "rollout_rs needs its thresholds (verl has no default)")
        try:
            presets = rollout_options.parse_rs_preset(c.rollout_rs, c.rollout_rs_threshold)
        except ValueError as exc:
            raise ConfigError(f"{key}.rollout_rs: {exc}") from None
        for rule in presets:
            need(rule.name not in names, f"{key}.rollout_rs",
                 f"{rule.name} is already a rule of {names.get(rule.name)}")
            names[rule.name] = f"{key}.rollout_rs"
    if c.mode == "bypass":
        need(a.policy_loss.takes_correction or not names, f"{key}.rejection",
             "in bypass mode there is no π_old to compare μ with: rejection acts only with "
             "algorithm.policy_loss = \"bypass_mode\" (on π_θ/μ)")
        need(not a.adv_estimator.old_forward, "algorithm.adv_estimator",
             f"{a.adv_estimator.name} needs π_old's forward pass (sum_pi_squared), which bypass mode "
             "skips (verl: the same); use correction.mode = \"decoupled\"")
    need(not a.policy_loss.takes_correction or c.mode == "bypass", "algorithm.policy_loss",
         "bypass_mode takes the behaviour log-probs as the old log-probs: set "
         "algorithm.correction.mode = \"bypass\" (verl: rollout_correction.bypass_mode = true)")


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
    names: dict[str, int] = {}
    for i, d in enumerate(datasets):
        key = f"{where}[{i}]"
        need(bool(d.path) != bool(d.builtin), key, "set either path or builtin (one of them)")
        name = d.name or d.builtin or Path(d.path).stem
        need(name not in names, f"{key}.name",
             f"{name!r} is already the name of {where}[{names.get(name)}]; name one")
        names[name] = i
        if d.builtin:
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


def _check_sleep(s: Any) -> None:
    """``sampler.sleep_idle_s``: vLLM's sleep mode, which only its GPU builds have."""
    if s.sleep_idle_s > 0:
        need(s.engine in ENGINES and ENGINES[s.engine].sleeps, "sampler.sleep_idle_s",
             "sleeping frees GPU memory through the engine's sleep mode: needs sampler.engine "
             f"= {_engines(lambda r: r.sleeps)}")
        need(s.device != "cpu", "sampler.sleep_idle_s",
             f"{s.engine} has no sleep mode on a CPU (sampler.device = cpu)")


def _engines(has: Callable[[EngineRow], bool], join: str = " or ") -> str:
    """The engines whose row ``has`` it (for an error naming what to choose instead)."""
    return join.join(n for n, row in ENGINES.items() if has(row))
