"""The typed topology: every section of ``topology.toml`` as a msgspec Struct.

Unknown keys are rejected when a topology is decoded (``actors.runtime.config.load``), and every
field has a one-line docstring below it. The checks that need more than one field live in
``actors.runtime.config.checks``.
"""

from __future__ import annotations

from typing import Literal

from actors.registry import BY_NAME, Restart
from actors.runtime.config.placement import LearnerPlacement, SamplerPlacement
from actors.runtime.config.schema_base import ActorCommon, _Section


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
                       "reinforce_plus_plus_baseline", "remax", "gae", "opo", "grpo_passk", "gpg",
                       "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo"]
OPTIMAL_TOKEN_BASELINES = ("optimal_token_baseline", "tir_optimal_token_baseline")
PolicyLoss = Literal["vanilla", "gspo", "reinforce", "gpg", "cispo", "sapo", "geo_mean",
                     "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro", "bypass_mode"]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                 "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]


class RejectionRule(_Section, frozen=True):
    statistic: Literal["ratio", "geo_mean", "k1", "k2", "k3"]
    """What is bounded: the IS ratio, its per-sequence geometric mean, or a KL statistic of it."""
    level: Literal["token", "sequence"] = "sequence"
    """Mask single tokens, or every token of a sequence whose statistic is out of bounds."""
    low: float | None = None
    """Lower bound, kept when statistic >= low (none: unbounded below; k1 can be negative)."""
    high: float | None = None
    """Upper bound, kept when statistic <= high (none: unbounded above)."""
    reduce: Literal["mean", "sum", "max"] = "mean"
    """Sequence level, k1/k2/k3: how the token statistics of a sequence become its statistic
    (verl ``seq_mean_k*``, ``seq_sum_k*``, ``seq_max_k*``)."""


