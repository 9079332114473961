"""What the learner will hold per rank: a memory estimate from the model's config, printed at start.

Per rank, in bytes, for a model of ``P`` parameters (``P_t`` of them trainable) sharded over
``world`` ranks by FSDP2, parameters and AdamW state in the parameter dtype (``p`` bytes each),
forward and backward in the compute dtype (``c`` bytes):

- parameters ``P·p/world``; gradients ``P_t·p/world``; optimizer ``2·P_t·p/world`` (AdamW's
  ``exp_avg`` and ``exp_avg_sq``). With ``learner.offload`` the three live in host memory
  (FSDP2's ``CPUOffloadPolicy``) and the device holds none of them.
- gathered: FSDP2's compute-dtype copies of gathered parameters (when the model is sharded, or
  computes in another dtype): the whole model when they stay gathered from forward to backward
  (``learner.reshard_after_forward = false``), else two decoder layers (the one running and the
  one prefetched) and the root's embedding and head; plus one layer's unsharded gradients.
- reference: the reference model's parameters (a KL term), sharded like the policy's.
- activations, for ``T`` tokens in a micro-batch (the token budget): per token and layer
  transformers' Llama/Qwen2 layer saves for backward about ``(10h + 2·kv + 4i)·c`` bytes (the
  two RMSNorms' input, normalised and scaled tensors, attention's q, k, v, output and the
  output projection's input, the SwiGLU's gate, up, activation and product; within 10% of the
  tensors autograd saves, ``saved_bytes`` below, which ``tests/test_memory.py`` compares). With
  gradient checkpointing a layer keeps only its input (``h·c``), and one layer is recomputed
  at a time (the first layer's input is the embedding's output); the final norm's ``3h·c``
  per token comes on top.
- a vision-language model's vision tower: its parameters are in ``P``; while it trains, each
  of its blocks saves about ``(12w + 4·i_v)·c`` bytes per patch (the decoder layer's formula
  with ``kv = w``: its attention is not grouped) for the ``patches`` of a micro-batch's images,
  plus the patch embedding's input (``C·T·p²`` pixel values a patch) and the merger's norm and
  MLP inputs (about ``5w``). With gradient checkpointing a block keeps its input (``w·c``) and
  one is recomputed at a time.
  A frozen tower saves nothing (nothing in it needs a gradient). ``runner.py check`` knows no
  images (``patches = 0``); the learner's own estimate at its first step counts them.
- logits: the chunked LM head (``kernels/lm_head_logprobs.py``) holds at most a few
  ``(chunk, V)`` blocks: three float32 ones and one in the compute dtype; a small head (its
  ``(tokens, V)`` float32 probabilities within ``KEEP_BYTES``) also keeps those for backward.

Not counted: the CUDA context and allocator slack (a few GB on a GPU), the samplers, the
critic (GAE), the batch's own tensors, and anything a longer sequence than the budget adds
(such a sequence is a micro-batch of its own).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from actors.learner.packing import keep_whole, micro_limits
from actors.learner.perf import VisionTower, head_dim_of, vision_tower
from actors.runtime.config import auto_dtype
from kernels.lm_head_logprobs import KEEP_BYTES
from messages.tensor import ITEMSIZE

GB = 1e9  # the table's unit (a GPU's "141 GB" is 141e9 bytes)


@dataclass
class MemoryEstimate:
    """Bytes per rank, on the device unless said otherwise."""

    parameters: float
    gradients: float
    optimizer: float
    gathered: float
    reference: float
    activations: float
    logits: float
    host: float  # offloaded parameters, gradients and optimizer state, in host memory

    @property
    def device_total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "host")

    def row(self) -> str:
        cells = [f"{getattr(self, f.name) / GB:7.2f}" for f in fields(self)]
        return " ".join(cells) + f" {self.device_total / GB:8.2f}"


HEADER = ("params   grads   optim  gather     ref    acts  logits    host   device  (GB per rank; "
          "device = all but host)")


def shape(config) -> tuple[int, int, int, int, int, int]:
    """(hidden, kv width, intermediate, layers, vocab, head_dim) of a Llama/Qwen2-like config
    (a vision-language model's language model)."""
    config = config.get_text_config()
    head_dim = head_dim_of(config)
    return (config.hidden_size, config.num_key_value_heads * head_dim, config.intermediate_size,
            config.num_hidden_layers, config.vocab_size, head_dim)


def count_parameters(config) -> tuple[int, int]:
    """(all parameters, one decoder layer's) of the causal LM ``config`` describes, counted on
    the meta device (tied embeddings once; a vision-language model's vision tower included)."""
    from actors.model_store import PolicyModel

    with torch.device("meta"):
        model = PolicyModel.from_config(config)
    layer = model.get_decoder().layers[0]
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() for p in layer.parameters()))


