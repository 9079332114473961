"""A sampler's engine that lends the sampler's threads to the learner while it has no work.

Every call that computes (``generate``, ``load_weights``) runs inside ``Lender.working()``;
between calls, the sampler's ``sampler.threads`` are lent in this host's core table
(``actors/runtime/cores.py``), so a learner on the same CPU computes on them until the next
call starts. Only on a CPU: a GPU engine's threads are not the learner's compute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from actors.runtime.cores import CoreTable, Lender, table_path
from actors.sampler.engines.base import Engine, GenerateRequest, Generation


class LendingEngine:
    """``engine`` with its idle time lent; everything else is the engine's own."""

    def __init__(self, engine: Engine, lender: Lender) -> None:
        self.engine, self.lender = engine, lender

    def __getattr__(self, name: str) -> Any:  # version, continuous, weight_sync_s, watch, ...
        return getattr(self.engine, name)

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[list[Generation]]:
        with self.lender.working():
            return await self.engine.generate(requests)

    async def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        with self.lender.working():
            await self.engine.load_weights(version, tensors)

    async def aclose(self) -> None:
        try:
            await self.engine.aclose()
        finally:
            self.lender.close()

    def statistics(self) -> dict[str, Any]:
        own = self.engine.statistics() if hasattr(self.engine, "statistics") else {}
        return {**own, "lent_s": round(self.lender.lent_s, 1)}


def lend_idle(engine: Engine, run_dir: Any, index: int, threads: int,
              device: torch.device) -> Engine:
    """The engine sampler ``index`` generates with: lending its threads when on a CPU."""
    if device.type != "cpu":
        return engine
    lender = Lender(CoreTable(table_path(run_dir)), index, threads)
    return LendingEngine(engine, lender)  # type: ignore[return-value]
