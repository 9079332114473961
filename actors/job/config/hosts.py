"""A job over several machines: the ``[hosts]`` table, where each actor runs, and its addresses.

```toml
[hosts]                        # names -> addresses (IP or DNS name)
trainer = "10.0.0.5"
gen1 = "10.0.0.6"
[sampler]
count = 2
host = ["trainer", "gen1"]     # one name per process, or one name for all
```

Every machine runs ``runner.py topology.toml --host NAME`` (``run.host``) and starts only the
actors placed on NAME. The replay buffer's host owns the job: it keeps the run directory's
records, the status and the console, and the other hosts' runners report to it. Actors with no
``host`` run on the owner; the replay buffer with none runs on the first host of the table.

Addresses left ``auto`` become ``tcp://IP:PORT`` on the host of the actor that binds them, the
same on every machine: ``run.base_port + PORTS[socket]``, and ``run.base_port + 10 + i`` for the
runner of the i-th host (each host's actors report to their own runner). Ports differ per socket,
so several hosts may share one address (a test on one machine). Nothing here opens a socket.
"""

from __future__ import annotations

import ipaddress
import re
import socket

import msgspec

from actors.registry import NAMES
from actors.runtime.config import ConfigError, Topology, need

PORTS = {"replay.address": 0, "router.address": 1, "router.worker_address": 2,
         "learner.weights_address": 3}
MASTER_PORT = 4  # the learner's rendezvous port (torch.distributed) when it spans nodes
CONTROL_PORT = 10  # + the host's index in the table
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def placement(topology: Topology, kind: str) -> list[str]:
    """The host of each process of ``kind`` (index order); empty names without ``[hosts]``."""
    if kind == "learner":
        return learner_nodes(topology)[:1]  # node 0 holds the learner's rank 0
    section = getattr(topology, kind)
    host = section.host
    if isinstance(host, list):
        return list(host)
    if not host and topology.hosts:
        host = owner(topology) if kind != "replay" else next(iter(topology.hosts))
    return [host] * section.count


def learner_nodes(topology: Topology) -> list[str]:
    """The host of each node of the learner (``learner.host``: one name per node when it spans
    ``learner.nnodes`` of them; ``--host NAME`` on ``learner.host[k]`` runs node k's ranks)."""
    L = topology.learner
    if isinstance(L.host, list):
        return list(L.host)
    host = L.host or (owner(topology) if topology.hosts else "")
    return [host] * L.nnodes


def owner(topology: Topology) -> str:
    """The host that runs the replay buffer: it owns the run directory and the job's status."""
    return placement(topology, "replay")[0] if topology.hosts else ""


def local_actors(topology: Topology) -> list[tuple[str, int]]:
    """``(kind, index)`` of the actors this runner starts (all of them without ``[hosts]``)."""
    here = topology.run.host
    return [(kind, i) for kind in NAMES for i, h in enumerate(placement(topology, kind))
            if not topology.hosts or h == here]


def host_of(topology: Topology, kind: str, index: int) -> str:
    """The host of process ``index`` of ``kind`` (empty without ``[hosts]``)."""
    hosts = placement(topology, kind)
    return hosts[index] if index < len(hosts) else ""


def host_ip(address: str) -> str:
    """The IPv4 address ZeroMQ binds and connects to for a host's ``address``."""
    try:
        return str(socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0])
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"cannot resolve {address!r}: {exc}") from None


def control_address(topology: Topology, host: str) -> str:
    """Where the runner of ``host`` listens for its actors (and, on the owner, other runners)."""
    index = list(topology.hosts).index(host)
    return f"tcp://{host_ip(topology.hosts[host])}:{topology.run.base_port + CONTROL_PORT + index}"


