"""Concurrent requests to one model share its forwards.

A model pool's replica takes up to ``capacity`` requests at once, but its model runs one batch
at a time. ``Batcher.score`` queues a request's items; whoever holds the model next takes every
queued request (whole requests, up to ``max_items`` items, at least one request) into one call
of ``run``, and hands each request its own outcomes. So requests that arrive while a batch runs
go together into the next one, and a lone request never waits for company.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio

from actors.sandbox.protocol import Outcome

Item = TypeVar("Item")


@dataclass(frozen=True)
class BatcherStatistics:
    batches: int
    """Calls of the model so far."""
    items: int
    """Items scored in them."""
    largest: int
    """Most items in one call."""
    requests_largest: int
    """Most requests in one call."""
    queued: int
    """Requests waiting for the model now."""


class _Waiting(Generic[Item]):
    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.outcomes: list[Outcome] | None = None  # set once its batch ran


class Batcher(Generic[Item]):
    """Runs ``run(items) -> outcomes`` over the queued requests' items, one call at a time."""

    def __init__(self, run: Callable[[list[Item]], Awaitable[list[Outcome]]],
                 max_items: int) -> None:
        self.run, self.max_items = run, max_items
        self.lock = anyio.Lock()  # held while the model computes (also by sleep and wake)
        self._queue: list[_Waiting[Item]] = []  # in arrival order
        self._batches = self._items = self._largest = self._requests_largest = 0

    def statistics(self) -> BatcherStatistics:
        return BatcherStatistics(self._batches, self._items, self._largest,
                                 self._requests_largest, len(self._queue))

    async def score(self, items: list[Item]) -> list[Outcome]:
        """The outcomes of ``items``, in order, computed in some batch with others'."""
        me = _Waiting(items)
        self._queue.append(me)
        try:
            while me.outcomes is None:
                async with self.lock:  # fair: the requests take the model in arrival order
                    if me.outcomes is None:
                        await self._run_queued()
        finally:
            if me in self._queue:  # cancelled while waiting: its items are not computed
                self._queue.remove(me)
        return me.outcomes

    async def _run_queued(self) -> None:
        batch: list[_Waiting[Item]] = []
        size = 0
        while self._queue and (not batch or size + len(self._queue[0].items) <= self.max_items):
            waiting = self._queue.pop(0)
            batch.append(waiting)
            size += len(waiting.items)
        try:
            outcomes = await self.run([item for w in batch for item in w.items])
        except BaseException:
            self._queue[:0] = [w for w in batch if w.outcomes is None]  # others may still run them
            raise
        start = 0
        for w in batch:
            w.outcomes = outcomes[start:start + len(w.items)]
            start += len(w.items)
        self._batches += 1
        self._items += size
        self._largest = max(self._largest, size)
        self._requests_largest = max(self._requests_largest, len(batch))
