"""Sleep and wake of a vLLM engine on a GPU shared with the learner (``sampler.sleep_idle_s``,
or a judge pool's): when (``SleepPolicy``, pure state) and how (``EngineSleep``, on the engine's
asyncio loop). What a sampler's sleeping engine frees is lent to the learner on its GPU, and
taken back before it wakes (``actors/runtime/memory_lending.py``). vLLM's CPU build has no sleep
mode, so on a CPU only the control flow is tested."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from actors.sampler.engines.sleep_clock import SleepClock

TAKE_BACK_POLL_S = 0.05  # how often a waking engine asks whether the learner gave its memory back


class SleepPolicy:
    """When an engine on a GPU shared with the learner sleeps (pure state; takes ``now``).

    The engine is idle from the moment its last request ends; once idle for ``idle_s`` it may
    sleep, and anything that needs it (a request, a weights load) wakes it first. Invariant:
    ``asleep`` implies no request is in the engine (only ``due`` while idle leads to sleep, and
    ``busy`` ends the idle time before any request is submitted)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.idle_since: float | None = None  # None: busy (a request or a load in progress)
        self.asleep = False

    def busy(self) -> bool:
        """Work is coming: True when the engine must wake for it first."""
        self.idle_since = None
        return self.asleep

    def woke(self) -> None:
        self.asleep = False

    def idle(self, now: float) -> None:
        self.idle_since = now

    def due(self, now: float) -> bool:
        return (self.idle_s > 0 and not self.asleep and self.idle_since is not None
                and now - self.idle_since >= self.idle_s)

    def slept(self) -> None:
        self.asleep = True


class EngineSleep(SleepPolicy):
    """The policy acted on with the engine's ``AsyncLLM``: level 1 sleeps (its weights to host
    memory, its KV cache freed), one sleep or wake at a time, on the engine's asyncio loop."""

    def __init__(self, idle_s: float, lender: Any = None) -> None:
        super().__init__(idle_s)
        self.lender = lender  # a MemoryLender (a sampler's engine on the learner's GPU), or None
        self.clock = SleepClock()  # sleeps, time asleep, wake latency, memory freed
        self.lock = asyncio.Lock()  # one transition at a time (bound to the loop at first use)
        self.task: asyncio.Future | None = None  # puts the engine to sleep once due

    def start(self, llm: Any, running: Callable[[], int]) -> None:
        """On the engine's loop once ``llm`` runs (``running``: its requests now): idle from
        now, asleep once idle ``idle_s`` (0: never)."""
        if self.idle_s > 0:
            self.idle(asyncio.get_running_loop().time())
            self.task = asyncio.ensure_future(self._sleeper(llm, running))

    async def wake(self, llm: Any) -> None:
        """Work is coming (a request, a weights load): wake the engine first if it sleeps."""
        async with self.lock:
            if self.busy():
                started = time.monotonic()
                # the learner may hold the freed memory for the step it is taking
                while self.lender is not None and not self.lender.take_back():  # noqa: ASYNC110
                    await asyncio.sleep(TAKE_BACK_POLL_S)  # (a flag in the host's table)
                await llm.wake_up()
                self.woke()
                self.clock.woke(started)

    async def _sleeper(self, llm: Any, running: Callable[[], int]) -> None:
        """Put the engine to sleep once it is due (checked 4 times per ``idle_s``)."""
        while True:
            await asyncio.sleep(self.idle_s / 4)
            async with self.lock:
                if running() == 0 and self.due(asyncio.get_running_loop().time()):
                    free = await _free_bytes(llm)
                    await llm.sleep(level=1)
                    self.slept()
                    self.clock.slept(freed := max(0, await _free_bytes(llm) - free))
                    if self.lender is not None:
                        self.lender.lend(freed)


async def _free_bytes(llm: Any) -> int:
    """Bytes free on the engine's devices, summed over its workers (on a GPU)."""
    return sum(await llm.collective_rpc("flowrl_free_memory"))
