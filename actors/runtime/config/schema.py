"""The typed topology: every section of ``topology.toml`` as a msgspec Struct.

Unknown keys are rejected when a topology is decoded (``actors.job.config.load``), and every
field has a one-line docstring below it. The checks that need more than one field live in
``actors.job.config.checks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from actors.runtime.config.agent import AgentConfig
from actors.runtime.config.algorithm import AlgorithmConfig
from actors.runtime.config.constraints import (
    Decay,
    FilePath,
    Finite,
    Fraction,
    ModelPath,
    NonNegFinite,
    NonNegFloat,
    NonNegInt,
    PositiveFinite,
    PositiveFloat,
    PositiveInt,
    PythonName,
    Share,
    matching,
    one_of,
)
from actors.runtime.config.engines import EngineChoice, HFOptions, VLLMOptions
from actors.runtime.config.estimators import ROWS as ESTIMATORS
from actors.runtime.config.gpus import PlacedProcess
from actors.runtime.config.placement import LearnerPlacement, SamplerPlacement
from actors.runtime.config.pools import JudgeConfig, RewardModelConfig, check_models
from actors.runtime.config.ray import RayOptions
from actors.runtime.config.schema_base import (
    ActorCommon,
    ConfigError,
    Restart,
    _Section,
    need,
    need_child_memory,
)
from actors.runtime.config.sources import ReasoningGymSource, VerifiersSource
from actors.runtime.config.teacher import TeacherConfig
from actors.runtime.transports.table import TransportChoice


class RunConfig(_Section, frozen=True):
    dir: str = "runs/{time}"
    """Run directory (metrics.jsonl, checkpoints, logs). ``{time}`` becomes a timestamp."""
    seed: NonNegInt = 0
    """Seed for dataset order, sampling and initialisation."""
    status_interval: NonNegFinite = 15.0
    """Seconds between the runner's ``status`` records in status.jsonl (every actor's last
    status; 0: none besides the per-step ones)."""
    heartbeat_interval: PositiveFinite = 2.0
    """Seconds between actor heartbeats to the runner."""
    heartbeat_timeout: PositiveFinite = 120.0
    """An actor silent for this long is treated as dead."""
    socket_dir: str = ""
    """Directory for ipc:// sockets of ``auto`` addresses (default: a fresh folder under /tmp)."""
    record: bool = True
    """Record prompts, groups, fates, batches and metrics to RUN_DIR/record (crash resume needs it)."""
    host: str = ""
    """With ``[hosts]``: the host this runner starts the actors of (``runner.py ... --host NAME``)."""
    base_port: PositiveInt = 27100
    """With ``[hosts]``: ``auto`` addresses become ``tcp://HOST:base_port+k`` (k fixed per socket,
    runner control ports base_port+10+i for the i-th host), the same on every host. Below
    Linux's ephemeral range (32768-60999 by default), so no outgoing connection on a host can
    hold one of the job's ports before its actor binds it."""
    host_wait_s: PositiveFloat = 300.0
    """With ``[hosts]``: how long a runner waits for the actors (or runner) of other hosts."""
    loggers: tuple[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"], ...] = (
        "console", "jsonl")
    """Where every metric of every step and of every validation goes (verl ``trainer.logger``):
    ``console`` (a live panel on a terminal, one line per step otherwise), ``jsonl``
    (RUN_DIR/metrics.jsonl and validation.jsonl), ``tensorboard`` (RUN_DIR/tensorboard),
    ``wandb`` (WANDB_* variables apply; ``WANDB_MODE=offline`` needs no network), ``mlflow``
    (MLFLOW_TRACKING_URI, default a file store in RUN_DIR/mlruns)."""
    image_samples: NonNegInt = 4
    """A vision-language model: how many of a step's samples (one per prompt, prompts with
    images) tensorboard and wandb show as images with their answers and rewards (0: none)."""
    image_interval: PositiveInt = 10
    """Steps between two such sets of images (the first at this step)."""
    project_name: str = "flowrl"
    """The wandb project and the mlflow experiment (verl ``trainer.project_name``)."""
    experiment_name: str = ""
    """The tracker run's name (verl ``trainer.experiment_name``; default: the run directory's)."""
    launcher: Literal["local", "ray"] = "local"
    """What starts the actor processes (a row of ``actors/job/launchers/table.py``): this runner
    (``local``: on this machine, or on this host of ``[hosts]``), or Ray (``ray``: the runner
    is a Ray driver that reserves the job's resources and starts each process on its node;
    ``[ray]`` says which cluster; ``runner.py topology.toml --ray [ADDRESS]`` sets both)."""

    deterministic: bool = False
    """A fixed schedule (actors/replay/schedule.py): two runs of one topology and seed on one
    machine record the same groups and metrics bit for bit, across restarts and resumes too;
    step k's groups are one batch generated with version max(0, k - 1 - max_staleness)."""

    def __post_init__(self) -> None:
        need(len(set(self.loggers)) == len(self.loggers), "loggers", "names a logger twice")