def layer_activation_bytes(config, compute_bytes: int) -> int:
    """What one decoder layer saves for backward, per token (the module docstring's formula)."""
    h, kv, i, *_ = shape(config)
    return (10 * h + 2 * kv + 4 * i) * compute_bytes


def kept_probabilities(tokens: int, vocab: int) -> int:
    """Bytes the LM head keeps from its forward pass for the backward one (a small head's
    float32 probabilities, ``kernels/lm_head_logprobs.py``)."""
    held = tokens * vocab * 4
    return held if held <= KEEP_BYTES else 0


def token_activation_bytes(config, compute_bytes: int) -> int:
    """What one token of a micro-batch saves for backward through every layer and the final
    norm, without checkpointing (``estimate``'s activations per token, images aside)."""
    h, _, _, layers, _, _ = shape(config)
    return layers * layer_activation_bytes(config, compute_bytes) + 3 * h * compute_bytes


def estimate(config, *, tokens: int, world: int = 1, param_bytes: int = 4, compute_bytes: int = 4,
             offload: bool = False, checkpointing: bool = False, keep_gathered: bool = False,
             reference: bool = False, reference_bytes: int | None = None,
             trainable: int | None = None, chunk: int = 1024,
             counts: tuple[int, int] | None = None, patches: int = 0,
             tower: VisionTower | None = None) -> MemoryEstimate:
    """The estimate for ``tokens`` tokens per micro-batch (see the module docstring) and
    ``patches`` image patches through the vision ``tower`` (``perf.vision_tower``);
    ``counts``: ``count_parameters(config)`` when the caller has it already."""
    h, kv, i, layers, vocab, _ = shape(config)
    total, per_layer = counts or count_parameters(config)
    trainable = total if trainable is None else trainable
    states = (total * param_bytes + 3 * trainable * param_bytes) / world
    sharded = world > 1 or offload or compute_bytes != param_bytes
    gathered = 0.0
    if sharded:
        root = total - layers * per_layer
        held = total if keep_gathered else 2 * per_layer + root
        gathered = (held + per_layer) * compute_bytes
    layer_acts = layer_activation_bytes(config, compute_bytes)  # per token
    if checkpointing:
        acts = tokens * (layers * h * compute_bytes + layer_acts)
    else:
        acts = tokens * layers * layer_acts
    acts += tokens * 3 * h * compute_bytes  # the final norm's input, normalised and scaled
    if tower is not None and tower.trains:
        vc = config.vision_config
        inner = getattr(vc, "intermediate_size", None) or tower.width * getattr(vc, "mlp_ratio", 4)
        blocks = tower.full_blocks + tower.windowed_blocks
        block = (12 * tower.width + 4 * int(inner)) * compute_bytes  # per patch
        pixels = int(vc.in_channels if hasattr(vc, "in_channels") else vc.in_chans) \
            * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
        ends = (pixels + 5 * tower.width) * compute_bytes  # patch embedding and merger
        acts += patches * (ends + (blocks * tower.width * compute_bytes + block if checkpointing
                                   else blocks * block))
    return MemoryEstimate(
        parameters=0.0 if offload else total * param_bytes / world,
        gradients=0.0 if offload else trainable * param_bytes / world,
        optimizer=0.0 if offload else 2 * trainable * param_bytes / world,
        gathered=gathered,
        reference=total * (reference_bytes or param_bytes) / world if reference else 0.0,
        activations=float(acts), logits=float(min(chunk, tokens) * vocab * (3 * 4 + compute_bytes)
                                              + kept_probabilities(tokens, vocab)),
        host=states if offload else 0.0)


def saved_bytes(run, parameters) -> int:
    """Bytes of the distinct tensors autograd saves for backward while ``run()`` runs (the
    activations a forward pass keeps), each storage counted once, ``parameters`` left out."""
    own = {p.untyped_storage().data_ptr() for p in parameters}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()) if out is not None else 0


# auto checkpointing: on when a micro-batch without it would need more than this share of the
# GPU memory this process may use (the rest: the CUDA context, allocator slack, the batch)
CHECKPOINT_ABOVE = 0.5


