"""``[learner]``: the optimizer, batches, checkpoints and LoRA of the learner (its placement
keys: ``LearnerPlacement``, first)."""

from __future__ import annotations

from typing import Literal

from actors.runtime.config.constraints import (
    Decay,
    Device,
    Fraction,
    NonNegFinite,
    NonNegInt,
    Port,
    PositiveFinite,
    PositiveFloat,
    PositiveInt,
)
from actors.runtime.config.schema_base import ActorCommon, _Section, need, never_restarted
from actors.runtime.transports.table import TransportChoice


# the keys of where it computes (checked by placement.check_placement)
class LearnerPlacement(ActorCommon, frozen=True):
    device: Device = "auto"
    """auto (cuda when a GPU is visible, else cpu), cpu, cuda, or cuda:N (one rank only); with
    several ranks on a node, rank r uses cuda:LOCAL_RANK."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of forward and backward (auto: bfloat16 on a GPU, model.dtype on a CPU).
    When it differs from model.dtype the parameters and optimizer state stay in model.dtype
    (fp32 master weights) and FSDP2 casts for compute, reducing gradients in float32."""
    nproc_per_node: PositiveInt = 1
    """Learner ranks on each node (one per GPU): FSDP2 across them, gloo on CPU, NCCL on GPU."""
    nnodes: PositiveInt = 1
    """Nodes the learner spans: with [hosts] or by hand, a runner on each with its own
    learner.node_rank; under Ray, one runner places every node's ranks."""
    node_rank: NonNegInt = 0
    """This node's index (0 runs the whole job; k > 0 runs only its learner ranks)."""
    master_addr: str = "127.0.0.1"
    """Host of rank 0 (the group's rendezvous); reachable from every node. With [hosts] or
    under Ray this default stands for the address of learner node 0's machine."""
    master_port: Port = 0
    """Rendezvous port on master_addr (0: a free port on one node; run.base_port + 4 with
    [hosts] or under Ray)."""
    reshard_after_forward: bool | None = None
    """FSDP2: free gathered parameters after each forward and reduce gradients after every
    micro-batch (true: least memory), or keep them gathered until backward and reduce once per
    mini-batch (false: fewest copies); unset: true on a GPU, false on a CPU."""
    collective_timeout_s: PositiveFloat = 600.0
    """A collective waiting longer than this fails its rank (and so the job), not hangs it."""
    weights_bucket_mb: PositiveInt = 256
    """Weights are gathered from the shards and sent to samplers in messages of at most this
    many MiB each (one tensor larger than that travels alone)."""
    weights_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the weights sent to samplers (auto: the learner's compute dtype, so bf16 when it
    computes in bf16, as samplers on GPUs do; with LoRA the samplers' dtype, sampler.dtype)."""


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
    """Most tokens through the model (prompt + response but each row's last, padding not
    counted) per forward/backward, besides micro_batch_size (0: no token budget); a longer
    sequence is a micro-batch of its own. With share_prefixes a group is cut only when it alone
    is over the budget (a part that starts inside it holds the prompt again). auto: 32768 on a GPU; on a CPU as many as save 1 GiB of
    activations for backward (the default job's model: about 700), at most 8192, and a group
    of up to twice that kept whole."""
    packing: bool = True
    """Concatenate a micro-batch's sequences into one row without padding (position ids restart
    per sequence); false: right-padded rows, the reference path (same loss and gradients)."""
    share_prefixes: bool = True
    """Packed: a group's rows put the tokens they begin with in common (the prompt) in the row
    once, each row's rest attending to it (actors/learner/packing.py): the same log-probs,
    losses and gradients from fewer tokens, a prompt's images included. Models with the
    flowrl_varlen attention (flash-attention 2 packs every row whole)."""
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
        never_restarted(self.restart)
