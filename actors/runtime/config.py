"""The typed topology: ``topology.toml`` decoded into msgspec Structs, unknown keys rejected.

Every field has a one-line docstring below it. ``load_topology(path, overrides)`` applies
verl-style dotted overrides (``learner.total_steps=3``) before validation, so an error always
names the full key path (``learner.total_stepz``) whichever way the value came in.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import zmq

Restart = Literal["never", "on-failure"]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class ActorCommon(_Section, frozen=True):
    count: int = 1
    """How many processes of this actor kind to start."""
    threads: int = 1
    """torch intra-op threads for this actor's compute (its share of the cores)."""
    restart: Restart = "never"
    """What the runner does when one of these processes dies: stop the job, or restart it."""
    max_restarts: int = 3
    """Restarts allowed per process before the job is stopped."""


class RunConfig(_Section, frozen=True):
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
    record: bool = True
    """Record prompts, groups, fates, batches and metrics to RUN_DIR/record (crash resume needs it)."""


class ModelConfig(_Section, frozen=True):
    path: str = "default"
    """Local Hugging Face model directory, or ``default`` for the embedded SmolLM2-135M-Instruct."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for sampling and training (float32 is the fast choice on CPUs)."""


BUILTIN_TASKS = ("arithmetic", "repeat_letter")
DATASET_SUFFIXES = (".parquet", ".jsonl")


class DatasetConfig(_Section, frozen=True):
    path: str = ""
    """A parquet or jsonl file of prompts (relative to where the runner is started), in verl's
    row layout: ``prompt`` (list of chat messages), ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``. Set this or ``builtin``."""
    builtin: str = ""
    """A built-in task instead of a file (``arithmetic``, ``repeat_letter``; task.size,
    task.max_operand and task.system_prompt apply)."""
    weight: float = 1.0
    """Share of the prompts drawn from this dataset (weights are normalised over the list)."""
    name: str = ""
    """Name in the recording's ``prompts.dataset`` column (default: the file's stem or the
    built-in's name); unique over the list."""
    prompt_key: str = "prompt"
    """Column of the prompt: a list of ``{role, content}`` messages, or a string (one user
    message), e.g. ``question`` (verl ``data.prompt_key``)."""
    answer_key: str = "reward_model.ground_truth"
    """Column of the ground truth, dotted for nested fields (``answer`` for a plain file)."""
    data_source: str = ""
    """The reward scorer's ``data_source`` for every row (default: the row's ``data_source``)."""
    system_prompt: str = ""
    """A system message put before a row's messages when it has none."""
    shuffle: bool = True
    """Visit the rows in a seeded random order, a new one each pass (verl ``data.shuffle``)."""


class TaskConfig(_Section, frozen=True):
    name: str = "arithmetic"
    """Built-in task (``arithmetic``, ``repeat_letter``); not used when ``datasets`` is set."""
    datasets: list[DatasetConfig] = []
    """Prompt sources mixed by weight (``[[task.datasets]]``): the source of the i-th prompt
    drawn is a function of run.seed and i alone, so a run's data order is reproducible."""
    max_prompt_length: int = 0
    """Skip prompts longer than this many chat-templated tokens of the model's tokenizer (verl
    ``data.max_prompt_length``; 0: no limit). Skipped prompts are counted, never issued."""
    size: int = 100_000
    """Number of distinct prompts the task generates."""
    max_operand: int = 9
    """arithmetic: operands are drawn from 1..max_operand."""
    system_prompt: str = ""
    """Override the task's system prompt (empty: the task's own)."""


AdvEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
                       "reinforce_plus_plus_baseline", "remax", "gae", "opo", "grpo_passk"]
PolicyLoss = Literal["vanilla", "gspo", "reinforce", "gpg", "cispo"]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


class RejectionRule(_Section, frozen=True):
    statistic: Literal["ratio", "geo_mean", "k1", "k2", "k3"]
    """What is bounded: the IS ratio, its per-sequence geometric mean, or a KL statistic of it."""
    level: Literal["token", "sequence"] = "sequence"
    """Mask single tokens, or every token of a sequence whose statistic is out of bounds."""
    low: float | None = None
    """Lower bound, kept when statistic >= low (none: unbounded below; k1 can be negative)."""
    high: float | None = None
    """Upper bound, kept when statistic <= high (none: unbounded above)."""


