"""Weights flow: Learner -> Samplers, versioned, as zero-copy frames.

Sockets: the learner binds a ROUTER (``weights`` address); each sampler connects a DEALER and
long-polls with ``WeightsPoll(have_version)``. When the learner holds a newer version it answers
with ``buckets`` messages in a row, each a ``WeightsHeader`` frame followed by one raw frame per
tensor of that bucket, in header order (a version is never one message the size of the model).
A slow sampler therefore only ever receives the newest weights, never a queue of stale ones.
"""

from __future__ import annotations

import msgspec

from messages.tensor import TensorMeta


class WeightsPoll(msgspec.Struct, tag=True, gc=False):
    """Sampler -> Learner: send me weights newer than ``have_version`` when there are some."""

    have_version: int
    ranks: int = 1  # GPU transports: this sampler's receiving ranks (its engine's TP workers)
    receiver: str = ""  # GPU transports: "" a torch.distributed group, "pynccl": vLLM's NCCL
    # weight-transfer engine in the engine's workers
    group: int = 0  # GPU transports: the port of the transfer group it holds (0: none)


class TransferGroup(msgspec.Struct, gc=False):
    """Where a sampler joins its transfer group with the learner (GPU transports): the
    learner is rank 0 of a group of ``world``; a new ``port`` is a new group (a restarted
    sampler's, or one re-formed after a failed transfer)."""

    address: str
    port: int
    world: int
    rank: int = 1  # this sampler's first rank (its engine's workers take rank .. rank + TP - 1)
    bucket_bytes: int = 0  # tensors travel in broadcasts of at most this many bytes (0: one)


class CudaIpcHandle(msgspec.Struct, array_like=True, gc=False):
    """A CUDA tensor of the learner shared with a process on the same host (the arguments of
    torch's ``rebuild_cuda_tensor``, classes left out: always a plain tensor and storage)."""

    size: list[int]
    stride: list[int]
    offset: int
    dtype: str
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class AdapterSpec(msgspec.Struct, frozen=True, gc=False):
    """What a version of LoRA adapters is, beside its tensors (PEFT's ``LoraConfig`` keys): the
    tensors are PEFT's saved names (``...q_proj.lora_A.weight``, no adapter name) and the base
    they apply to is the model every sampler loaded at start, which never changes."""

    rank: int  # r
    alpha: float  # lora_alpha (scale alpha / rank)
    target_modules: list[str]  # the module names that carry an adapter


class WeightsHeader(msgspec.Struct, tag=True, gc=False):
    """Learner -> Sampler: frame 0 of a weights message; frames 1.. are the tensors' bytes."""

    version: int
    tensors: list[TensorMeta]
    path: str = ""  # shared-memory transport: a safetensors file on the sampler's own host
    # holds the tensors (``tensors`` is then empty and no tensor frames follow)
    bucket: int = 0  # this message's place among the version's messages
    buckets: int = 1  # messages the version is sent in, each one bucket of tensors
    transport: str = ""  # the transport that carries the tensors ("": shm with a path, else zmq)
    group: TransferGroup | None = None  # nccl: the group the tensors are broadcast in, after
    # this message, in ``tensors`` order (no tensor frames follow)
    handles: list[CudaIpcHandle] = []  # ipc: one per tensor of ``tensors``
    gpu: str = ""  # ipc: the UUID of the learner's GPU the handles live on
    adapter: AdapterSpec | None = None  # LoRA: the tensors are this version's adapters only
    # (named as PEFT saves them), to apply on the base model the sampler started with


ToLearnerWeights = WeightsPoll
FromLearnerWeights = WeightsHeader
