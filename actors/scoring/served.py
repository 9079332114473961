"""``ServedScoring``: what a served model's replica scores with (the rule workers' is ``Scoring``).

It holds the model its ``[[reward.models]]`` entry names (``scorer_of``: a reward model, or a
judge with its engine and tokenizer) on the device the runner gave the replica, batches
concurrent requests into shared forwards (``Batcher``), and, with ``sleep_idle_s``, puts the
model to sleep while no request comes and wakes it for the next (``actors/scoring/sleep.py``; a
vllm judge sleeps by its engine's own policy). A model that fails on a batch gives every item of
it a recorded error, and the replica goes on serving. Nothing here but ``scorer_of`` depends on
the kind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

import anyio

from actors.runtime.config import JudgeConfig, RewardModelConfig, ServedModel, Topology
from actors.sandbox.children import Children
from actors.sandbox.protocol import Outcome
from actors.scoring.batching import Batcher
from actors.scoring.items import ScoreItem
from actors.scoring.scorer import ScoringStatistics
from actors.scoring.sleep import TorchSleep
from messages.reward import ScoreResult


class ServedModelScorer(Protocol):
    """What scores with a kind's model (``RewardModel``, ``Judge``)."""

    @property
    def children(self) -> Children | None:
        """Where user code of the kind runs (a judge's parser), if any."""
        ...

    async def load(self, device: Any) -> None: ...

    @property
    def module(self) -> Any: ...  # the torch model that sleeps, or None

    async def score(self, items: list[ScoreItem]) -> list[Outcome]: ...

    def status(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


def scorer_of(entry: ServedModel, topology: Topology, label: str) -> ServedModelScorer:
    """What a replica of ``entry`` scores with: the kind's module, imported for its kind only."""
    match entry:
        case RewardModelConfig():
            from actors.scoring.reward_model import RewardModel

            return RewardModel(entry)
        case JudgeConfig():
            from actors.scoring.judge import Judge

            return Judge(entry, topology, label)
    raise TypeError(f"no scorer for served model kind {entry.kind!r}")


class ServedScoring:
    """Scores items with ``entry``'s model."""

    def __init__(self, entry: ServedModel, topology: Topology, label: str = "") -> None:
        self.entry = entry
        self.model = scorer_of(entry, topology, label)
        self.batcher: Batcher[ScoreItem] = Batcher(self._run, entry.batch_size)
        self.sleeper: TorchSleep | None = None  # a torch model's sleep (set by load)
        self.last_request = time.monotonic()
        self._items = self._errors = 0
        self.device = "cpu"

    async def load(self) -> None:
        """Load the model on this replica's device (a broken one fails the replica at start)."""
        import torch

        from actors.runtime.devices import resolve_device

        torch.set_num_threads(self.entry.threads)  # the replica's share of the cores
        device = resolve_device(self.entry.device)
        self.device = str(device)
        await self.model.load(device)
        module = self.model.module
        if self.entry.sleep_idle_s > 0 and module is not None:
            self.sleeper = TorchSleep(module, Path(self.entry.path))

    async def _run(self, items: list[ScoreItem]) -> list[Outcome]:
        """One batch, under the batcher's lock: wake the model first if it sleeps."""
        if self.sleeper is not None and self.sleeper.asleep:
            await anyio.to_thread.run_sync(self.sleeper.wake)
        return await self.model.score(items)

    async def score(self, items: list[ScoreItem], max_response_length: int = 0) -> list[ScoreResult]:
        """One result per item, in order (``max_response_length``: the rule workers' concern)."""
        self.last_request = time.monotonic()
        outcomes = await self.batcher.score(items)
        self.last_request = time.monotonic()
        results = [ScoreResult(o.score if not o.error else 0.0, o.error, o.extra, trace=o.trace)
                   for o in outcomes]
        self._items += len(items)
        self._errors += sum(1 for r in results if r.error)
        return results

    async def keep_sleeping(self) -> None:
        """Put the model to sleep whenever it has been idle ``sleep_idle_s`` (runs beside the
        replica's work; never returns)."""
        if self.sleeper is None:
            await anyio.sleep_forever()
        assert self.sleeper is not None
        while True:
            due = self.last_request + self.entry.sleep_idle_s - time.monotonic()
            if due > 0:
                await anyio.sleep(due)
                continue
            async with self.batcher.lock:  # no batch runs while the weights go
                idle = time.monotonic() - self.last_request >= self.entry.sleep_idle_s
                if idle and not self.sleeper.asleep and not self.batcher.statistics().queued:
                    await anyio.to_thread.run_sync(self.sleeper.sleep)
            await anyio.sleep(self.entry.sleep_idle_s)

    def statistics(self) -> ScoringStatistics:
        c = self.model.children.statistics() if self.model.children is not None else None
        return ScoringStatistics(self._items, self._errors, c.timeouts if c else 0,
                                 c.crashes if c else 0, c.children if c else 0,
                                 c.started if c else 0)

    def status(self) -> dict[str, Any]:
        """What the replica adds to its status: its pool, batching, the model's own, sleeping."""
        b = self.batcher.statistics()
        out: dict[str, Any] = {"pool": self.entry.name, "model": self.entry.kind,
                               "device": self.device, "batches": b.batches,
                               "batch_items_max": b.largest,
                               "batch_requests_max": b.requests_largest, "queued": b.queued,
                               **self.model.status()}
        if self.sleeper is not None:
            out.update(self.sleeper.clock.statistics().status())
        return out

    async def aclose(self) -> None:
        await self.model.aclose()