class CorrectionConfig(_Section, frozen=True):
    mode: Literal["decoupled", "bypass"] = "decoupled"
    """decoupled: proximal log-probs recomputed, PPO on π_θ/π_old, tokens weighted by π_old/μ;
    bypass: the sampler's behaviour log-probs are the PPO old log-probs (no recompute)."""
    is_level: Literal["token", "sequence", "none"] = "token"
    """Truncated importance weight min(π_old/μ, is_cap) per token, per sequence, or none."""
    is_cap: float = 2.0
    """Cap of the truncated importance weight (verl 2.0, AReaL 5.0, TRL 3.0)."""
    normalize_weights: bool = False
    """Rescale the importance weights of a batch to mean 1."""
    rejection: list[RejectionRule] = []
    """Masked IS / rejection rules (IcePop, verl rollout_rs); a token is kept only if all keep it."""


class KLControl(_Section, frozen=True):
    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adaptive towards target_kl (verl kl_ctrl)."""
    kl_coef: float = 0.001
    """Initial β of the KL penalty in the reward."""
    target_kl: float = 0.1
    """adaptive: the KL the controller steers to."""
    horizon: int = 10000
    """adaptive: steps over which β moves by at most 20%."""


class FilterGroups(_Section, frozen=True):
    enable: bool = False
    """Drop every group whose samples all got the same reward (it has no learning signal) and
    admit replacement prompts until the batch is full."""
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    """verl's metric names; here all of them are the sample's reward (the scorers' score)."""
    max_num_gen_batches: int = 0
    """Stop the job with an error when more than this many batches' worth of groups
    (× learner.groups_per_step) are filtered between two served batches (0: no limit)."""


class AlgorithmConfig(_Section, frozen=True):
    adv_estimator: AdvEstimator = "grpo"
    """Advantage estimator (verl names): grpo, dr_grpo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax (adds a greedy sample per prompt), gae (trains a critic),
    opo, grpo_passk."""
    norm_adv_by_std_in_grpo: bool = True
    """grpo: divide by the group's std (False is Dr.GRPO)."""
    gamma: float = 1.0
    """Discount for reinforce_plus_plus, remax and gae."""
    lam: float = 1.0
    """GAE λ."""
    n: int = 8
    """Completions sampled per prompt (the group size; verl ``rollout.n``)."""
    policy_loss: PolicyLoss = "vanilla"
    """vanilla (PPO clip), gspo (sequence ratio), reinforce (alias gpg), cispo."""
    clip_ratio_low: float = 0.2
    """PPO clip ε_low."""
    clip_ratio_high: float = 0.2
    """PPO clip ε_high (> ε_low is DAPO clip-higher)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant c > 1 for negative advantages (0 disables)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses are reduced (verl names), over the whole mini-batch."""
    loss_scale_factor: float = 0.0
    """seq-mean-token-sum-norm: the constant to divide by (0: sampler.max_tokens)."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss −= entropy_coeff·H."""
    use_kl_loss: bool = False
    """Add kl_loss_coef·KL(π_θ‖π_ref) to the loss, against the frozen initial model."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: KLType = "low_var_kl"
    """KL estimator of the loss term."""
    use_kl_in_reward: bool = False
    """Subtract β·KL(π_old‖π_ref) per token from the reward."""
    kl_penalty: KLType = "kl"
    """KL estimator of the in-reward penalty."""
    kl_ctrl: KLControl = KLControl()
    """Controller of β for the in-reward penalty."""
    cliprange_value: float = 0.5
    """gae: value clipping range of the critic loss."""
    correction: CorrectionConfig = CorrectionConfig()
    """Off-policy correction between the sampler's policy μ and the learner's."""
    max_staleness: int = 1
    """Policy versions a sample may lag the learner (0 = synchronous). Older groups are dropped."""
    filter_groups: FilterGroups = FilterGroups()
    """DAPO dynamic sampling: drop groups whose rewards are all equal (verl
    ``algorithm.filter_groups``)."""


class LoraConfig(_Section, frozen=True):
    rank: int = 0
    """LoRA rank (0 trains all weights). Samplers receive the merged weights."""
    alpha: float = 16.0
    """LoRA scaling α."""
    dropout: float = 0.0
    """LoRA dropout."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                       "up_proj", "down_proj")
    """Module names that get adapters."""


class SamplerConfig(ActorCommon, frozen=True):
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


class RouterConfig(ActorCommon, frozen=True):
    address: str = "auto"
    """Where samplers send scoring requests (ZeroMQ endpoint, or ``auto``)."""
    worker_address: str = "auto"
    """Where reward workers connect (ZeroMQ endpoint, or ``auto``)."""
    request_timeout: float = 60.0
    """Seconds before a request in flight at a worker is re-sent elsewhere."""


BUILTIN_SCORERS = ("gsm8k", "math", "exact_match", "answer_tag", "arithmetic", "repeat_letter",
                   "reward_model")


class RewardFunction(_Section, frozen=True):
    builtin: str = ""
    """A built-in scorer (gsm8k, math, exact_match, answer_tag, arithmetic, repeat_letter,
    reward_model); set this or ``path`` (reward_model: both)."""
    path: str = ""
    """A Python file (relative to where the runner is started) holding a verl-style scoring
    function, which runs in a child process; for ``reward_model``, the local Hugging Face
    directory of a sequence-classification checkpoint (one label: its logit is the score)."""
    name: str = "compute_score"
    """The function in ``path``: ``(data_source, solution_str, ground_truth, extra_info)`` ->
    float or dict(score=..., **numeric extras); ``async def`` works too."""
    weight: float = 1.0
    """This function's weight in the item's reward (the weighted sum over functions)."""
    batch: bool = False
    """``path`` function takes lists (``data_sources, solution_strs, ground_truths,
    extra_infos``) for a whole request and returns a list."""
    kwargs: dict[str, str | int | float | bool] = {}
    """Extra keyword arguments for every call (gsm8k: method, format_score; answer_tag:
    format_score)."""
    batch_size: int = 8
    """reward_model: sequences per forward pass."""
    max_length: int = 1024
    """reward_model: tokens kept per sequence (the start is cut, so the response's end stays)."""
    reward_mean: float = 0.0
    """reward_model: the score is (logit - reward_mean) / reward_std."""
    reward_std: float = 1.0
    """reward_model: see reward_mean."""


class RewardConfig(ActorCommon, frozen=True):
    capacity: int = 4
    """Requests one reward worker takes at once."""
    restart: Restart = "on-failure"
    """Reward workers are stateless, so they restart by default."""
    functions: list[RewardFunction] = []
    """Scoring functions, combined by weight (``[[reward.functions]]``). None: each item is
    scored by the built-in its ``data_source`` names (the task's scorer, verl's defaults)."""
    timeout_s: float = 15.0
    """Per call of a function in a child: past it the child is killed, the item scores 0.0."""
    memory_mb: int = 2048
    """Address-space limit (RLIMIT_AS) of each scoring child in MiB (0: none)."""
    cpu_s: int = 60
    """CPU seconds one call may use in its child (RLIMIT_CPU, re-armed per call; 0: none)."""
    processes: int = 4
    """Scoring child processes per worker (calls run in parallel up to this)."""
    overlong_buffer_len: int = 0
    """DAPO overlong penalty: tokens before max_response_length where it starts (0: off)."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong penalty at max_response_length (it falls linearly from 0 to -factor)."""
    max_response_length: int = 0
    """L_max of the overlong penalty (0: sampler.max_tokens)."""


class ReplayConfig(ActorCommon, frozen=True):
    address: str = "auto"
    """Where samplers and the learner connect (ZeroMQ endpoint, or ``auto``)."""
    capacity: int = 256
    """Most scored groups held at once; admission never lets more be in flight."""
    reuse: int = 1
    """Serve each group in up to this many batches (one per policy version, while it is within
    algorithm.max_staleness of the version that generated it; so at most max_staleness + 1)."""


class LearnerConfig(ActorCommon, frozen=True):
    weights_address: str = "auto"
    """Where samplers poll for new weights (ZeroMQ endpoint, or ``auto``)."""
    total_steps: int = 40
    """Optimizer steps before the job ends."""
    groups_per_step: int = 4
    """Prompts (groups of ``n`` samples) per training step (verl ``data.train_batch_size``)."""
    ppo_mini_batches: int = 1
    """Optimizer updates per batch: the batch is split into this many mini-batches."""
    ppo_epochs: int = 1
    """Passes over the batch per step."""
    micro_batch_size: int = 8
    """Sequences per forward/backward; gradients accumulate over a mini-batch."""
    lr: float = 1e-5
    """AdamW learning rate."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warmup (decays to min_lr_ratio·lr over the run)."""
    warmup_steps: int = 0
    """Optimizer updates of linear warmup from 0."""
    min_lr_ratio: float = 0.0
    """linear/cosine: final learning rate as a fraction of lr."""
    critic_lr: float = 1e-5
    """gae: the critic's AdamW learning rate."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    lora: LoraConfig = LoraConfig()
    """Low-rank adapters instead of full fine-tuning."""
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


class SecurityConfig(_Section, frozen=True):
    curve: bool = False
    """Encrypt and authenticate every socket of the job with ZeroMQ CURVE: binding sockets are
    CURVE servers, connecting ones clients, and only the job's own key and authorized keys pass."""
    keys_dir: str = ""
    """Where the runner keeps the job's keypairs (``server``, ``client``; default RUN_DIR/keys)."""
    authorized_keys: str = ""
    """A public key file (``NAME.key``, from ``runner.py keygen NAME``) or a directory of them:
    the clients allowed to attach besides the job's own actors. Re-read at every handshake."""
    server_key: str = ""
    """Set by the runner: the job's CURVE server public key (Z85), which attaching workers use."""


class Topology(_Section, frozen=True):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    sampler: SamplerConfig = SamplerConfig()
    router: RouterConfig = RouterConfig()
    reward: RewardConfig = RewardConfig()
    replay: ReplayConfig = ReplayConfig()
    learner: LearnerConfig = LearnerConfig()
    security: SecurityConfig = SecurityConfig()
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
    need(a.correction.is_cap > 0, "algorithm.correction.is_cap", "must be > 0")
    for i, rule in enumerate(a.correction.rejection):
        need(rule.low is not None or rule.high is not None, f"algorithm.correction.rejection[{i}]",
             "needs a low or a high bound")
        need(rule.low is None or rule.high is None or rule.low <= rule.high,
             f"algorithm.correction.rejection[{i}]", "needs low <= high")
        need(not (rule.statistic == "geo_mean" and rule.level == "token"),
             f"algorithm.correction.rejection[{i}].level", "geo_mean is a sequence statistic")
    need(0 <= a.clip_ratio_low < 1, "algorithm.clip_ratio_low", "must be in [0, 1)")
    need(a.clip_ratio_high >= 0, "algorithm.clip_ratio_high", "must be >= 0")
    need(a.clip_ratio_c == 0 or a.clip_ratio_c > 1, "algorithm.clip_ratio_c", "must be > 1 (or 0: off)")
    need(0 <= a.gamma <= 1, "algorithm.gamma", "must be in [0, 1]")
    need(0 <= a.lam <= 1, "algorithm.lam", "must be in [0, 1]")
    need(a.entropy_coeff >= 0, "algorithm.entropy_coeff", "must be >= 0")
    need(a.kl_ctrl.horizon >= 1, "algorithm.kl_ctrl.horizon", "must be >= 1")
    need(a.kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl", "must be > 0")
    need(a.adv_estimator not in ("grpo", "rloo", "opo", "grpo_passk", "dr_grpo") or a.n >= 2
         or a.adv_estimator == "grpo", "algorithm.n", f"{a.adv_estimator} needs groups of >= 2")
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
    need(L.ppo_epochs >= 1, "learner.ppo_epochs", "must be >= 1")
    need(1 <= L.ppo_mini_batches <= L.groups_per_step, "learner.ppo_mini_batches",
         f"must be in [1, groups_per_step = {L.groups_per_step}] (mini-batches hold whole groups)")
    need(L.warmup_steps >= 0, "learner.warmup_steps", "must be >= 0")
    need(0 <= L.min_lr_ratio <= 1, "learner.min_lr_ratio", "must be in [0, 1]")
    need(L.lora.rank >= 0, "learner.lora.rank", "must be >= 0")
    need(L.save_every >= 1, "learner.save_every", "must be >= 1")
    need(L.keep_checkpoints >= 1, "learner.keep_checkpoints", "must be >= 1")
    # the two stateful actors resume together or not at all: the replay buffer rebuilds itself as
    # of the learner's checkpoint, which only holds when both start from it
    for kind in ("replay", "learner"):
        need(getattr(topology, kind).restart == "never", f"{kind}.restart",
             "must be \"never\": restarted alone it would not match the other's state; when it "
             "dies the job stops, and starting it again with the same run.dir resumes exactly")
    need(topology.replay.capacity >= L.groups_per_step, "replay.capacity",
         f"must hold at least one batch (learner.groups_per_step = {L.groups_per_step})")
    R = topology.reward
    need(R.capacity >= 1, "reward.capacity", "must be >= 1")
    for i, fn in enumerate(R.functions):
        key = f"reward.functions[{i}]"
        if fn.builtin == "reward_model":
            need(bool(fn.path), f"{key}.path", "reward_model needs the checkpoint's directory")
            problem = _reward_model_problem(Path(fn.path))
            need(problem is None, f"{key}.path", str(problem))
            need(fn.batch_size >= 1, f"{key}.batch_size", "must be >= 1")
            need(fn.max_length >= 1, f"{key}.max_length", "must be >= 1")
            need(math.isfinite(fn.reward_mean), f"{key}.reward_mean", "must be finite")
            need(math.isfinite(fn.reward_std) and fn.reward_std > 0, f"{key}.reward_std",
                 "must be > 0")
            need(not fn.batch, f"{key}.batch", "reward_model batches by batch_size")
            continue
        need(bool(fn.builtin) != bool(fn.path), key, "set either builtin or path (one of them)")
        need(not fn.builtin or fn.builtin in BUILTIN_SCORERS, f"{key}.builtin",
             f"{fn.builtin!r} is not one of {', '.join(BUILTIN_SCORERS)}")
        need(not (fn.builtin and fn.batch), f"{key}.batch", "built-ins score one item per call")
        need(not fn.path or Path(fn.path).is_file(), f"{key}.path", f"no file {fn.path!r}")
        need(fn.name.isidentifier(), f"{key}.name", f"{fn.name!r} is not a Python name")
        need(math.isfinite(fn.weight), f"{key}.weight", "must be finite")
    need(R.timeout_s > 0, "reward.timeout_s", "must be > 0")
    need(R.memory_mb == 0 or R.memory_mb >= 128, "reward.memory_mb",
         "must be >= 128 (a Python child needs that much address space) or 0 (no limit)")
    need(R.cpu_s >= 0, "reward.cpu_s", "must be >= 0")
    need(R.processes >= 1, "reward.processes", "must be >= 1")
    need(R.overlong_buffer_len >= 0, "reward.overlong_buffer_len", "must be >= 0")
    need(R.overlong_penalty_factor >= 0, "reward.overlong_penalty_factor", "must be >= 0")
    need(R.max_response_length >= 0, "reward.max_response_length", "must be >= 0")
    max_length = R.max_response_length or s.max_tokens
    need(R.overlong_buffer_len <= max_length, "reward.overlong_buffer_len",
         f"must be <= the response length limit ({max_length})")
    need(topology.task.size >= 1, "task.size", "must be >= 1")
    T = topology.task
    need(T.name in BUILTIN_TASKS, "task.name", f"{T.name!r} is not one of {', '.join(BUILTIN_TASKS)}")
    need(T.max_prompt_length >= 0, "task.max_prompt_length", "must be >= 0 (0: no limit)")
    _check_datasets(T.datasets, need)
    F = a.filter_groups
    need(not F.enable or a.n >= 2, "algorithm.filter_groups.enable",
         "needs algorithm.n >= 2 (a group of one always has equal rewards)")
    need(F.max_num_gen_batches >= 0, "algorithm.filter_groups.max_num_gen_batches",
         "must be >= 0 (0: no limit)")
    reuse = topology.replay.reuse
    need(reuse >= 1, "replay.reuse", "must be >= 1 (1: each group is served once)")
    need(reuse <= a.max_staleness + 1, "replay.reuse",
         f"a group can be served at most once per policy version while it is fresh, so at most "
         f"algorithm.max_staleness + 1 = {a.max_staleness + 1} times; raise max_staleness")
    sec = topology.security
    need(not sec.curve or zmq.has("curve"), "security.curve",
         "this libzmq was built without CURVE support (zmq.has('curve') is False)")
    need(sec.curve or not sec.authorized_keys, "security.authorized_keys",
         "needs security.curve = true")
    need(not sec.server_key or len(sec.server_key) == 40, "security.server_key",
         "must be a 40-character Z85 public key")


def jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a jsonl file, one JSON object per non-blank line; a line that is not one is
    a ``ConfigError`` naming the file and the line."""
    import json

    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}: line {n} is not JSON: {exc}") from None
                if not isinstance(row, dict):
                    raise ConfigError(f"{path}: line {n} is not a JSON object")
                yield row


def _dataset_columns(path: Path) -> set[str]:
    """Top-level column names of a dataset file (parquet schema, or the first jsonl row)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        return set(pq.read_schema(path).names)
    return set(next(jsonl_rows(path), {}))


def _check_datasets(datasets: list[DatasetConfig], need: Any) -> None:
    names: dict[str, int] = {}
    for i, d in enumerate(datasets):
        key = f"task.datasets[{i}]"
        need(bool(d.path) != bool(d.builtin), key, "set either path or builtin (one of them)")
        need(math.isfinite(d.weight) and d.weight > 0, f"{key}.weight", "must be > 0")
        name = d.name or d.builtin or Path(d.path).stem
        need(name not in names, f"{key}.name",
             f"{name!r} is already the name of task.datasets[{names.get(name)}]; name one")
        names[name] = i
        if d.builtin:
            need(d.builtin in BUILTIN_TASKS, f"{key}.builtin",
                 f"{d.builtin!r} is not one of {', '.join(BUILTIN_TASKS)}")
            continue
        path = Path(d.path)
        need(path.suffix in DATASET_SUFFIXES, f"{key}.path",
             f"{d.path!r} is neither .parquet nor .jsonl")
        need(path.is_file(), f"{key}.path", f"no file {d.path!r}")
        try:
            columns = _dataset_columns(path)
        except ConfigError as exc:
            raise ConfigError(f"{key}.path: {exc}") from None
        need(bool(columns), f"{key}.path", f"{d.path!r} holds no rows")
        shown = ", ".join(sorted(columns))
        for field, column in (("prompt_key", d.prompt_key), ("answer_key", d.answer_key)):
            need(column.split(".")[0] in columns, f"{key}.{field}",
                 f"no column {column.split('.')[0]!r} in {d.path!r} (columns: {shown})")
        need(bool(d.data_source) or "data_source" in columns, f"{key}.data_source",
             f"{d.path!r} has no data_source column (columns: {shown}); set data_source")


def _reward_model_problem(path: Path) -> str | None:
    """What keeps ``path`` from being a one-label sequence-classification checkpoint (read from
    its config.json, so the check needs no torch), or None."""
    config = path / "config.json"
    if not config.is_file():
        return f"{str(path)!r} is not a Hugging Face model directory (no config.json)"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        return f"{config} is not readable JSON: {exc}"
    architectures = data.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return (f"{str(path)!r} holds {', '.join(map(str, architectures)) or 'no architecture'}, "
                "not a ...ForSequenceClassification reward model")
    labels = len(data.get("id2label") or {}) or data.get("num_labels", 2)
    if labels != 1:
        return f"{str(path)!r} has {labels} labels; a reward model has one (its logit is the score)"
    return None


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
    return _absolute_paths(topology)


def _absolute_paths(topology: Topology) -> Topology:
    """Reward function files, dataset files and key paths are named relative to where the job is
    started; the actors run elsewhere (and read the resolved topology), so the paths are made
    absolute here."""
    R, T, sec = topology.reward, topology.task, topology.security
    functions = [msgspec.structs.replace(fn, path=_absolute(fn.path)) for fn in R.functions]
    datasets = [msgspec.structs.replace(d, path=_absolute(d.path)) for d in T.datasets]
    return msgspec.structs.replace(
        topology, reward=msgspec.structs.replace(R, functions=functions),
        task=msgspec.structs.replace(T, datasets=datasets),
        security=msgspec.structs.replace(sec, keys_dir=_absolute(sec.keys_dir),
                                         authorized_keys=_absolute(sec.authorized_keys)))


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
    return decode_topology(apply_overrides(data, list(overrides)))
