"""Process entry point of one actor: ``python -m actors.main RUN_DIR KIND INDEX``.

The runner writes the resolved topology to ``RUN_DIR/topology.json`` and starts one process per
actor instance with this command. Actor bodies are imported lazily by the registry's rows, so
the router and the replay buffer never import torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import msgspec

from actors.registry import BY_NAME
from actors.runtime.actor import exit_process, hold_stop_signals, run_actor
from actors.runtime.config import ProcessName, Topology
from actors.runtime.ranks import Rank
from actors.runtime.rundir import TOPOLOGY
from actors.runtime.security import job_keys


def main(argv: list[str]) -> int:
    hold_stop_signals()  # the runner's SIGTERM while the body's imports load stops it, not kills it
    if len(argv) != 3 or argv[1] not in BY_NAME:
        sys.stderr.write(f"usage: python -m actors.main RUN_DIR {{{','.join(BY_NAME)}}} INDEX\n")
        return 2
    run_dir, kind, index = Path(argv[0]), argv[1], int(argv[2])
    # a learner rank on a node k > 0, or an actor of a host other than the owner's, reads its own
    # runner's copy (``FLOWRL_TOPOLOGY``)
    path = Path(os.environ.get("FLOWRL_TOPOLOGY") or run_dir / TOPOLOGY)
    topology = msgspec.json.decode(path.read_bytes(), type=Topology)
    body = BY_NAME[kind].load()
    rank = Rank.from_env().rank if kind == "learner" else 0  # the runner's RANK for each rank
    return run_actor(kind, index, topology, run_dir, body,
                     name=str(ProcessName(kind, index, rank)), curve=job_keys(topology))


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
