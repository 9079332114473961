"""The rules of where the learner and the samplers compute: ``auto`` dtypes answered, and the
checks of the placement keys (device, precision, the learner's ranks), which are fields of
their sections (``learner.LearnerPlacement``, ``sampler.SamplerPlacement``). Nothing here
imports torch unless a key asks for CUDA (the check then asks torch whether there is one).
"""

from __future__ import annotations

from typing import Any

from actors.runtime.config.gpus import on_gpu
from actors.runtime.config.schema_base import need


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
