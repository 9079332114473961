"""Where the learner and the samplers compute: device, precision, and the learner's ranks.

The keys are fields of ``learner`` and ``sampler`` (``LearnerConfig`` and ``SamplerConfig``
derive from the sections below); their checks are ``check_placement``. Nothing here imports
torch unless a key asks for CUDA (the check then asks torch whether there is one).
"""

from __future__ import annotations

from typing import Any, Literal

from actors.runtime.config.constraints import Device, NonNegInt, Port, PositiveFloat, PositiveInt
from actors.runtime.config.gpus import on_gpu
from actors.runtime.config.schema_base import ActorCommon, need


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


class SamplerPlacement(ActorCommon, frozen=True):
    device: Device = "auto"
    """auto (cuda when a GPU is visible, else cpu), cpu, cuda, or cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The engine's dtype (auto: bfloat16 on a GPU, model.dtype on a CPU)."""


def auto_dtype(setting: str, gpu: bool, model_dtype: str) -> str:
    """A ``dtype`` key with ``auto`` answered for a process on a GPU (``gpu``) or not: bfloat16
    on a GPU, ``model.dtype`` on a CPU (where bf16 matmuls are slow); any other as named."""
    if setting == "auto":
        return "bfloat16" if gpu else model_dtype
    return setting


def samplers_dtype(topology: Any, gpu_visible: bool) -> str:
    """The dtype the samplers' engines compute in: ``sampler.dtype`` with ``auto`` answered as
    ``devices.resolve_dtype`` answers it; ``gpu_visible``: whether ``sampler.device = "auto"``
    would find a GPU."""
    S = topology.sampler
    return auto_dtype(S.dtype, on_gpu(S.device, gpu_visible), topology.model.dtype)


def check_placement(topology: Any) -> None:
    """The placement keys of ``topology``; ``need(ok, key, why)`` raises naming the key."""
    L, S = topology.learner, topology.sampler
    for key, device in (("learner.device", L.device), ("sampler.device", S.device)):
        if device.startswith("cuda"):
            ok, why = _cuda_problem(device)
            need(ok, key, why)
    need(L.node_rank < L.nnodes, "learner.node_rank",
         f"must be in [0, learner.nnodes = {L.nnodes})")
    need(L.node_rank == 0 or "{time}" not in topology.run.dir, "run.dir",
         "every node's runner must name the same run directory (shared by the nodes): set it")
    world = L.nproc_per_node * L.nnodes
    need(world == 1 or ":" not in L.device, "learner.device",
         f"{L.device} names one GPU, but the learner has {world} ranks: use cuda (rank r "
         "takes cuda:LOCAL_RANK)")
    if world > 1:
        per = world * L.ppo_mini_batches
        need(L.groups_per_step % per == 0, "learner.groups_per_step",
             f"must be a multiple of ranks × ppo_mini_batches = {world} × {L.ppo_mini_batches} "
             "(every rank trains the same number of whole groups per mini-batch)")


def _cuda_problem(device: str) -> tuple[bool, str]:
    import torch  # only when a key asks for CUDA

    if not torch.cuda.is_available():
        return False, f"{device} asked for, but torch sees no CUDA device on this machine"
    index = int(device.split(":")[1]) if ":" in device else 0
    count = torch.cuda.device_count()
    return index < count, f"{device} asked for, but this machine has {count} CUDA device(s)"
