"""``[security]``: CURVE keys for every socket of a job."""

from __future__ import annotations

from typing import Annotated

from actors.runtime.config.constraints import FilePath, matching
from actors.runtime.config.schema_base import _Section, need


class SecurityConfig(_Section, frozen=True):
    curve: bool = False
    """Encrypt and authenticate every socket of the job with ZeroMQ CURVE: binding sockets are
    CURVE servers, connecting ones clients, and only the job's own key and authorized keys pass."""
    keys_dir: FilePath = ""
    """Where the runner keeps the job's keypairs (``server``, ``client``; default RUN_DIR/keys)."""
    authorized_keys: FilePath = ""
    """A public key file (``NAME.key``, from ``runner.py keygen NAME``) or a directory of them:
    the clients allowed to attach besides the job's own actors. Re-read at every handshake."""
    server_key: Annotated[str, matching(r"(?s:.{40})?", "is not a 40-character Z85 key")] = ""
    """Set by the runner: the job's CURVE server public key (Z85), which attaching workers use."""
    allow_insecure: bool = False
    """Run a job whose ``[hosts]`` are not all private addresses without CURVE (refused unless
    this is true: anyone who reaches the ports could feed it data)."""

    def __post_init__(self) -> None:
        need(self.curve or not self.authorized_keys, "authorized_keys",
             "needs security.curve = true")