def check_hosts(topology: Topology) -> None:
    """The placement keys; ``need(ok, key, why)`` raises a ``ConfigError`` naming the key."""
    hosts, run = topology.hosts, topology.run
    for kind in NAMES:
        host = getattr(topology, kind).host
        need(not host or bool(hosts), f"{kind}.host", "needs a [hosts] table naming the hosts")
    need(not run.host or bool(hosts), "run.host", "--host needs a [hosts] table in the topology")
    need(topology.learner.nnodes == 1 or topology.learner.master_port > 0 or bool(hosts),
         "learner.master_port", "several nodes must agree on the rendezvous port: set it")
    if not hosts:
        return
    for name, address in hosts.items():
        need(NAME.fullmatch(name) is not None, f"hosts.{name}",
             "a host name is letters, digits, '_', '.' or '-'")
        need(bool(address) and "/" not in address and ":" not in address, f"hosts.{name}",
             f"{address!r} is not an IP address or a DNS name (no scheme, no port)")
    need(topology.learner.node_rank == 0, "learner.node_rank",
         "is set by --host with [hosts]: the runner of learner.host[k] runs node k")
    for kind in NAMES:
        section = getattr(topology, kind)
        names = placement(topology, kind)
        if kind == "learner":
            nodes = learner_nodes(topology)
            need(len(nodes) == topology.learner.nnodes, "learner.host",
                 f"lists {len(nodes)} hosts for learner.nnodes = {topology.learner.nnodes} nodes")
            need(len(set(nodes)) == len(nodes) or len(nodes) == 1, "learner.host",
                 "names a host twice: one learner node per host")
            names = nodes
        elif isinstance(section.host, list):
            key = f"{kind}.{getattr(section, 'count_key', 'count')}"  # (teacher.replicas)
            need(len(names) == section.count, f"{kind}.host",
                 f"lists {len(names)} hosts for {key} = {section.count} processes")
        for name in names:
            need(name in hosts, f"{kind}.host",
                 f"{name!r} is not a host of [hosts] ({', '.join(hosts)})")
    others = {h for kind in NAMES if kind != "learner" for h in placement(topology, kind)}
    for k, name in enumerate(learner_nodes(topology)[1:], start=1):
        need(name not in others and name in hosts, "learner.host",
             f"{name!r} runs learner node {k}: its runner starts only the learner's ranks there, "
             "so no other actor may be placed on it")
    need(not run.host or run.host in hosts, "run.host",
         f"--host {run.host!r} is not a host of [hosts] ({', '.join(hosts)})")
    need("{time}" not in run.dir, "run.dir",
         "every host's runner must name the same run directory: set run.dir (no {time})")
    need(run.base_port + CONTROL_PORT + len(hosts) < 65536, "run.base_port",
         "must leave room for the job's ports below 65536")
    for key in (*PORTS, "control_address"):
        value = _get(topology, key)
        need(value == "auto" or value.startswith("tcp://"), key,
             f"{value!r} cannot be reached from other hosts: use auto or tcp://HOST:PORT")
    need(topology.control_address == "auto", "control_address",
         "must be auto with [hosts] (each host's runner listens on its own port)")
    sec = topology.security
    if not sec.curve and not sec.allow_insecure:
        public = [f"{name} = {address!r}" for name, address in hosts.items()
                  if not _private(address)]
        need(not public, "security.curve",
             f"hosts {', '.join(public)} are not private addresses: a job across them needs "
             "[security] curve = true (or security.allow_insecure = true to run it in the clear)")


def _private(address: str) -> bool:
    """Whether ``address`` resolves to private or loopback IPs only (a name that does not
    resolve is not known to be private)."""
    try:
        infos = socket.getaddrinfo(address, None)
    except (socket.gaierror, UnicodeError):
        return False
    ips = {ipaddress.ip_address(info[4][0]) for info in infos}
    return all(ip.is_private or ip.is_loopback for ip in ips)


def _get(topology: Topology, key: str) -> str:
    section, _, field = key.rpartition(".")
    return getattr(getattr(topology, section) if section else topology, field)


def resolve_addresses(topology: Topology) -> Topology:
    """Each ``auto`` address as ``tcp://IP:PORT`` on the host of the actor that binds it, and
    ``control_address`` as this runner's own (``run.host``; the owner's when it is unset)."""
    if not topology.hosts:
        return topology
    base = topology.run.base_port

    def addr(key: str, kind: str) -> str:
        value = _get(topology, key)
        if value != "auto":
            return value
        return f"tcp://{host_ip(topology.hosts[placement(topology, kind)[0]])}:{base + PORTS[key]}"

    rep = msgspec.structs.replace
    L, nodes = topology.learner, learner_nodes(topology)
    return rep(
        topology,
        replay=rep(topology.replay, address=addr("replay.address", "replay")),
        router=rep(topology.router, address=addr("router.address", "router"),
                   worker_address=addr("router.worker_address", "router")),
        learner=rep(
            L, weights_address=addr("learner.weights_address", "learner"),
            node_rank=nodes.index(topology.run.host) if topology.run.host in nodes else 0,
            # the rendezvous is on node 0's host, unless the topology says where
            master_addr=host_ip(topology.hosts[nodes[0]]) if L.master_addr == "127.0.0.1"
            else L.master_addr, master_port=L.master_port or base + MASTER_PORT),
        control_address=control_address(topology, topology.run.host or owner(topology)),
    )
