"""The launcher seam: what starts the job's processes, the table of launchers, and the one
place one is chosen.

A launcher does two things for the runner: before the topology is written, it fills in the
addresses the actors bind where it knows the machines (``addresses``: with ``[hosts]``, each
host's; under Ray, the node each process was given), and then it starts each process
(``spawn``) and hands back a ``Child`` the supervisor waits on, signals and restarts exactly as
it does a local process. What the actors say to each other and to the runner never passes
through a launcher: it stays msgspec over ZeroMQ.

Each launcher is one file (``local.py``, ``ray.py``) and one row of ``LAUNCHERS``: its
options are a section of the topology (``[ray]``), its checks run with the topology's
(``check``), its availability is ``problem``, and ``run.launcher`` picks it (``launcher_for``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class LauncherRow:
    """What the system knows of a launcher without importing its file."""

    name: str  # run.launcher
    build: Callable[[Topology], Launcher]  # the launcher for a job (its file imported then)
    check: Callable[[Topology], None]  # its keys (schema_base.need names a bad one)
    problem: Callable[[], str | None] = lambda: None  # why it cannot run here, or None
    # its one runner places processes on other machines: weights go by zmq, and it starts
    # every node of a learner over several (a local runner starts only its own node's ranks)
    across_nodes: bool = False


def _local(topology: Topology) -> Launcher:
    from actors.job.launchers.local import LocalLauncher

    return LocalLauncher(topology)


def _check_local(topology: Topology) -> None:
    from actors.job.config.hosts import check_hosts

    check_hosts(topology)


def _ray(topology: Topology) -> Launcher:
    from actors.job.launchers.ray import RayLauncher  # Ray: only when the job uses it

    return RayLauncher(topology)


def _check_ray(topology: Topology) -> None:
    from actors.job.launchers.ray_checks import check_ray

    check_ray(topology)


def _ray_problem() -> str | None:
    from actors.runtime.config.ray import ray_problem

    return ray_problem()


LAUNCHERS: dict[str, LauncherRow] = {row.name: row for row in (
    LauncherRow("local", _local, _check_local),
    LauncherRow("ray", _ray, _check_ray, _ray_problem, across_nodes=True),
)}


def launcher_for(topology: Topology) -> Launcher:
    """The launcher ``run.launcher`` names, built for ``topology``; a ConfigError naming the key
    where it cannot run here. Asked by the runner alone: a worker attached to the job from
    another machine reads the same topology and needs no launcher."""
    from actors.runtime.config import ConfigError

    row = LAUNCHERS[topology.run.launcher]
    problem = row.problem()
    if problem is not None:
        raise ConfigError(f"run.launcher: {row.name}: {problem}")
    return row.build(topology)