def gradient_checkpointing(setting: bool | str, device: torch.device,
                           needs: Callable[[], float] | None = None,
                           usable: float | None = None) -> bool:
    """``learner.gradient_checkpointing``. auto: off on a CPU; on a GPU, on when ``needs()``
    (the bytes a micro-batch of the token budget takes without checkpointing, with the model's
    states: ``estimate``) is above ``CHECKPOINT_ABOVE`` of this process's share of the
    GPU (``usable`` bytes; default: the device's memory times the runner's share for this
    process), so recomputing is paid only where memory needs it (a 135M model on an 80 GB GPU
    does not recompute; a 1.5B one at 32k tokens a micro-batch does). On when ``needs`` is
    None."""
    if setting != "auto":
        return bool(setting)
    if device.type != "cuda":
        return False
    if needs is None:
        return True
    return needs() > CHECKPOINT_ABOVE * (gpu_share(device) if usable is None else usable)


def gpu_share(device: torch.device) -> float:
    """Bytes of ``device`` this process may use: its memory times the runner's share for the
    process (the whole GPU when it has it alone)."""
    from actors.runtime.config import process_share

    return torch.cuda.get_device_properties(device).total_memory * (process_share() or 1.0)


def base_config(model) -> Any:
    """The config of ``model``'s own architecture (with LoRA: the base model's)."""
    return (model.get_base_model() if hasattr(model, "get_base_model") else model).config


def _policy_shape(policy) -> tuple[Any, dict[str, Any]]:
    """A learner ``Policy``'s model config and the ``estimate`` arguments it fixes (ranks,
    dtypes, FSDP's gathering, reference, trainable parameters, offload, vision tower)."""
    trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    return base_config(policy.model), dict(
        world=policy.group.world, param_bytes=torch.finfo(policy.dtype).bits // 8,
        compute_bytes=torch.finfo(policy.compute_dtype).bits // 8,
        keep_gathered=policy.keep_gathered, reference=policy.keeps_reference,
        trainable=trainable, offload=policy.cfg.offload, tower=vision_tower(policy.model))


def needs_without_checkpointing(policy) -> Callable[[int], float]:
    """Device bytes a micro-batch of so many tokens takes without gradient checkpointing, the
    policy's states included (images not counted): what ``gradient_checkpointing`` weighs, for
    each micro-batch. The policy's shape and parameter counts are taken once, here (counting
    builds the model on the meta device)."""
    config, shape = _policy_shape(policy)
    counts = count_parameters(config)
    return lambda tokens: estimate(config, tokens=tokens, counts=counts, **shape).device_total


def describe(policy, tokens: int, budget: str = "", patches: int = 0) -> str:
    """The estimate for a learner's ``Policy`` as it was built and micro-batches of ``tokens``
    tokens (and ``patches`` image patches), with offload off and on (``budget`` says where
    ``tokens`` came from)."""
    config, shape = _policy_shape(policy)
    return table(config, tokens=tokens, checkpointing=policy.checkpointing, budget=budget,
                 patches=patches, **shape)


def table(config, *, tokens: int, world: int, offload: bool, budget: str = "",
          **common) -> str:
    """The estimate as a table: one row with offload off, one with it on, this run's marked."""
    common["counts"] = count_parameters(config)  # once for both rows
    lines = [f"memory estimate per rank (actors/learner/memory.py): {tokens} tokens per "
             f"micro-batch{budget}, {world} rank(s), gradient checkpointing "
             f"{'on' if common.get('checkpointing') else 'off'}",
             f"             {HEADER}"]
    for off in (False, True):
        mark = " <- this run" if off == offload else ""
        lines.append(f"offload {'on ' if off else 'off'}  "
                     f"{estimate(config, offload=off, world=world, tokens=tokens, **common).row()}"
                     f"{mark}")
    return "\n".join(lines)


def announce(policy, tokens: int, patches: int = 0) -> str | None:
    """What the learner prints before its first step, its micro-batches' size now known: the
    table on a GPU (where running out of device memory is the risk it informs), one line on a
    CPU only when the estimate nears the machine's memory (half of it), else nothing."""
    if policy.device.type == "cuda":
        return describe(policy, tokens, " (the largest of the first batch)", patches)
    config, shape = _policy_shape(policy)
    e = estimate(config, tokens=tokens, checkpointing=policy.checkpointing, patches=patches,
                 **shape)
    total, machine = e.device_total + e.host, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if total < machine / 2:
        return None
    return (f"memory estimate per rank: {total / GB:.1f} GB for micro-batches of {tokens} tokens, "
            f"of this machine's {machine / GB:.1f} GB (runner.py check prints the table)")


