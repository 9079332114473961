"""A sampler's engine that lends the sampler's threads to the learner while it has no work,
and borrows the learner's while the learner waits for a batch.

Every call that computes (``generate``, ``load_weights``) runs inside ``Lender.working()``;
between calls, the sampler's ``sampler.threads`` are lent in this host's core table
(``actors/runtime/cores.py``), so a learner on the same CPU computes on them until the next
call starts. An engine whose model runs in this process (hf: ``engine.model``) also borrows:
before each of its decoder layers it takes the threads a learner lends while it waits for its
batch (the first batch, validation rounds). Only on a CPU: a GPU engine's threads are not the
learner's compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from actors.runtime.cores import (
    LEARNERS,
    SAMPLERS,
    Borrower,
    CoreTable,
    Lender,
    Share,
    table_path,
)
from actors.runtime.transports.sources import WeightsSource
from actors.sampler.engines.base import Engine, GenerateRequest, Generation


class LendingEngine:
    """``engine`` with its idle time lent; everything else is the engine's own (each member of
    ``Engine`` forwarded by name, so mypy checks the wrapper against the protocol too)."""

    def __init__(self, engine: Engine, share: Share) -> None:
        self.engine, self.share = engine, share

    @property
    def continuous(self) -> bool:
        return self.engine.continuous

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def weight_sync_s(self) -> float:
        return self.engine.weight_sync_s

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[list[Generation]]:
        with self.share.lender.working():
            return await self.engine.generate(requests)

    async def load_weights(self, version: int, source: WeightsSource) -> None:
        with self.share.lender.working():
            await self.engine.load_weights(version, source)

    async def watch(self) -> None:
        await self.engine.watch()

    async def aclose(self) -> None:
        try:
            await self.engine.aclose()
        finally:
            self.share.close()

    def statistics(self) -> dict[str, Any]:
        statistics = getattr(self.engine, "statistics", None)  # an engine's own, where it has some
        own = statistics() if statistics is not None else {}
        return {**own, "lent_s": round(self.share.lender.lent_s, 1)}


def lend_idle(engine: Engine, run_dir: Any, index: int, count: int, threads: int,
              device: torch.device) -> Engine:
    """The engine sampler ``index`` (of ``count``) generates with: lending its threads, and
    borrowing the learner's, when on a CPU."""
    if device.type != "cpu":
        return engine
    table = CoreTable(table_path(run_dir))
    borrower = None
    model = getattr(engine, "model", None)
    if isinstance(model, torch.nn.Module):
        borrower = Borrower(table, LEARNERS, threads, rank=index, ranks=count)
        borrower.attach(model)
    lender = Lender(table, SAMPLERS[index % len(SAMPLERS)], threads)
    return LendingEngine(engine, Share(table, lender, borrower))