class ModelConfig(_Section, frozen=True):
    path: ModelPath = "default"
    """Local Hugging Face model directory, or ``default`` for the embedded SmolLM2-135M-Instruct."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for sampling and training (float32 is the fast choice on CPUs)."""
    freeze_vision: bool = False
    """A vision-language model: train its language model only, the vision tower (and its
    merger) frozen. Off by default, as in verl and TRL: a reward that depends on what the image
    shows may need the tower to learn to see it; on, it saves the tower's gradients and
    optimizer state (prime-rl's default)."""


BUILTIN_TASKS = ("arithmetic", "repeat_letter", "calculator")
DatasetPath = Annotated[FilePath, matching(r"(?:.*[^/]\.(?:parquet|jsonl))?",
                                           "is neither .parquet nor .jsonl",
                                           "a .parquet or .jsonl file, or unset")]


class DatasetConfig(_Section, frozen=True):
    path: DatasetPath = ""
    """A parquet or jsonl file of prompts (relative to where the runner is started), in verl's
    row layout: ``prompt`` (list of chat messages), ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``. Set this or ``builtin``."""
    builtin: Annotated[str, one_of(BUILTIN_TASKS, unset=True)] = ""
    """A built-in task instead of a file (``arithmetic``, ``repeat_letter``, ``calculator``;
    task.size, task.max_operand and task.system_prompt apply)."""
    weight: PositiveFinite = 1.0
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
    image_key: str = ""
    """Column of a row's images, for a vision-language model: a list (or, TRL's ``image``, one)
    of ``{bytes}`` / ``{path}`` records (verl's ``images`` as its geometry3k preprocessing
    writes them) or paths, relative to the data file's folder. Default: ``images``, else
    ``image``, when the file has such a column; ``<image>`` in the prompt's text marks where
    each goes (none: all before the first user message's text, as TRL puts them)."""

    reasoning_gym: ReasoningGymSource | None = None
    """A reasoning-gym generator instead of a file (``reasoning_gym = { name = "leg_counting" }``):
    its questions as user messages, its own scorer as the reward (data_source
    ``reasoning_gym/NAME``)."""

    verifiers: VerifiersSource | None = None
    """A verifiers environment instead of a file (``verifiers = { id = "my_env" }`` or
    ``{ path = "my_env.py", args = { ... } }``): its tasks' prompts, its rubric as the reward
    (data_source ``verifiers/NAME``); a multi-turn one (its ``Env`` plays the turns) needs
    ``agent.env.verifiers``."""

    def __post_init__(self) -> None:
        if sum(map(bool, (self.path, self.builtin, self.reasoning_gym, self.verifiers))) != 1:
            raise ConfigError("set one of path, builtin, reasoning_gym or verifiers")

    @property
    def label(self) -> str:
        """Its name in the recording: ``name``, else the built-in's, the reasoning-gym
        generator's or the file's stem."""
        return (self.name or self.builtin or (self.reasoning_gym and self.reasoning_gym.name)
                or (self.verifiers and (self.verifiers.id or Path(self.verifiers.path).stem))
                or Path(self.path).stem)


def _unique_names(datasets: Sequence[DatasetConfig], where: str) -> None:
    """Each dataset of a list has its own name (``where``: the list's key path)."""
    names: dict[str, int] = {}
    for i, d in enumerate(datasets):
        need(d.label not in names, f"datasets[{i}].name",
             f"{d.label!r} is already the name of {where}[{names.get(d.label)}]; name one")
        names[d.label] = i