def planned(topology, device: str) -> str:
    """The table ``runner.py check`` prints, from the topology alone (no weights loaded): the
    largest micro-batch the token budget allows, on ``device`` (``cpu`` or ``cuda``)."""
    from transformers import AutoConfig

    from actors.model_store import resolve_model_path

    L, model = topology.learner, topology.model
    config = AutoConfig.from_pretrained(resolve_model_path(model.path))
    cuda = device == "cuda"
    params = model.dtype
    compute = auto_dtype(L.dtype, cuda, model.dtype)
    rows, budget_tokens = micro_limits(
        L, cuda, token_activation_bytes(config, ITEMSIZE[compute]))
    rows = min(rows, L.groups_per_step * topology.algorithm.n)  # a micro-batch is in one batch
    longest, source = longest_sequence(topology)
    if longest is not None and (not budget_tokens or rows * longest < budget_tokens):
        tokens = rows * longest
        budget = f" ({rows} rows of at most {longest} tokens: {source})"
    else:
        tokens = budget_tokens or rows * 1024
        budget = (" (learner.max_tokens_per_micro_batch: the most one may hold)"
                  if budget_tokens else
                  " (no token budget: micro_batch_size x 1024 assumed)")
        keep = keep_whole(L, cuda, budget_tokens)
        group = None if longest is None else \
            longest + (topology.algorithm.n - 1) * topology.sampler.max_tokens  # prompt once
        if keep and group is not None and L.packing and L.share_prefixes and group > tokens:
            tokens = min(keep, group)  # a group sharing its prompt, kept whole over the budget
            budget = f" (a group sharing its prompt, kept whole up to twice the budget {keep // 2})"
    a = topology.algorithm
    shape = dict(world=L.nproc_per_node * L.nnodes, offload=L.offload,
                 param_bytes=ITEMSIZE[params], compute_bytes=ITEMSIZE[compute],
                 keep_gathered=(not cuda) if L.reshard_after_forward is None
                 else not L.reshard_after_forward,
                 reference=a.use_kl_loss or a.use_kl_in_reward,
                 trainable=None if L.lora.rank == 0 else 0)
    here = cuda and torch.cuda.is_available()  # a GPU to weigh auto against (else it is on)
    checkpointing = gradient_checkpointing(
        L.gradient_checkpointing, torch.device(device),
        (lambda: estimate(config, tokens=tokens, **shape).device_total) if here else None,
        torch.cuda.get_device_properties(0).total_memory if here else None)
    return table(config, tokens=tokens, budget=f"{budget} on {device}",
                 checkpointing=checkpointing, **shape)


PROMPTS_SAMPLED = 256  # prompts of the task whose longest sets ``planned``'s sequence length


def longest_sequence(topology) -> tuple[int | None, str]:
    """The most tokens one row of a micro-batch holds, and where the figure comes from: the
    prompt (``task.max_prompt_length``, or else the longest of the task's first
    ``PROMPTS_SAMPLED`` prompts, chat-templated as the sampler feeds them) plus the response
    (``sampler.max_tokens``). None for a multi-turn rollout (tool output and later turns make
    a sample's length open-ended)."""
    if topology.agent.enabled:
        return None, ""
    response = topology.sampler.max_tokens
    if topology.task.max_prompt_length:
        return (topology.task.max_prompt_length + response,
                f"task.max_prompt_length + sampler.max_tokens {response}")
    from actors.data.chat import prompt_token_counter
    from actors.data.sources import make_task

    count = prompt_token_counter(topology.model.path)
    task = make_task(topology.task, seed=topology.run.seed)
    drawn = min(PROMPTS_SAMPLED, task.size)
    longest = max(count(task.prompt(i, prompt_id=i)) for i in range(drawn))
    return (longest + response,
            f"the longest of the first {drawn} prompts, {longest}, + sampler.max_tokens {response}")


def measured(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """torch's own byte counts of what ``estimate`` predicts for states: every parameter, every
    gradient held now, and the optimizer's per-parameter state tensors (not its step counters)."""
    def nbytes(t: torch.Tensor) -> int:
        local = getattr(t, "to_local", None)  # a DTensor: this rank's shard
        return (local() if local is not None else t).nbytes

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    state = [v for s in optimizer.state.values() for k, v in s.items()
             if isinstance(v, torch.Tensor) and k != "step"]
    return {"parameters": sum(nbytes(p) for p in model.parameters()),
            "gradients": sum(nbytes(g) for g in grads),
            "optimizer": sum(nbytes(v) for v in state)}
