"""The learner's ranks: which processes form its torch.distributed group, and their environment.

A learner of ``nnodes × nproc_per_node`` ranks is started the way ``torchrun`` starts a job: one
process per rank, each told who it is by the environment variables ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node), ``MASTER_ADDR`` and
``MASTER_PORT`` (where rank 0 serves the rendezvous store). The runner of node ``k`` starts that
node's ranks ``k·nproc_per_node .. (k+1)·nproc_per_node − 1``; rank 0 speaks for the group (it
alone talks to the runner about steps, to the replay buffer and to the samplers).

Torch-free: the runner imports it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Rank:
    """One process of the learner's group."""

    rank: int
    """Global rank, 0 .. world_size − 1 (rank 0 speaks for the group)."""
    world_size: int
    """Processes in the group, all nodes together."""
    local_rank: int
    """Rank on this node: the GPU index it uses (``cuda:LOCAL_RANK``)."""
    local_world_size: int
    """Ranks on this node (``learner.nproc_per_node``)."""
    node_rank: int
    """This node's index, 0 .. nnodes − 1."""
    master_addr: str
    """Host of rank 0's rendezvous store."""
    master_port: int
    """Port of rank 0's rendezvous store."""

    def env(self) -> dict[str, str]:
        """The torchrun environment variables of this rank."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "GROUP_RANK": str(self.node_rank), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Rank:
        """This process's rank from the torchrun variables; a lone rank 0 when they are unset."""
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        return cls(rank=int(env.get("RANK", "0")), world_size=world,
                   local_rank=int(env.get("LOCAL_RANK", "0")), local_world_size=local_world,
                   node_rank=int(env.get("GROUP_RANK", "0")),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                   master_port=int(env.get("MASTER_PORT", "0")))


def node_ranks(nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str,
               master_port: int) -> list[Rank]:
    """The ranks one node starts, in local-rank order."""
    world = nproc_per_node * nnodes
    return [Rank(rank=node_rank * nproc_per_node + local, world_size=world, local_rank=local,
                 local_world_size=nproc_per_node, node_rank=node_rank, master_addr=master_addr,
                 master_port=master_port) for local in range(nproc_per_node)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the rendezvous port of a single-node group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