class TaskConfig(_Section, frozen=True):
    name: Annotated[str, one_of(BUILTIN_TASKS)] = "arithmetic"
    """Built-in task (``arithmetic``, ``repeat_letter``, ``calculator``: multi-digit arithmetic
    for the calculator tool); not used when ``datasets`` is set."""
    datasets: list[DatasetConfig] = []
    """Prompt sources mixed by weight (``[[task.datasets]]``): the source of the i-th prompt
    drawn is a function of run.seed and i alone, so a run's data order is reproducible."""
    max_prompt_length: NonNegInt = 0
    """Skip prompts longer than this many chat-templated tokens of the model's tokenizer (verl
    ``data.max_prompt_length``; 0: no limit). Skipped prompts are counted, never issued."""
    size: PositiveInt = 100_000
    """Number of distinct prompts the task generates."""
    max_operand: PositiveInt = 9
    """arithmetic: operands are drawn from 1..max_operand."""
    system_prompt: str = ""
    """Override the task's system prompt (empty: the task's own)."""

    def __post_init__(self) -> None:
        _unique_names(self.datasets, "task.datasets")


class LoraConfig(_Section, frozen=True):
    rank: NonNegInt = 0
    """LoRA rank (0 trains all weights). Samplers receive the adapters alone, each version
    applied to the base they started with; checkpoints are PEFT adapters."""
    alpha: PositiveFinite = 16.0
    """LoRA scaling α."""
    dropout: Fraction = 0.0
    """LoRA dropout."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                       "up_proj", "down_proj")
    """Module names that get adapters (in a vision-language model, its language model's)."""
    vision: bool = False
    """A vision-language model: put adapters on every linear layer of its vision tower too
    (attention, MLP, merger). Off, the tower keeps its base weights: adapters on the language
    model alone, what vLLM serves without its tower LoRA (``enable_tower_connector_lora``, which
    the vllm engine turns on with this)."""

    def __post_init__(self) -> None:
        if self.rank == 0:
            return
        need(bool(self.target_modules), "target_modules", "must name a module")
        # the learner's log-probs take the LM head's weight itself (kernels.lm_head_logprobs): an
        # adapter there would never train; embedding adapters have no publish path (nor vLLM's)
        cannot = sorted(set(self.target_modules) & {"lm_head", "embed_tokens"})
        need(not cannot, "target_modules",
             f"{cannot}: adapters on the LM head and embeddings are not supported (the learner's "
             "log-probs read the LM head's weight directly)")


class SamplerConfig(SamplerPlacement, frozen=True):
    engine: EngineChoice = "auto"
    """What generates (a row of ``actors/runtime/config/engines.py``): vllm (vLLM's AsyncLLM: continuous batching, weights loaded in flight),
    hf (transformers generate, one batch at a time), or auto: vllm when the sampler has a GPU
    and vLLM is installed, hf otherwise (hf is the faster on a CPU: BENCHMARKS.md)."""
    vllm: VLLMOptions = VLLMOptions()
    """vLLM's engine arguments (sampler.engine = vllm)."""
    hf: HFOptions = HFOptions()
    """The transformers engine's options (sampler.engine = hf)."""
    profile_batches: list[PositiveInt] = []
    """hf: batches of each sampler to run under torch.profiler (1: its first generate call):
    each writes RUN_DIR/profiles/sampler-I/step_N.txt and step_N.trace.json, as
    learner.profile_steps does (vllm: vLLM's own profiler, VLLM_TORCH_PROFILER_DIR)."""
    weight_update: Literal["between_batches", "in_flight"] = "between_batches"
    """When new weights go into the engine: once the requests in it have finished, or at once,
    pausing generation and keeping its requests (vllm only): tokens after the swap carry the
    new version, so one sample can span two."""
    clear_cache: bool = True
    """in_flight: drop the KV cache computed with the old weights at a swap (the kept requests
    recompute it); false keeps it (faster; later tokens then attend to old-weight keys)."""
    sleep_idle_s: NonNegFloat = 0.0
    """vllm on a GPU shared with the learner: put the engine to sleep (vLLM sleep level 1:
    weights to host memory, KV cache freed) once it has had no request for this many seconds;
    what it frees is lent to the learner, whose allocator may use it for the steps it takes
    meanwhile. It wakes for the next generation or weights load, once the learner has given the
    memory back at the end of its step (0: never sleeps; vLLM's CPU build has no sleep mode)."""
    max_concurrent_prompts: NonNegInt = 0
    """Most prompts in a continuous engine at once (each with its n completions); a group goes
    to scoring as soon as its own completions are done (0: 8 on a CPU, 64 on a GPU)."""
    prompts_per_request: PositiveInt = 4
    """Prompts a sampler asks for (and generates) per batch."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (the learner computes log-probs at the same temperature)."""
    top_p: Share = 1.0
    """Nucleus sampling mass."""
    top_k: NonNegInt = 0
    """Top-k sampling (0 disables)."""
    max_tokens: PositiveInt = 32
    """Maximum response tokens."""
    stop: list[str] = []
    """Extra stop strings (EOS always stops)."""
    score_timeout_s: NonNegFloat = 0.0
    """Seconds a group's scoring request may go unanswered before it is sent again (0: the
    router's request_timeout plus reward.timeout_s plus 10 s, so the router's own failover to
    another worker comes first)."""
    score_attempts: PositiveInt = 3
    """Sends of a scoring request before its group is given up: recorded and dropped as
    ``score_failed``, never waited on forever."""
    restart: Restart = "on-failure"
    """Samplers hold no state worth keeping, so they restart by default."""
    drain_grace_s: NonNegFloat = 20.0
    """On SIGTERM or Ctrl-C (a detach, or a spot machine's notice) a sampler takes no more
    prompts, finishes what it holds for at most this many seconds, then hands the rest back to
    the replay buffer (issued again to the others) and exits; a second signal ends it at once."""


class RouterConfig(ActorCommon, frozen=True):
    address: str = "auto"
    """Where samplers send scoring requests (ZeroMQ endpoint, or ``auto``)."""
    worker_address: str = "auto"
    """Where reward workers connect (ZeroMQ endpoint, or ``auto``)."""
    request_timeout: PositiveFinite = 60.0
    """Seconds before a request in flight at a worker is re-sent elsewhere."""


BUILTIN_SCORERS = ("gsm8k", "math", "exact_match", "answer_tag", "arithmetic", "repeat_letter",
                   "calculator", "reasoning_gym", "verifiers")  # the rules of actors/scoring/rules.py (BUILTINS), by name


class RewardFunction(_Section, frozen=True):
    builtin: Annotated[str, one_of(BUILTIN_SCORERS, unset=True)] = ""
    """A built-in rule (gsm8k, math, exact_match, answer_tag, arithmetic, repeat_letter,
    calculator, reasoning_gym: the generator's own scorer, verifiers: the environment's rubric);
    set this or ``path``."""
    path: FilePath = ""
    """A Python file (relative to where the runner is started) holding a verl-style scoring
    function, which runs in a child process."""
    name: PythonName = "compute_score"
    """The function in ``path``: ``(data_source, solution_str, ground_truth, extra_info)`` ->
    float or dict(score=..., **numeric extras); ``async def`` works too."""
    weight: Finite = 1.0
    """This function's weight in the item's reward (the weighted sum over functions)."""
    batch: bool = False
    """``path`` function takes lists (``data_sources, solution_strs, ground_truths,
    extra_infos``) for a whole request and returns a list."""
    kwargs: dict[str, str | int | float | bool] = {}
    """Extra keyword arguments for every call (gsm8k: method, format_score; answer_tag:
    format_score)."""

    def __post_init__(self) -> None:
        if bool(self.builtin) == bool(self.path):
            raise ConfigError("set either builtin or path (one of them)")
        need(not (self.builtin and self.batch), "batch", "built-ins score one item per call")


class RewardConfig(ActorCommon, frozen=True):
    capacity: PositiveInt = 4
    """Requests one reward worker takes at once."""
    restart: Restart = "on-failure"
    """Reward workers are stateless, so they restart by default."""
    functions: list[RewardFunction] = []
    """Scoring functions, combined by weight (``[[reward.functions]]``). None: each item is
    scored by the built-in its ``data_source`` names (the task's scorer, verl's defaults)."""
    timeout_s: PositiveFloat = 15.0
    """Per call of a function in a child: past it the child is killed, the item scores 0.0."""
    memory_mb: NonNegInt = 2048
    """Address-space limit (RLIMIT_AS) of each scoring child in MiB (0: none)."""
    cpu_s: NonNegInt = 60
    """CPU seconds one call may use in its child (RLIMIT_CPU, re-armed per call; 0: none)."""
    processes: PositiveInt = 4
    """Scoring child processes per worker (calls run in parallel up to this)."""
    overlong_buffer_len: NonNegInt = 0
    """DAPO overlong penalty: tokens before max_response_length where it starts (0: off)."""
    overlong_penalty_factor: NonNegFloat = 1.0
    """DAPO overlong penalty at max_response_length (it falls linearly from 0 to -factor)."""
    max_response_length: NonNegInt = 0
    """L_max of the overlong penalty (0: sampler.max_tokens)."""
    max_error_share: Fraction = 0.5
    """The job stops when scoring failed (an exception, a bad value, a timeout, a crash) on more
    than this share of a step's samples, or of a validation round's; below it the failures are
    counted (``replay/score_errors``) and shown. 0.5: a systematic bug stops the first step, one
    flaky item in 100 never does (1.0: never stop)."""
    models: list[RewardModelConfig | JudgeConfig] = []
    """Served models (``[[reward.models]]``, by ``kind``: reward models and LLM judges), each a
    pool of its own replicas behind the router; every group is scored by each, weighted
    (config/pools.py)."""
    rules: bool = True
    """Score with the rule workers (``functions``, or the data source's built-in) too; false:
    only the served models score (then no overlong penalty, which the rule workers add)."""

    def __post_init__(self) -> None:
        need_child_memory(self.memory_mb)
        check_models(self.models)
        need(self.rules or bool(self.models), "rules",
             "false needs at least one [[reward.models]] to score with")


def _never_restarted(restart: str) -> None:
    """The replay buffer's and the learner's ``restart``: the two stateful actors resume
    together or not at all (the replay buffer rebuilds itself as of the learner's checkpoint,
    which only holds when both start from it)."""
    need(restart == "never", "restart",
         "must be \"never\": restarted alone it would not match the other's state; when it "
         "dies the job stops, and starting it again with the same run.dir resumes exactly")


class ReplayConfig(ActorCommon, frozen=True):
    address: str = "auto"
    """Where samplers and the learner connect (ZeroMQ endpoint, or ``auto``)."""
    capacity: NonNegInt = 256
    """Most scored groups held at once; admission never lets more be in flight."""
    reuse: PositiveInt = 1
    """Serve each group in up to this many batches (one per policy version, while it is within
    algorithm.max_staleness of the version that generated it; so at most max_staleness + 1)."""
    sampler_timeout_s: NonNegFloat = 60.0
    """A sampler silent this long (no request, group or keep-alive: its process hangs or its
    host is cut off) loses its prompts in flight: they are issued again (0: only on restart)."""

    def __post_init__(self) -> None:
        _never_restarted(self.restart)


class LearnerConfig(LearnerPlacement, frozen=True):
    weights_address: str = "auto"
    """Where samplers poll for new weights (ZeroMQ endpoint, or ``auto``)."""
    weights_transport: TransportChoice = "auto"
    """How weights travel (a row of ``actors/runtime/transports/table.py``): zmq (the tensors in
    the message), shm (a safetensors file in /dev/shm, only its path in the message: samplers on
    the same host), nccl (GPU to GPU, a broadcast group per sampler), ipc (CUDA IPC on one
    host), or auto (shm when weights_address is ipc://, or auto without [hosts]; zmq else;
    ipc for the hf engine when the learner and every sampler compute on one GPU)."""
    share_threads: bool = True
    """On a CPU, share threads with the samplers of this host: compute also on the threads a
    sampler lends while it has nothing to generate, and lend the learner's own while it waits
    for a batch (a transformers engine takes them). Checked before every layer, so a lender has
    its threads back within one layer of work (actors/runtime/cores.py)."""
    total_steps: PositiveInt = 40
    """Optimizer steps before the job ends."""
    groups_per_step: PositiveInt = 4
    """Prompts (groups of ``n`` samples) per training step (verl ``data.train_batch_size``)."""
    ppo_mini_batches: PositiveInt = 1
    """Optimizer updates per batch: the batch is split into this many mini-batches."""
    ppo_epochs: PositiveInt = 1
    """Passes over the batch per step."""
    micro_batch_size: PositiveInt | Literal["auto"] = "auto"
    """Most sequences per forward/backward; gradients accumulate over a mini-batch. auto: with
    packing no cap, the token budget alone decides (verl's dynamic batch size): few large
    launches keep a GPU busy, and few micro-batches dispatch few ops (BENCHMARKS.md); 8 in the
    padded layout."""
    max_tokens_per_micro_batch: NonNegInt | Literal["auto"] = "auto"
    """Most tokens (prompt + response, padding not counted) per forward/backward, besides
    micro_batch_size (0: no token budget); a longer sequence is a micro-batch of its own. auto:
    32768 on a GPU; on a CPU as many as save 1 GiB of activations for backward (the default
    job's model: about 700), at most 8192."""
    packing: bool = True
    """Concatenate a micro-batch's sequences into one row without padding (position ids restart
    per sequence); false: right-padded rows, the reference path (same loss and gradients)."""
    share_prefixes: bool = True
    """Packed: a group's rows put the tokens they begin with in common (the prompt) in the row
    once, each row's rest attending to it (actors/learner/packing.py): the same log-probs,
    losses and gradients from fewer tokens. Text models with the flowrl_varlen attention (not
    flash-attention 2, nor images: those pack every row whole)."""
    lr: PositiveFloat = 1e-5
    """AdamW learning rate."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warmup (decays to min_lr_ratio·lr over the run)."""
    warmup_steps: NonNegInt = 0
    """Optimizer updates of linear warmup from 0."""
    min_lr_ratio: Fraction = 0.0
    """linear/cosine: final learning rate as a fraction of lr."""
    critic_lr: PositiveFinite = 1e-5
    """gae: the critic's AdamW learning rate."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute each layer's activations in backward (keep only its input). auto: off on a CPU
    (memory is plentiful there and recomputing costs the cores); on a GPU decided for each
    micro-batch, on only when without it the micro-batch would need more than half of this
    process's share of the GPU's memory (actors/learner/memory.py's estimate)."""
    offload: bool = False
    """FSDP2 CPU offload: parameters, gradients and optimizer state live in host memory and
    each layer is copied to the device when it runs (a 7B model on one 141 GB GPU)."""
    lora: LoraConfig = LoraConfig()
    """Low-rank adapters instead of full fine-tuning."""
    weight_decay: NonNegFinite = 0.0
    """AdamW weight decay."""
    betas: tuple[Decay, Decay] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: PositiveFinite = 1.0
    """Gradient clipping norm."""
    save_every: PositiveInt = 10
    """Checkpoint every K steps (and always at the end)."""
    keep_checkpoints: PositiveInt = 3
    """Most recent checkpoints kept on disk, besides the final one (of ``total_steps``, always
    kept); older ``step_N`` folders are removed once a newer checkpoint is complete."""
    resume: bool = True
    """Continue from the run directory's latest checkpoint when one exists."""
    profile_steps: list[PositiveInt] = []
    """Steps to run under torch.profiler (1: the first step trained), rank 0's: each writes
    RUN_DIR/profiles/learner-0/step_N.txt (ops by CPU and CUDA time) and step_N.trace.json
    (Perfetto, chrome://tracing); docs/debugging.md reads one."""

    def __post_init__(self) -> None:
        need(self.ppo_mini_batches <= self.groups_per_step, "ppo_mini_batches",
             f"must be in [1, groups_per_step = {self.groups_per_step}] (mini-batches hold "
             "whole groups)")
        need(not (self.offload and self.lora.rank > 0), "offload",
             "needs full fine-tuning: LoRA trains unsharded (set learner.lora.rank = 0 or "
             "offload = false)")
        _never_restarted(self.restart)


class ValidationDataset(DatasetConfig, frozen=True):
    size: NonNegInt = 0
    """Prompts taken: the first ``size`` rows in the dataset's order (a file's seeded order with
    ``shuffle``); 0: every row of a file, 64 prompts of a built-in task. ``weight`` is not used:
    every prompt of every validation dataset is validated each time."""


class ValidationConfig(_Section, frozen=True):
    every: NonNegInt = 0
    """Validate every this many learner steps, and after the last one (0: never)."""
    before_training: bool = True
    """Validate the initial policy too (step 0), when ``datasets`` are set."""
    n: PositiveInt = 4
    """Samples per prompt: the N of mean@N, best@N, pass@k (k = 1, 2, 4, ... <= N)."""
    temperature: NonNegFloat | None = None
    """Sampling temperature of validation (default: sampler.temperature)."""
    top_p: Share | None = None
    """Nucleus mass of validation (default: sampler.top_p)."""
    max_tokens: PositiveInt | None = None
    """Response budget of validation (default: sampler.max_tokens)."""
    pass_threshold: Finite = 1.0
    """A sample counts as correct for pass@k when its score is at least this."""
    datasets: list[ValidationDataset] = []
    """Validation prompts (``[[validation.datasets]]``), in the forms of ``task.datasets``: files
    in verl's layout or built-in tasks. Each prompt's ``data_source`` names its metrics:
    ``val-core/{data_source}/reward/mean@N``. Empty: no validation."""

    def __post_init__(self) -> None:
        _unique_names(self.datasets, "validation.datasets")


class SecurityConfig(_Section, frozen=True):
    curve: bool = False
    """Encrypt and authenticate every socket of the job with ZeroMQ CURVE: binding sockets are
    CURVE servers, connecting ones clients, and only the job's own key and authorized keys pass."""
    keys_dir: FilePath = ""
    """Where the runner keeps the job's keypairs (``server``, ``client``; default RUN_DIR/keys)."""
    authorized_keys: FilePath = ""
    """A public key file (``NAME.key``, from ``runner.py keygen NAME``) or a directory of them:
    the clients allowed to attach besides the job's own actors. Re-read at every handshake."""
    server_key: Annotated[str, matching(r"(?s:.{40})?", "is not a 40-character Z85 key")] = ""
    """Set by the runner: the job's CURVE server public key (Z85), which attaching workers use."""
    allow_insecure: bool = False
    """Run a job whose ``[hosts]`` are not all private addresses without CURVE (refused unless
    this is true: anyone who reaches the ports could feed it data)."""

    def __post_init__(self) -> None:
        need(self.curve or not self.authorized_keys, "authorized_keys",
             "needs security.curve = true")


class Topology(_Section, frozen=True):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    sampler: SamplerConfig = SamplerConfig()
    router: RouterConfig = RouterConfig()
    reward: RewardConfig = RewardConfig()
    teacher: TeacherConfig = TeacherConfig()
    replay: ReplayConfig = ReplayConfig()
    learner: LearnerConfig = LearnerConfig()
    security: SecurityConfig = SecurityConfig()
    agent: AgentConfig = AgentConfig()
    validation: ValidationConfig = ValidationConfig()
    ray: RayOptions = RayOptions()
    """The Ray cluster and what each process reserves there (``run.launcher = "ray"``)."""
    hosts: dict[str, str] = {}
    """Host names -> addresses (IP or DNS name) for a job over several machines; each machine
    runs ``runner.py topology.toml --host NAME`` and starts the actors placed on NAME."""
    control_address: str = "auto"
    """Where every actor reports to the runner (ZeroMQ endpoint, or ``auto``)."""
    placement: list[PlacedProcess] = []
    """Filled in by the runner (``actors/runtime/config/gpus.py``): the GPUs and memory share
    of each process it starts; written to topology.json, not set by hand."""

    def __post_init__(self) -> None:
        """What spans sections (a check that looks at the world, files or the machine, is the
        runner's: ``actors/job/config/checks.py``)."""
        L, R, a = self.learner, self.reward, self.algorithm
        need(self.replay.capacity >= L.groups_per_step, "replay.capacity",
             f"must hold at least one batch (learner.groups_per_step = {L.groups_per_step})")
        need(self.replay.reuse <= a.max_staleness + 1, "replay.reuse",
             f"a group can be served at most once per policy version while it is fresh, so at "
             f"most algorithm.max_staleness + 1 = {a.max_staleness + 1} times; raise "
             "max_staleness")
        max_length = R.max_response_length or self.sampler.max_tokens
        need(R.overlong_buffer_len <= max_length, "reward.overlong_buffer_len",
             f"must be <= the response length limit ({max_length})")
        need(not (L.lora.rank > 0 and L.lora.vision and self.model.freeze_vision),
             "learner.lora.vision",
             "adapters on the vision tower would not train with model.freeze_vision = true")
        if self.agent.rollout.path and self.agent.rollout.branches == "train":
            why = "train gives groups of unequal size, which "  # (samples on prompts of their own)
            need(a.adv_estimator.unequal_groups, "agent.rollout.branches",
                 f"{why}{a.adv_estimator.name} cannot take (it normalises over the whole "
                 f"batch); set branches = \"last\" or one of "
                 f"{', '.join(n for n, row in ESTIMATORS.items() if row.unequal_groups)}")
            need(L.nproc_per_node * L.nnodes == 1, "agent.rollout.branches",
                 f"{why}learner ranks cannot share out evenly; set branches = \"last\"")
            need(not self.teacher.path, "agent.rollout.branches",
                 "train gives samples on prompts of their own, which the teacher's request (one "
                 "prompt per group) cannot carry yet; with [teacher] set branches = \"last\"")
