"""The launchers, one row each, and the one place one is chosen.

Each launcher is one file (``local.py``, ``ray.py``: a ``base.Launcher``) and one row of
``LAUNCHERS``, which loads its file only when the job uses it: its options are a section of the
topology (``[ray]``), its checks run with the topology's (``check``), its availability is
``problem``, and ``run.launcher`` picks it (``launcher_for``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.job.launchers.base import Launcher
    from actors.runtime.config import Topology


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
    from actors.runtime.config import ray_problem

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
