"""The typed topology: ``topology.toml`` decoded into msgspec Structs, unknown keys rejected.

Every field has a one-line docstring below it. ``load_topology(path, overrides)`` applies
verl-style dotted overrides (``learner.total_steps=3``) before validation, so an error always
names the full key path (``learner.total_stepz``) whichever way the value came in.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

Restart = Literal["never", "on-failure"]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class ActorCommon(_Section):
    count: int = 1
    """How many processes of this actor kind to start."""
    threads: int = 1
    """torch intra-op threads for this actor's compute (its share of the cores)."""
    restart: Restart = "never"
    """What the runner does when one of these processes dies: stop the job, or restart it."""
    max_restarts: int = 3
    """Restarts allowed per process before the job is stopped."""


class RunConfig(_Section):
    dir: str = "runs/{time}"
    """Run directory (metrics.jsonl, checkpoints, logs). ``{time}`` becomes a timestamp."""
    seed: int = 0
    """Seed for dataset order, sampling and initialisation."""
    status_interval: float = 15.0
    """Seconds between the runner's live status tables (0 disables them)."""
    heartbeat_interval: float = 2.0
    """Seconds between actor heartbeats to the runner."""
    heartbeat_timeout: float = 120.0
    """An actor silent for this long is treated as dead."""
    socket_dir: str = ""
    """Directory for ipc:// sockets of ``auto`` addresses (default: a fresh folder under /tmp)."""


class ModelConfig(_Section):
    path: str = "default"
    """Local Hugging Face model directory, or ``default`` for the embedded SmolLM2-135M-Instruct."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for sampling and training (float32 is the fast choice on CPUs)."""


class TaskConfig(_Section):
    name: str = "arithmetic"
    """Built-in task (``arithmetic``, ``repeat_letter``)."""
    size: int = 100_000
    """Number of distinct prompts the task generates."""
    max_operand: int = 9
    """arithmetic: operands are drawn from 1..max_operand."""
    system_prompt: str = ""
    """Override the task's system prompt (empty: the task's own)."""


class AlgorithmConfig(_Section):
    adv_estimator: Literal["grpo", "dr_grpo"] = "grpo"
    """Advantage estimator (verl name)."""
    n: int = 8
    """Completions sampled per prompt (the GRPO group size; verl ``rollout.n``)."""
    clip_ratio_low: float = 0.2
    """PPO clip ε_low."""
    clip_ratio_high: float = 0.2
    """PPO clip ε_high (> ε_low is DAPO clip-higher)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses are reduced (verl names)."""
    correction: Literal["decoupled", "bypass"] = "decoupled"
    """Off-policy correction: decoupled PPO with truncated IS, or behaviour log-probs as old."""
    tis_cap: float = 2.0
    """Cap C of the token-level truncated importance weight min(π_old/μ, C)."""
    max_staleness: int = 1
    """Policy versions a sample may lag the learner (0 = synchronous). Older groups are dropped."""


class SamplerConfig(ActorCommon):
    prompts_per_request: int = 4
    """Prompts a sampler asks for (and generates) per batch."""
    temperature: float = 1.0
    """Sampling temperature (the learner computes log-probs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    max_tokens: int = 32
    """Maximum response tokens."""
    stop: list[str] = []
    """Extra stop strings (EOS always stops)."""
    restart: Restart = "on-failure"
    """Samplers hold no state worth keeping, so they restart by default."""


class RouterConfig(ActorCommon):
    address: str = "auto"
    """Where samplers send scoring requests (ZeroMQ endpoint, or ``auto``)."""
    worker_address: str = "auto"
    """Where reward workers connect (ZeroMQ endpoint, or ``auto``)."""
    request_timeout: float = 60.0
    """Seconds before a request in flight at a worker is re-sent elsewhere."""


class RewardConfig(ActorCommon):
    capacity: int = 4
    """Requests one reward worker takes at once."""
    restart: Restart = "on-failure"
    """Reward workers are stateless, so they restart by default."""


class ReplayConfig(ActorCommon):
    address: str = "auto"
    """Where samplers and the learner connect (ZeroMQ endpoint, or ``auto``)."""
    capacity: int = 256
    """Most scored groups held at once; admission never lets more be in flight."""


class LearnerConfig(ActorCommon):
    weights_address: str = "auto"
    """Where samplers poll for new weights (ZeroMQ endpoint, or ``auto``)."""
    total_steps: int = 40
    """Optimizer steps before the job ends."""
    groups_per_step: int = 4
    """Prompts (groups of ``n`` samples) per training step (verl ``data.train_batch_size``)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward; gradients accumulate over the step's batch."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    save_every: int = 10
    """Checkpoint every K steps (and always at the end)."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk."""
    resume: bool = True
    """Continue from the run directory's latest checkpoint when one exists."""


