"""The local launcher: this runner starts each process on its own machine (the whole job, or
with ``[hosts]`` this host's share, whose ``auto`` addresses are the hosts' own)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from actors.job.config.hosts import resolve_addresses
from actors.job.launchers.base import ROOT, Child, Launcher
from actors.runtime.config import Topology


class LocalLauncher(Launcher):
    def addresses(self, topology: Topology, names: Sequence[str]) -> Topology:
        return resolve_addresses(topology)  # with [hosts]: auto -> tcp://IP:PORT

    async def spawn(self, name: str, args: Sequence[str], env: dict[str, str],
                    log: Path | None) -> Child:
        cmd, full = [sys.executable, *args], {**os.environ, **env}
        if log is None:
            return await trio.lowlevel.open_process(cmd, cwd=ROOT, env=full)
        with log.open("ab") as out:
            return await trio.lowlevel.open_process(cmd, cwd=ROOT, env=full, stdout=out,
                                                    stderr=out)
