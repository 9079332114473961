"""What an engine is handed by ``load_weights``: a typed source of one version's weights.

- ``Mapping[str, Tensor]``: the tensors, in this process (zmq frames; on a GPU transport to the
  hf engine, tensors already on the sampler's device).
- ``SharedWeights``: a safetensors file in shared memory (shm); an engine that reads files
  itself (vLLM's worker) loads it from its ``path``, the hf engine reads its tensors.
- ``WorkerTransfer``: a GPU transfer that the engine's own worker takes part in (vLLM's
  weight-transfer engines, NCCL or CUDA IPC): the engine passes ``init`` (once per transfer
  group) and ``update`` to vLLM's ``init_weight_transfer_engine`` / ``update_weights``.
- ``AdapterWeights``: LoRA adapters only (any transport above carries them), with their
  ``AdapterSpec``; the base model the engine started with stays as it is.

Engines dispatch with ``match``; a source is never a mapping hiding a path. Torch-free at
import (tensors are read on access).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from messages.weights import AdapterSpec


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


@dataclass
class WorkerTransfer:
    """A GPU transfer into a vLLM engine's worker, through vLLM's weight-transfer API: the
    sender moves the bytes while the worker receives them straight into the model."""

    backend: str  # vLLM's weight-transfer backend: "nccl" or "ipc"
    init: dict[str, Any] | None  # init_weight_transfer_engine's init_info (a new group), or None
    update: dict[str, Any]  # update_weights' update_info (names, dtype_names, shapes, ...)
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
