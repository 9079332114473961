"""``[router]``: the reward requests' dispatch to the reward workers."""

from __future__ import annotations

from actors.runtime.config.constraints import PositiveFinite
from actors.runtime.config.schema_base import ActorCommon


class RouterConfig(ActorCommon, frozen=True):
    address: str = "auto"
    """Where samplers send scoring requests (ZeroMQ endpoint, or ``auto``)."""
    worker_address: str = "auto"
    """Where reward workers connect (ZeroMQ endpoint, or ``auto``)."""
    request_timeout: PositiveFinite = 60.0
    """Seconds before a request in flight at a worker is re-sent elsewhere."""
