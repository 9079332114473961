"""The keeper of one actor process on its Ray node: a Ray actor, placed in the job's placement
group with the process's resources, that starts ``python -m actors.main ...`` there with the
GPUs Ray gave it, and reports its exit.

The process dies with its keeper (``PR_SET_PDEATHSIG``): when Ray loses the keeper (its node
gone, the job's Ray stopped) no actor process is left behind. The keeper imports nothing of
the runner but this file, so a Ray worker starts it quickly.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from actors.runtime.config import DEVICE_ENV
from actors.runtime.lifetime import die_with_parent

ROOT = Path(__file__).resolve().parents[3]  # the tree on this node (a Ray working_dir too)


def device_env(assigned: Sequence[object], env: Mapping[str, str]) -> dict[str, str]:
    """A process's variables on its node: ``env`` (the runner's placement among them), with the
    GPUs Ray assigned it, where it assigned any, as its ``CUDA_VISIBLE_DEVICES`` and the first
    of them as its device. Ray's ids number this node's GPUs; the runner's placement numbered
    the cluster's as if on one machine, so only its choice of how many (and its memory share)
    carries over. A process with no GPU keeps the placement's (none: ``cpu``)."""
    if not assigned:
        return dict(env)
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in assigned),
            DEVICE_ENV: "cuda:0"}


class ProcessKeeper:
    """Starts one process on this node, waits for it, passes signals to it."""

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, args: list[str], env: dict[str, str], topology_file: str,
                    log: str) -> tuple[int, str, str]:
        """Start ``python ARGS`` writing to the file ``log``; its pid, this node's address and
        its Ray id. Refuses (RuntimeError) when
        the run directory's topology is not visible here: the run directory must be storage
        every node shares."""
        import ray

        # (blocking calls are fine here: this event loop serves this one keeper)
        if not Path(topology_file).is_file():  # noqa: ASYNC240
            raise RuntimeError(f"{topology_file} cannot be read on node "
                               f"{ray.util.get_node_ip_address()}: run.dir must be a directory "
                               "every Ray node shares (a network file system)")
        # Ray sets OMP_NUM_THREADS in its workers (to their CPUs: 1) where it is unset; the
        # actors size their threads themselves (KIND.threads), as the runner's own children do
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        full = device_env(ray.get_gpu_ids(), {**base, **env})
        with open(log, "ab") as out:  # noqa: ASYNC230 - the child holds its own copy
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, *args, cwd=ROOT, env=full, stdout=out, stderr=out,
                preexec_fn=die_with_parent)
        return (self.process.pid, ray.util.get_node_ip_address(),
                ray.get_runtime_context().get_node_id())

    async def wait(self) -> int:
        assert self.process is not None
        return await self.process.wait()

    async def signal(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signum)
