"""What an engine is handed by ``load_weights``: a typed source of one version's weights.

- ``Mapping[str, Tensor]``: the tensors, in this process (zmq frames; on a GPU transport to the
  hf engine, tensors already on the sampler's device).
- ``SharedWeights``: a safetensors file in shared memory (shm); an engine that reads files
  itself (vLLM's worker) loads it from its ``path``, the hf engine reads its tensors.
- ``WorkerTransfer``: a GPU transfer that the engine's own workers receive (an engine whose row
  says ``in_worker``): the tensors it carries and how they come (``via``: a broadcast in a
  transfer group, ``GroupBroadcast``, or CUDA IPC handles, ``IpcHandles``), in the transport's
  terms; the engine makes its own calls of it (vLLM: ``engines/vllm/receive.py``).
- ``AdapterWeights``: LoRA adapters only (any transport above carries them), with their
  ``AdapterSpec``; the base model the engine started with stays as it is.

Engines dispatch with ``match``; a source is never a mapping hiding a path. Torch-free at
import (tensors are read on access).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from messages.tensor import TensorMeta
    from messages.weights import AdapterSpec, CudaIpcHandle, TransferGroup


class SharedWeights(Mapping):
    """The tensors of a safetensors file in shared memory, read on access (``Mapping[str,
    Tensor]``); ``path`` is the file, for an engine that reads it itself."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.path = path
        if not Path(path).is_file():
            raise FileNotFoundError(path)  # removed: a newer version replaced it
        with safe_open(path, framework="pt") as f:
            self._names = list(f.keys())  # noqa: SIM118 - safe_open is not a dict

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def items(self):  # type: ignore[override]  # one open for all tensors
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            for name in self._names:
                yield name, f.get_tensor(name)


@dataclass(frozen=True)
class GroupBroadcast:
    """The learner broadcasts the tensors in ``group`` (the nccl transport), in buckets of
    ``group.bucket_bytes``, closed by an all-reduce; the workers join the group first when
    ``joins`` (a new group), at ranks from ``group.rank``."""

    group: TransferGroup
    joins: bool
    packed: bool  # the sender speaks vLLM's packed PyNccl protocol (receivers on CUDA)
    timeout_s: float  # a receive waiting longer fails


@dataclass(frozen=True)
class IpcHandles:
    """The learner's tensors on its GPU (``gpu``: its UUID), opened from their CUDA IPC
    ``handles`` (the ipc transport); ``first``: the workers' first transfer of this kind (or
    the first after one failed)."""

    gpu: str
    handles: list[CudaIpcHandle]
    first: bool


@dataclass
class WorkerTransfer:
    """A GPU transfer into an engine's own workers: the sender moves the bytes while the
    workers receive them straight into the model."""

    tensors: list[TensorMeta]  # what the version holds, in order
    via: GroupBroadcast | IpcHandles
    done: Callable[[BaseException | None], None] = field(default=lambda exc: None)
    """Tell the receiving side how the engine's part ended (None: loaded), in the sampler's
    event loop; the engine calls it once, either way (the subscriber waits for it)."""


@dataclass
class AdapterWeights:
    """One version's LoRA adapters: ``tensors`` (PEFT's saved names, ``...lora_A.weight``) as
    the transport delivered them, and ``spec`` (rank, alpha, target modules). An engine that
    cannot apply adapters never gets one: that is a config error at start."""

    spec: AdapterSpec
    tensors: Mapping[str, torch.Tensor]  # a mapping of tensors, or a SharedWeights file


WeightsSource = Mapping[str, "torch.Tensor"] | SharedWeights | WorkerTransfer | AdapterWeights
