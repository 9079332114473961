"""``[replay]``: the replay buffer: staleness, reuse and the recording."""

from __future__ import annotations

from actors.runtime.config.constraints import NonNegFloat, NonNegInt, PositiveInt
from actors.runtime.config.schema_base import ActorCommon, never_restarted


class ReplayConfig(ActorCommon, frozen=True):
    address: str = "auto"
    """Where samplers and the learner connect (ZeroMQ endpoint, or ``auto``)."""
    capacity: NonNegInt = 256
    """Most scored groups held at once; admission never lets more be in flight."""
    reuse: PositiveInt = 1
    """Serve each group in up to this many batches (one per policy version, while it is within
    algorithm.max_staleness of the version that generated it; so at most max_staleness + 1)."""
    sampler_timeout_s: NonNegFloat = 60.0
    """A sampler silent this long (no request, group or keep-alive: its process hangs or its
    host is cut off) loses its prompts in flight: they are issued again (0: only on restart)."""

    def __post_init__(self) -> None:
        never_restarted(self.restart)
