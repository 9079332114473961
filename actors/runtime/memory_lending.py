"""GPU memory lent by a sleeping engine to the learner on its GPU, through the host's table
(``cores.py``).

Why: on a GPU the learner shares with a vLLM sampler, each process's caching allocator is held
to its share of the GPU's memory for its life (``devices.cap_memory``). A sampler with
``sampler.sleep_idle_s`` puts its engine to sleep while it has nothing to generate (vLLM's sleep
level 1: weights to host memory, KV cache freed); without lending, that memory would be free and
the learner still held to its share. So the sleeping engine lends what it freed, and the
learner raises its cap by what it borrows for the step it takes then: a step whose peak passes
the learner's own share succeeds while the sampler sleeps, instead of running out of memory.

The exchange, each side writing its own slot under the table's lock (so the two never
interleave: either the learner saw the loan and holds it, and the sampler waits, or the sampler
took it back first, and the learner does not borrow):

- sampler, after its engine sleeps: ``MemoryLender.lend(MiB freed)`` (at most its own share);
- learner, before a step: ``MemoryBorrower.step()`` reads what the samplers on its GPU lend and,
  when it is some, writes that it holds it and raises its cap;
- learner, after the step: drops its cached blocks, lowers its cap to its own share, writes that
  it holds nothing; if what it still holds passes its own share (state that only fits while the
  sampler sleeps), it raises: the job fails as it would without lending, never with a sampler
  that cannot wake;
- sampler, before its engine wakes: ``MemoryLender.take_back()`` stops the loan and says whether
  the learner still holds it; the engine wakes once it does not (a wake waits for at most the
  learner's step in progress).

Torch-free: the learner's allocator is handed in (``DeviceMemory``, ``devices.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from actors.runtime.config import of_kind
from actors.runtime.cores import MEMORY_HELD, MEMORY_LENT, CoreTable

MIB = 1 << 20


def lender_slot(sampler_index: int) -> int:
    return MEMORY_LENT[sampler_index % len(MEMORY_LENT)]


def lenders_among(names: Sequence[str]) -> list[int]:
    """The slots of the samplers among ``names`` (a placement's ``shared_with``: sampler-I)."""
    return [lender_slot(p.index) for p in of_kind("sampler", names)]


def holders_among(names: Sequence[str]) -> list[int]:
    """The slots of the learner ranks among ``names`` (learner-0 is rank 0, learner-0.rankR)."""
    return [holder_slot(p.rank) for p in of_kind("learner", names)]


def holder_slot(rank: int) -> int:
    return MEMORY_HELD[rank % len(MEMORY_HELD)]


class MemoryLender:
    """A sampler's side: what its sleeping engine lends to the learner ranks on its GPU
    (``holders``: their slots)."""

    def __init__(self, table: CoreTable, slot: int, holders: Sequence[int]) -> None:
        self.table, self.slot, self.holders = table, slot, list(holders)
        self.lent_mib = 0  # lent now
        with table.locked():
            table.lend(slot, 0)  # a restarted sampler: its predecessor's loan is void

    def lend(self, nbytes: int) -> None:
        """The engine sleeps: ``nbytes`` of GPU memory are the learner's until ``take_back``."""
        with self.table.locked():
            self.lent_mib = max(0, nbytes) // MIB
            self.table.lend(self.slot, self.lent_mib)

    def take_back(self) -> bool:
        """Stop lending; True once no learner on this GPU holds lent memory (the engine may
        wake), False while one still does (call again: it gives it back after its step)."""
        with self.table.locked():
            self.lent_mib = 0
            self.table.lend(self.slot, 0)
            return all(self.table.slots[h] == 0 for h in self.holders)

    def close(self) -> None:
        with self.table.locked():
            self.table.lend(self.slot, 0)
        self.table.close()


class DeviceMemory(Protocol):
    """What the borrower needs of the learner's allocator on its GPU."""

    total: int  # the GPU's memory, bytes

    def cap(self, share: float) -> None:
        """Hold the allocator to ``share`` of the GPU's memory."""

    def held(self) -> int:
        """Bytes the allocator holds once its cached blocks are released."""


class MemoryBorrower:
    """A learner rank's side, on a GPU it shares with samplers whose engines sleep
    (``lenders``: their slots); ``own``: its own share of the GPU's memory."""

    def __init__(self, table: CoreTable, slot: int, lenders: Sequence[int], own: float,
                 memory: DeviceMemory) -> None:
        self.table, self.slot, self.lenders = table, slot, list(lenders)
        self.own, self.memory = own, memory
        self.borrowed_steps = 0  # steps taken with lent memory
        with table.locked():
            table.lend(slot, 0)

    def _borrow(self) -> int:
        with self.table.locked():
            mib = sum(self.table.slots[i] for i in self.lenders)
            self.table.lend(self.slot, mib)
        return mib

    def _give_back(self) -> None:
        with self.table.locked():
            self.table.lend(self.slot, 0)

    @contextmanager
    def step(self) -> Iterator[int]:
        """Around one training step: the MiB borrowed for it (0: nothing lent now)."""
        mib = self._borrow()
        if not mib:
            yield 0
            return
        self.borrowed_steps += 1
        # a shared GPU is split equally (config/gpus.py): no lender frees more than its share
        lent = min(mib * MIB / self.memory.total, self.own * len(self.lenders))
        self.memory.cap(self.own + lent)
        try:
            yield mib
        finally:
            held = self.memory.held()  # the step's tensors are gone; its cached blocks too
            self.memory.cap(self.own)
            self._give_back()
        if held > self.own * self.memory.total:
            raise MemoryError(f"the learner holds {held / 2**30:.1f} GiB after a step taken on "
                              f"memory a sleeping sampler lent, more than its own share "
                              f"({self.own:.0%} of the GPU): it fits only while the sampler "
                              "sleeps. Give the learner a GPU of its own, or lower what it "
                              "keeps (learner.offload, a smaller model)")

    def close(self) -> None:
        self._give_back()
        self.table.close()
