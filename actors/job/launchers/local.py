"""The local launcher: this runner starts each process on its own machine (the whole job, or
with ``[hosts]`` this host's share, whose ``auto`` addresses are the hosts' own).

On a machine without GPUs the actors are forked from one server process that imported torch,
transformers and the job's actor bodies once (``forkserver.py``: a small job's start is mostly
those imports, paid once instead of once per process); with GPUs each actor is started with its
own interpreter. ``FLOWRL_FORKSERVER=0`` starts every actor with its own interpreter anywhere."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from actors.job.config.hosts import resolve_addresses
from actors.job.launchers.base import ACTOR_ENV, ENTRY, ROOT, Child, Launcher
from actors.job.launchers.forkserver import ForkServer
from actors.runtime.config import Topology, visible_gpus


class LocalLauncher(Launcher):
    def __init__(self, topology: Topology | None = None) -> None:
        self.topology = topology
        self.server: ForkServer | None = None

    def addresses(self, topology: Topology, names: Sequence[str]) -> Topology:
        return resolve_addresses(topology)  # with [hosts]: auto -> tcp://IP:PORT

    async def spawn(self, name: str, args: Sequence[str], env: dict[str, str],
                    log: Path | None) -> Child:
        full = {**os.environ, **env}
        if args[:2] == ["-m", ENTRY] and self._forking():
            assert self.server is not None
            try:
                return await self.server.spawn(args[2:], full, log, ROOT)
            except OSError as exc:  # started as below instead; the job goes on
                print(f"!!! {exc}: {name} starts with its own interpreter", flush=True)
        cmd = [sys.executable, *args]
        if log is None:
            return await trio.lowlevel.open_process(cmd, cwd=ROOT, env=full)
        with log.open("ab") as out:
            return await trio.lowlevel.open_process(cmd, cwd=ROOT, env=full, stdout=out,
                                                    stderr=out)

    def _forking(self) -> bool:
        if self.server is None:
            if (self.topology is None or os.environ.get("FLOWRL_FORKSERVER") == "0"
                    or visible_gpus()):
                return False
            self.server = ForkServer(*preload(self.topology), ACTOR_ENV, ROOT)
        return not self.server.dead

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def preload(topology: Topology) -> tuple[list[str], str, list[str]]:
    """What the fork server imports for ``topology``'s actors: the body of each kind the job has,
    the model's architecture, and the sampler's engine's modules (its row's ``preload``)."""
    from actors.registry import NAMES

    kinds = [k for k in NAMES if k == "learner" or getattr(topology, k).count]
    preload = topology.sampler.engine.preload if topology.sampler.count else ()
    return kinds, topology.model.path, list(preload)