class CorrectionConfig(_Section, frozen=True):
    mode: Literal["decoupled", "bypass"] = "decoupled"
    """decoupled: proximal log-probs recomputed, PPO on π_θ/π_old, tokens weighted by π_old/μ;
    bypass (verl ``rollout_correction.bypass_mode``): the sampler's behaviour log-probs are the
    PPO old log-probs (no recompute). The IS and rejection options below act in bypass mode only
    with ``algorithm.policy_loss = "bypass_mode"``, which applies them to π_θ/μ in the loss."""
    is_level: Literal["token", "sequence", "none"] = "token"
    """Truncated importance weight min(π_old/μ, is_cap) per token, per sequence, or none
    (verl ``rollout_is``)."""
    is_cap: float = 2.0
    """Cap of the truncated importance weight (verl ``rollout_is_threshold``: verl 2.0, AReaL
    5.0, TRL 3.0)."""
    is_low: float | None = None
    """IcePop band: weights outside [is_low, is_cap] become 0 instead of being capped (verl
    ``rollout_is_threshold = "is_low_is_cap"``); none: truncated IS."""
    normalize_weights: bool = False
    """Rescale the importance weights of a batch to mean 1 (verl ``rollout_is_batch_normalize``)."""
    rejection: list[RejectionRule] = []
    """Masked IS / rejection rules (IcePop, verl rollout_rs); a token is kept only if all keep it."""
    rollout_rs: str = ""
    """verl's rejection options, comma-separated (``token_k1|k2|k3``, ``seq_sum_k1|k2|k3``,
    ``seq_mean_k1|k2|k3``, ``seq_max_k2|k3``); their rules join ``rejection``. Empty: none."""
    rollout_rs_threshold: str | float = ""
    """verl's thresholds for ``rollout_rs``, one per option or one for all (comma-separated):
    for k1 ``"lower_upper"`` or a number u (meaning ``"1/u_u"``), bounds on 1/ρ = π_behav/π_old
    as verl's code reads them (``"0.5_2.0"`` keeps ρ in [0.5, 2]); for k2/k3 one upper bound."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """``policy_loss = "bypass_mode"``: PPO clip on π_θ/μ (the clipped ratio is the correction;
    IS weights only logged) or REINFORCE weighted by the IS weights of π_θ/μ (verl
    ``rollout_correction.loss_type``)."""


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
    opo, grpo_passk, gpg, optimal_token_baseline, tir_optimal_token_baseline (need π_old's
    forward: decoupled correction), gdpo (needs gdpo_reward_keys)."""
    norm_adv_by_std_in_grpo: bool = True
    """grpo, grpo_passk, gdpo: divide by the group's std (False is Dr.GRPO)."""
    gdpo_reward_keys: list[str] = []
    """gdpo: the reward components, keys of the scorer's result dict (``compute_score``
    returning ``{"score": ..., "format_reward": ...}``; with several ``[[reward.functions]]``,
    each function's label holds its score), each normalised within its group on its own."""
    gdpo_reward_weights: list[float] = []
    """gdpo: one weight per key in gdpo_reward_keys (empty: all 1.0)."""
    gamma: float = 1.0
    """Discount for reinforce_plus_plus, remax and gae."""
    lam: float = 1.0
    """GAE λ."""
    n: int = 8
    """Completions sampled per prompt (the group size; verl ``rollout.n``)."""
    policy_loss: PolicyLoss = "vanilla"
    """vanilla (PPO clip), gspo (sequence ratio), reinforce (alias gpg), cispo, sapo, geo_mean
    (GMPO), clip_cov, kl_cov, dppo_tv, dppo_kl, dro (needs dro_beta), bypass_mode (needs
    correction.mode = "bypass")."""
    clip_ratio_low: float = 0.2
    """PPO clip ε_low (geo_mean: a log-ratio range, GMPO uses 0.4; dppo_*: the divergence
    threshold for negative advantages)."""
    clip_ratio_high: float = 0.2
    """PPO clip ε_high (> ε_low is DAPO clip-higher; geo_mean, dppo_*: as clip_ratio_low)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant c > 1 for negative advantages (0 disables); dppo_*: the cap of the
    truncated ratio (0: verl's fallback 20)."""
    tau_pos: float = 1.0
    """sapo: temperature of the gate for positive advantages (verl ``actor.tau_pos``)."""
    tau_neg: float = 1.05
    """sapo: temperature of the gate for negative advantages (verl ``actor.tau_neg``)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: share of tokens whose gradient is dropped (verl ``policy_loss.clip_cov_ratio``)."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance of the tokens that may be dropped."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of that covariance."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: share of tokens that get the KL penalty (verl ``policy_loss.kl_cov_ratio``)."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of that penalty |lp − lp_old| (verl ``policy_loss.ppo_kl_coef``)."""
    dro_beta: float | None = None
    """dro: coefficient of the quadratic penalty on lp − lp_old (verl ``policy_loss.dro_beta``;
    no default, required with dro)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses are reduced (verl names), over the whole mini-batch (token-sum: no
    normaliser, the loss grows with the token count)."""
    loss_scale_factor: float = 0.0
    """seq-mean-token-sum-norm: the constant to divide by (0: sampler.max_tokens)."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss −= entropy_coeff·H."""
    use_kl_loss: bool = False
    """Add kl_loss_coef·KL(π_θ‖π_ref) to the loss, against the frozen initial model."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: KLType = "low_var_kl"
    """KL estimator of the loss term (``k3+`` etc.: that value with the gradient of k2)."""
    use_kl_in_reward: bool = False
    """Subtract β·KL(π_old‖π_ref) per token from the reward."""
    kl_penalty: KLType = "kl"
    """KL estimator of the in-reward penalty (a ``+`` kind is its base kind here: no gradient)."""
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


class SamplerConfig(SamplerPlacement, frozen=True):
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
    score_timeout_s: float = 0.0
    """Seconds a group's scoring request may go unanswered before it is sent again (0: the
    router's request_timeout plus reward.timeout_s plus 10 s, so the router's own failover to
    another worker comes first)."""
    score_attempts: int = 3
    """Sends of a scoring request before its group is given up: recorded and dropped as
    ``score_failed``, never waited on forever."""
    restart: Restart = BY_NAME["sampler"].restart
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
    restart: Restart = BY_NAME["reward"].restart
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


class LearnerConfig(LearnerPlacement, frozen=True):
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


class ConfigError(ValueError):
    """A topology that cannot be used; the message names the offending key path."""
