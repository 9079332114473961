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

import json
import mmap
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from messages.tensor import TensorMeta
    from messages.weights import AdapterSpec, CudaIpcHandle, TransferGroup


# safetensors' names of the dtypes a policy's weights come in, and torch's
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
                      "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                      "U8": "uint8", "BOOL": "bool"}
MAPS_KEPT = 4  # files this process keeps mapped (the shm learner writes a few files over again)
# (dev, inode) -> (fd, mapping), the least recently used first
_maps: OrderedDict[tuple[int, int], tuple[int, mmap.mmap]] = OrderedDict()
_maps_lock = threading.Lock()


def mapped(path: str) -> mmap.mmap:
    """This process's read-only mapping of the file at ``path``, kept across calls: the shm
    learner writes its next versions into the files of versions it dropped, so a file mapped
    once stays mapped, and reading a version costs no page faults after the first. Mappings of
    files removed since are let go (they would keep their memory)."""
    fd = os.open(path, os.O_RDONLY)  # FileNotFoundError: gone (a newer version replaced it)
    with _maps_lock:
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            for other, (other_fd, _) in list(_maps.items()):
                if other != key and os.fstat(other_fd).st_nlink == 0:
                    _release(other)
            held = _maps.get(key)
            if held is not None and len(held[1]) == st.st_size:
                _maps.move_to_end(key)
                os.close(fd)
                return held[1]
            if held is not None:
                _release(key)
            while len(_maps) >= MAPS_KEPT:
                _release(next(iter(_maps)))
            mapping = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        _maps[key] = (fd, mapping)
        return mapping


def _release(key: tuple[int, int]) -> None:
    fd, _ = _maps.pop(key)  # the mapping itself goes with the last view of it
    os.close(fd)


def writable_view(buffer: Any) -> torch.Tensor:
    """A uint8 tensor over all of ``buffer`` (a mapping), sharing its memory. A read-only
    buffer gives a tensor that must not be written (torch warns that it cannot stop it)."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buffer, dtype=torch.uint8)


class SharedWeights(Mapping):
    """The tensors of a safetensors file in shared memory, read on access (``Mapping[str,
    Tensor]``: read-only views of this process's mapping of the file, ``mapped``); ``path``
    is the file, for an engine that reads it itself."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
        except FileNotFoundError:
            raise  # removed: a newer version replaced it
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"weights: {path} is not a safetensors file ({exc})") from exc
        header.pop("__metadata__", None)
        self._start = 8 + size
        self._entries: dict[str, tuple[str, list[int], int, int]] = {
            name: (e["dtype"], e["shape"], *e["data_offsets"]) for name, e in header.items()}

    def views(self) -> dict[str, torch.Tensor]:
        """Every tensor, as a view of the mapped file (copy it; never write to it)."""
        import torch

        data = writable_view(mapped(self.path))
        out = {}
        for name, (code, shape, start, end) in self._entries.items():
            dtype = getattr(torch, SAFETENSORS_DTYPES[code])
            out[name] = data[self._start + start:self._start + end].view(dtype).view(shape)
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._entries:
            raise KeyError(name)
        return self.views()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self):  # type: ignore[override]  # one mapping for all tensors
        return self.views().items()


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
