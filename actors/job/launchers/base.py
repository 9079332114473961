"""The launcher seam: what starts the job's processes (``Launcher``) and what it hands back
(``Child``).

A launcher does two things for the runner: before the topology is written, it fills in the
addresses the actors bind where it knows the machines (``addresses``: with ``[hosts]``, each
host's; under Ray, the node each process was given), and then it starts each process
(``spawn``) and hands back a ``Child`` the supervisor waits on, signals and restarts exactly as
it does a local process. What the actors say to each other and to the runner never passes
through a launcher: it stays msgspec over ZeroMQ.

Each launcher is one file (``local.py``, ``ray.py``) and one row of ``table.LAUNCHERS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from actors.runtime.config import Topology

ROOT = Path(__file__).resolve().parents[3]  # the tree the actor processes import
ENTRY = "actors.main"  # every actor process runs ``python -m ENTRY RUN_DIR KIND INDEX``
# in every actor's environment: progress bars of libraries an actor uses (weights loading,
# saving) are noise in a log (read as their libraries are imported)
ACTOR_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


# why a process is gone, as its launcher knows it (``exit_cause``): its own failure (what
# ``max_restarts`` counts), the loss of the node it ran on (restarted where there is room, not
# counted), or no node left with room for it (the job stops, resumable)
FAILED, NODE_LOST, NO_ROOM = "failure", "node lost", "no room"


def exit_cause(child: Child) -> str:
    """Why ``child`` exited: its launcher's ``cause`` (``FAILED`` for a local process)."""
    return getattr(child, "cause", FAILED)


class Child(Protocol):
    """One started process as the supervisor sees it (``trio.Process`` is one). A launcher's
    own child may say why it ended (a ``cause`` attribute: ``exit_cause``)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Launcher(ABC):
    """Starts the processes of one runner's share of a job."""

    def addresses(self, topology: Topology, names: Sequence[str]) -> Topology:
        """``topology`` with the ``auto`` addresses this launcher knows how to fill in, for the
        processes ``names`` it will start (the rest become ``ipc://`` sockets on this host)."""
        return topology

    def gpus(self) -> list[str] | None:
        """The GPUs the processes are placed on (None: those this runner sees)."""
        return None

    @abstractmethod
    async def spawn(self, name: str, args: Sequence[str], env: dict[str, str],
                    log: Path | None) -> Child:
        """Start ``python ARGS`` for process ``name`` from the project's tree, with ``env``
        over the environment of the machine it runs on, writing to ``log`` (None: this
        runner's own output)."""

    def close(self) -> None:  # noqa: B027 - a launcher that holds nothing keeps this one
        """Release what the launcher holds for the job (nothing for a local one)."""
