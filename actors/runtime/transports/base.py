"""The weights transport seam: what a transport is, the table of them, and ``auto``.

A transport moves one version of the policy's weights from the learner to every sampler's
engine. It has two halves: a learner-side ``Sender`` that turns a version into the messages the
weights channel (``actors/runtime/weights.py``) answers a poll with, and moves the bytes where
they do not travel in those messages; and a sampler-side ``Receiver`` that turns what arrived
into a typed ``WeightsSource`` for the engine: the tensors themselves (``Mapping``), a file in
shared memory (``SharedWeights``), or a GPU transfer the engine's own worker takes part in
(``WorkerTransfer``), all in ``sources.py``. An engine matches on the source's type; nothing hides a path
or a handle behind a mapping.

The channel does not change with the transport: versions, long polls, the newest version only.
Each transport is one file (``zmq.py``, ``shm.py``, ``nccl.py``, ``ipc.py``) and one row of
``TRANSPORTS``; ``learner.weights_transport = "auto"`` is resolved by ``resolve_transport``
alone. This module is torch-free: the config checks use the table.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from actors.runtime.transports.sources import WeightsSource
    from messages.weights import AdapterSpec, WeightsHeader, WeightsPoll


@dataclass(frozen=True)
class Transport:
    """One row of the table: a transport's name, its file and what it needs. Which engines
    receive it (and where they need CUDA for it) is the engines' own rows
    (``actors/sampler/engines/registry.py``)."""

    name: str
    module: str  # the file holding its Sender and Receiver (imported only when used)
    summary: str  # one line for the README, errors and the status
    same_host: bool  # every sampler shares the learner's host
    gpu: bool  # the learner gathers on its device: the bytes go from there (GPU to GPU on GPUs)


TRANSPORTS: dict[str, Transport] = {t.name: t for t in (
    Transport("zmq", "actors.runtime.transports.zmq",
              "the tensors in the weights messages (buckets of zero-copy frames)",
              same_host=False, gpu=False),
    Transport("shm", "actors.runtime.transports.shm",
              "one safetensors file per version in /dev/shm; the message carries its path",
              same_host=True, gpu=False),
    Transport("nccl", "actors.runtime.transports.nccl",
              "a broadcast group per sampler: vLLM's NCCL weight-transfer engine for vllm, a "
              "torch.distributed group for hf (NCCL on GPUs, gloo on CPUs)",
              same_host=False, gpu=True),
    Transport("ipc", "actors.runtime.transports.ipc",
              "CUDA IPC handles of the learner's gathered tensors (vLLM's IPC weight-transfer "
              "engine for vllm, torch's CUDA tensor reductions for hf); one host",
              same_host=True, gpu=True),
)}


def resolve_transport(setting: str, *, weights_address: str) -> str:
    """``learner.weights_transport``: a named transport as is; ``auto`` is shm when the weights
    address is ``ipc://`` (every sampler shares the learner's host, and its /dev/shm) and zmq
    otherwise. The GPU transports are chosen by name only: they have not run on a GPU yet."""
    if setting != "auto":
        return setting
    return "shm" if weights_address.startswith("ipc://") else "zmq"


def transport_problem(name: str, *, engine: str, receives: tuple[str, ...],
                      needs_cuda: tuple[str, ...], weights_address: str, learner_device: str,
                      sampler_device: str) -> str | None:
    """Why transport ``name`` cannot carry this job's weights to ``engine`` (which receives
    ``receives``, and needs CUDA for ``needs_cuda``), or None. A config check; an ``auto``
    address or device is not judged here: it is resolved later."""
    t = TRANSPORTS.get(name)
    if t is None:
        return f"unknown transport {name!r} (known: {', '.join(TRANSPORTS)}, auto)"
    if name not in receives:
        return f"{name} has no receiver in sampler.engine = {engine}"
    if t.same_host and weights_address != "auto" and not weights_address.startswith("ipc://"):
        return (f"{name} needs every sampler on the learner's host: learner.weights_address "
                f"must be ipc:// (it is {weights_address})")
    devices = (learner_device, sampler_device)
    if name in needs_cuda and "auto" not in devices and \
            not all(d.startswith("cuda") for d in devices):
        return (f"{name} moves weights GPU to GPU for sampler.engine = {engine}: set "
                f"learner.device and sampler.device to cuda (they are {learner_device} and "
                f"{sampler_device})")
    return None


class Sender(ABC):
    """Learner side of a transport (rank 0). ``prepare`` runs once per version."""

    name: ClassVar[str]
    moves_bytes: ClassVar[bool] = False  # transfer() moves the bytes (GPU transports)
    reads_at_prepare: ClassVar[bool] = False  # prepare() has read every tensor when it returns
    # (so they may be the live parameters: the next optimizer step comes after it)

    @abstractmethod
    async def prepare(self, version: int, tensors: list[tuple[str, torch.Tensor]], *,
                      bucket_bytes: int = 0, adapter: AdapterSpec | None = None
                      ) -> list[list[Any]]:
        """The messages (each a list of frames) that carry ``version`` to one sampler
        (``adapter``: the tensors are LoRA adapters of that spec; every header says so)."""

    async def transfer(self, version: int, peer: bytes) -> bool:
        """Move the bytes of ``version`` to the sampler ``peer`` after its messages went out
        (GPU transports: a broadcast in its group); False when the sampler did not take them
        (its group is dropped: it polls again and joins a new one). Others move nothing."""
        return True

    def polled(self, peer: bytes, poll: WeightsPoll) -> None:
        """The sampler ``peer`` polled (GPU transports read its ranks and group from it)."""
        return None

    def messages_for(self, peer: bytes, messages: list[list[Any]]) -> list[list[Any]]:
        """The messages that carry the version to ``peer`` (default: the same for all)."""
        return messages

    def forget(self, peer: bytes) -> None:
        """The sampler ``peer`` is gone: drop what is held for it."""
        return None

    def close(self) -> None:
        """Release what the transport holds (files, groups)."""
        return None


class Receiver(ABC):
    """Sampler side of a transport: what arrived, as the source its engine loads."""

    name: ClassVar[str]

    @abstractmethod
    async def receive(self, header: WeightsHeader, parts: dict[str, torch.Tensor]
                      ) -> WeightsSource:
        """The engine's source of ``header.version`` (``parts``: tensors that came in frames)."""

    def poll_fields(self) -> dict[str, Any]:
        """What this receiver adds to the sampler's polls (GPU transports: the group held)."""
        return {}

    def close(self) -> None:
        """Release what the receiver holds (links, groups)."""
        return None


def sender_for(name: str, **kwargs: Any) -> Sender:
    """A new sender of the transport ``name`` (a row of ``TRANSPORTS``)."""
    module = importlib.import_module(TRANSPORTS[name].module)
    return module.SENDER(**kwargs)


def receiver_for(name: str, **kwargs: Any) -> Receiver:
    """A new receiver of the transport ``name`` (a row of ``TRANSPORTS``)."""
    module = importlib.import_module(TRANSPORTS[name].module)
    return module.RECEIVER(**kwargs)


