"""What a model that sleeps reports: sleeps, time asleep, wake latency, memory freed.

Kept by whatever puts a model to sleep: a vLLM engine (``vllm/sleep.py``: the
sampler's ``sleep_idle_s``, a judge pool's) or a model pool's torch model
(``actors/scoring/sleep.py``). Pure bookkeeping on the monotonic clock; torch-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SleepStatistics:
    asleep: bool
    """Asleep now."""
    sleeps: int
    """Times it went to sleep."""
    asleep_s: float
    """Seconds spent asleep, all sleeps together (the current one so far included)."""
    wake_s: float
    """Seconds the last wake took (0 before any)."""
    wake_s_max: float
    """The longest wake so far."""
    freed_mb: float
    """MiB of parameter memory the last sleep gave back."""

    def status(self) -> dict[str, Any]:
        return {"asleep": self.asleep, "sleeps": self.sleeps,
                "asleep_s": round(self.asleep_s, 2), "wake_ms": round(self.wake_s * 1e3, 1),
                "wake_ms_max": round(self.wake_s_max * 1e3, 1),
                "freed_mb": round(self.freed_mb, 2)}


class SleepClock:
    """The bookkeeping of sleeps and wakes (the model's own calls are the caller's)."""

    def __init__(self) -> None:
        self.asleep_since: float | None = None  # monotonic time it fell asleep; None: awake
        self.sleeps = 0
        self.asleep_total = 0.0  # finished sleeps
        self.wake_s = self.wake_s_max = 0.0
        self.freed = 0  # bytes the last sleep gave back

    def slept(self, freed: int) -> None:
        self.asleep_since, self.freed = time.monotonic(), freed
        self.sleeps += 1

    def woke(self, started: float) -> None:
        now = time.monotonic()
        if self.asleep_since is not None:
            self.asleep_total += started - self.asleep_since
        self.asleep_since = None
        self.wake_s = now - started
        self.wake_s_max = max(self.wake_s_max, self.wake_s)

    def statistics(self) -> SleepStatistics:
        now = time.monotonic()
        current = 0.0 if self.asleep_since is None else now - self.asleep_since
        return SleepStatistics(self.asleep_since is not None, self.sleeps,
                               self.asleep_total + current, self.wake_s, self.wake_s_max,
                               self.freed / 2**20)
