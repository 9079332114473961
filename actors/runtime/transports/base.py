"""What a weights transport is: its two halves' interfaces, and what a receiver needs of its
engine.

A transport moves one version of the policy's weights from the learner to every sampler's
engine. It has two halves: a learner-side ``Sender`` that turns a version into the messages the
weights channel (``actors/runtime/weights.py``) answers a poll with, and moves the bytes where
they do not travel in those messages; and a sampler-side ``Receiver`` that turns what arrived
into the typed source the engine loads (``sources.py``). Each transport is one file (``zmq.py``,
``shm.py``, ``nccl.py``, ``ipc.py``) and one row of ``table.TRANSPORTS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from actors.runtime.config import LearnerConfig
    from actors.runtime.transports.sources import WeightsSource
    from messages.weights import AdapterSpec, WeightsHeader, WeightsPoll


@dataclass(frozen=True)
class ReceiveInto:
    """What a sampler's receiver needs of its engine (the GPU transports read it)."""

    device: Any = "cpu"  # where received tensors go, for an engine that loads them itself
    in_worker: bool = False  # the engine's own workers receive GPU transfers (WorkerTransfer)
    ranks: int = 1  # those workers (the engine's GPUs)
    timeout_s: float = 600.0  # a transfer waiting longer fails (learner.collective_timeout_s)


class Sender(ABC):
    """Learner side of a transport (rank 0). ``prepare`` runs once per version."""

    name: ClassVar[str]
    moves_bytes: ClassVar[bool] = False  # transfer() moves the bytes (GPU transports)
    reads_at_prepare: ClassVar[bool] = False  # prepare() has read every tensor when it returns
    # (so they may be the live parameters: the next optimizer step comes after it)

    @classmethod
    def build(cls, learner: LearnerConfig, device: torch.device) -> Sender:
        """The sender of a learner with ``learner``'s keys, gathering on ``device``."""
        return cls()

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
    worker_via: ClassVar[type | None] = None  # how the bytes of its ``WorkerTransfer`` come
    # (``sources.GroupBroadcast``, ``IpcHandles``) to an engine whose own workers receive; None:
    # it hands such an engine tensors or a file instead

    @classmethod
    def build(cls, into: ReceiveInto) -> Receiver:
        """The receiver of a sampler whose engine is as ``into`` says."""
        return cls()

    @abstractmethod
    async def receive(self, header: WeightsHeader, parts: dict[str, torch.Tensor]
                      ) -> WeightsSource:
        """The engine's source of ``header.version`` (``parts``: tensors that came in frames)."""

    def taking(self, source: WeightsSource) -> None:
        """The engine takes ``source`` to load it; the source it took before is loaded by now
        (a sampler loads one version at a time). Default: nothing to release."""
        return None

    def poll_fields(self) -> dict[str, Any]:
        """What this receiver adds to the sampler's polls (GPU transports: the group held)."""
        return {}

    def close(self) -> None:
        """Release what the receiver holds (links, groups)."""
        return None