class Topology(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    sampler: SamplerConfig = SamplerConfig()
    router: RouterConfig = RouterConfig()
    reward: RewardConfig = RewardConfig()
    replay: ReplayConfig = ReplayConfig()
    learner: LearnerConfig = LearnerConfig()
    control_address: str = "auto"
    """Where every actor reports to the runner (ZeroMQ endpoint, or ``auto``)."""


ACTOR_KINDS = ("replay", "router", "reward", "learner", "sampler")


class ConfigError(ValueError):
    """A topology that cannot be used; the message names the offending key path."""


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
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[: i + 1])} is not a table")
            node = child
        node[path[-1]] = value
    return data


def _check(topology: Topology) -> None:
    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: {why}")

    for kind in ACTOR_KINDS:
        section: ActorCommon = getattr(topology, kind)
        need(section.count >= 0, f"{kind}.count", "must be >= 0")
        need(section.threads >= 1, f"{kind}.threads", "must be >= 1")
    for kind in ("replay", "router", "learner"):
        need(getattr(topology, kind).count == 1, f"{kind}.count", "must be 1 (one owner)")
    need(topology.sampler.count >= 1, "sampler.count", "must be >= 1")
    a = topology.algorithm
    need(a.n >= 1, "algorithm.n", "must be >= 1")
    need(a.max_staleness >= 0, "algorithm.max_staleness", "must be >= 0")
    need(a.tis_cap > 0, "algorithm.tis_cap", "must be > 0")
    need(0 <= a.clip_ratio_low < 1, "algorithm.clip_ratio_low", "must be in [0, 1)")
    need(a.clip_ratio_high >= 0, "algorithm.clip_ratio_high", "must be >= 0")
    s = topology.sampler
    need(s.temperature > 0, "sampler.temperature", "must be > 0")
    need(0 < s.top_p <= 1, "sampler.top_p", "must be in (0, 1]")
    need(s.top_k >= 0, "sampler.top_k", "must be >= 0")
    need(s.max_tokens >= 1, "sampler.max_tokens", "must be >= 1")
    need(s.prompts_per_request >= 1, "sampler.prompts_per_request", "must be >= 1")
    L = topology.learner
    need(L.total_steps >= 1, "learner.total_steps", "must be >= 1")
    need(L.groups_per_step >= 1, "learner.groups_per_step", "must be >= 1")
    need(L.micro_batch_size >= 1, "learner.micro_batch_size", "must be >= 1")
    need(L.lr > 0, "learner.lr", "must be > 0")
    need(L.save_every >= 1, "learner.save_every", "must be >= 1")
    need(L.keep_checkpoints >= 1, "learner.keep_checkpoints", "must be >= 1")
    need(topology.replay.capacity >= L.groups_per_step, "replay.capacity",
         f"must hold at least one batch (learner.groups_per_step = {L.groups_per_step})")
    need(topology.reward.capacity >= 1, "reward.capacity", "must be >= 1")
    need(topology.task.size >= 1, "task.size", "must be >= 1")


def _key_path_message(msg: str) -> str:
    """Restate msgspec's "what - at `$.a.b`" as "a.b: what" (unknown keys get their own name)."""
    where = ""
    if " - at `$." in msg:
        msg, where = msg.rsplit(" - at `$.", 1)
        where = where.rstrip("`")
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", msg)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return f"{key}: unknown key"
    return f"{where}: {msg}" if where else msg


def decode_topology(data: dict[str, Any]) -> Topology:
    """Validate a raw dict into a Topology; errors name the full key path."""
    try:
        topology = msgspec.convert(data, Topology)
    except msgspec.ValidationError as exc:
        # msgspec reports "... - at `$.learner.total_stepz`"; restate it as a key path
        raise ConfigError(_key_path_message(str(exc))) from None
    _check(topology)
    return topology


def load_topology(path: str | Path, overrides: list[str] = ()) -> Topology:
    """Read a topology TOML file, apply dotted overrides, validate."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"topology file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return decode_topology(apply_overrides(data, list(overrides)))
