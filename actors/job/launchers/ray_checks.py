"""The Ray launcher's checks of a topology (``run.launcher = "ray"``), run with the others before
anything starts; they need no Ray and no cluster (what the cluster has is checked when the
runner reserves it, ``ray.py``), so a worker attached from a machine without Ray reads the
job's topology as it is (whether Ray is installed is the runner's question: ``launcher_for``)."""

from __future__ import annotations

from actors.job.config.hosts import NAME, PORTS, _get
from actors.registry import NAMES
from actors.runtime.config import Topology, need


def check_ray(topology: Topology) -> None:
    """``need(ok, key, why)`` raises a ``ConfigError`` naming the key (a bad key first: it is
    bad with Ray or without)."""
    need(not topology.hosts, "hosts",
         "not used under run.launcher = ray: Ray knows the nodes (a KIND.host names a custom "
         "resource of the Ray nodes that may run it)")
    need(not topology.run.host, "run.host", "--host is for [hosts]; under Ray one runner starts "
         "the whole job")
    L = topology.learner
    need(L.node_rank == 0, "learner.node_rank",
         "is not set under Ray: the one runner starts every learner node's ranks")
    need(not isinstance(L.host, list) or len(L.host) == L.nnodes, "learner.host",
         f"lists {len(L.host) if isinstance(L.host, list) else 1} resources for "
         f"learner.nnodes = {L.nnodes} nodes (one per node, or one name for all)")
    for kind in NAMES:
        section = getattr(topology, kind)
        hosts = section.host if isinstance(section.host, list) else [section.host]
        if isinstance(section.host, list) and kind != "learner":
            key = f"{kind}.{getattr(section, 'count_key', 'count')}"
            need(len(hosts) == section.count, f"{kind}.host",
                 f"lists {len(hosts)} resources for {key} = {section.count} processes")
        for host in hosts:
            need(not host or NAME.fullmatch(host) is not None, f"{kind}.host",
                 f"{host!r} is not a Ray resource name (letters, digits, '_', '.' or '-')")
    for key in (*PORTS, "control_address"):
        value = _get(topology, key)
        need(value == "auto" or value.startswith("tcp://"), key,
             f"{value!r} cannot be reached from other Ray nodes: use auto (the node's own "
             "address, port from run.base_port) or tcp://HOST:PORT")
