"""The Ray launcher's section, ``[ray]``, and whether Ray can run here.

Ray places and starts the job's processes (``actors/job/launchers/ray.py``); the section lives
here because the topology's schema, which every actor reads, never imports the runner. Needs
no Ray: the config reads it, and ``ray_problem`` says what to install where Ray is missing.
"""

from __future__ import annotations

from typing import Annotated, Literal

from actors.runtime.config.constraints import PositiveFloat, PositiveInt, matching
from actors.runtime.config.schema_base import _Section

EXTRA = "pip install 'flowrl[ray]'"
# "" (a Ray started for the job), auto, ray://HOST:PORT (Ray Client) or HOST:PORT (the GCS)
Address = Annotated[str, matching(r"|auto|ray://[^/\s:]+:\d+|[^/\s:]+:\d+",
                                  "is not '', auto, ray://HOST:PORT or HOST:PORT")]


def ray_problem() -> str | None:
    """Why the Ray launcher cannot run here (with the command that installs Ray), or None."""
    from importlib.util import find_spec

    if find_spec("ray") is None:
        return f"Ray is not installed: {EXTRA}"
    return None


class RayOptions(_Section, frozen=True):
    address: Address = ""
    """The Ray cluster the runner joins as a driver: ``auto`` (the one this machine belongs to,
    as in ``ray job submit``), ``ray://HOST:10001`` (Ray Client), ``HOST:6379``, or empty: a
    single-node Ray started for the job on this machine and stopped with it."""
    namespace: str = "flowrl"
    """The Ray namespace of the job's Ray actors."""
    cpus: PositiveFloat = 1.0
    """CPUs reserved on its node for each actor process (a learner rank, a sampler, ...)."""
    strategy: Literal["PACK", "SPREAD"] = "PACK"
    """How the processes other than the learner's ranks go over the nodes: as few nodes as
    fit them, or as many (a learner's ranks always share one node, in rank order)."""
    reserve_timeout_s: PositiveFloat = 300.0
    """How long the runner waits for the cluster to grant the job's resources."""
    temp_dir: str = ""
    """A Ray started for the job: its temp directory (default: a fresh folder under /tmp,
    removed when the job ends; Ray's socket paths must stay under ~100 bytes)."""
    object_store_mb: PositiveInt = 100
    """A Ray started for the job: its object store (flowrl's messages never pass through it)."""
