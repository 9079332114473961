"""What the Ray launcher asks the cluster for, as plain data: each process's resources and the
placement-group bundles they go in (``ray.py`` reserves them). Pure: no Ray, no cluster (the
cluster's resources come in as a dict), so the rules are tested on made-up clusters.

- A process reserves ``ray.cpus`` CPUs, the GPUs the runner's placement gave it
  (``gpu_request``), and a small share of the custom resource its ``KIND.host`` names.
- A learner node's ranks share one bundle (so they land on one Ray node, in rank order), and
  the learner's nodes go on Ray nodes of their own (``STRICT_SPREAD``); every other process has
  a bundle of its own, placed by ``ray.strategy``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from actors.runtime.config import ConfigError, PlacedProcess, ProcessName, Topology

HOST_SHARE = 0.001  # of a KIND.host resource per process: a node's resource serves them all

Wanted = list[tuple[list[str], dict[str, float]]]  # per bundle: its processes, its resources


@dataclass(frozen=True)
class Plan:
    """The job's reservation: what each process asks for, and the groups of bundles."""

    needs: dict[str, dict[str, float]]  # process -> its own resources
    groups: list[tuple[str, Wanted]]  # (strategy, bundles) per placement group, learner first


def plan_bundles(topology: Topology, names: Sequence[str], placed: Mapping[str, PlacedProcess],
                 have: Mapping[str, float]) -> Plan:
    """The reservation of the processes ``names`` on a cluster with resources ``have``
    (``ray.cluster_resources()``); a ConfigError names a ``KIND.host`` no node has."""
    needs: dict[str, dict[str, float]] = {}
    nodes: dict[int, list[str]] = {}  # learner node -> its ranks, in rank order
    others: Wanted = []
    for name in names:
        kind = ProcessName.parse(name).kind
        host = host_resource(topology, kind, name)
        if host and host not in have:
            raise ConfigError(f"{kind}.host: no node of the Ray cluster has the resource "
                              f"{host!r} (it has {', '.join(sorted(have))})")
        resources = {"CPU": topology.ray.cpus}
        if gpu := gpu_request(placed.get(name)):
            resources["GPU"] = gpu
        if host:
            resources[host] = HOST_SHARE
        needs[name] = resources
        if kind == "learner":
            nodes.setdefault(learner_node(topology, name), []).append(name)
        else:
            others.append(([name], resources))
    learner: Wanted = [(ranks, summed(needs[n] for n in ranks))
                       for _, ranks in sorted(nodes.items())]
    groups = [(s, w) for s, w in (("STRICT_SPREAD", learner), (topology.ray.strategy, others)) if w]
    return Plan(needs, groups)


def gpu_request(placed: PlacedProcess | None) -> float:
    """The GPUs a process reserves: none on a CPU; its memory share of a GPU it shares (a Ray
    fraction of one GPU: processes sharing it fit together); else its GPUs, whole (Ray's
    fractions are of one GPU, so a process over several shared GPUs takes them whole)."""
    if placed is None or not placed.gpus:
        return 0.0
    if len(placed.gpus) == 1 and placed.memory_share:
        return placed.memory_share
    return float(len(placed.gpus))


def host_resource(topology: Topology, kind: str, name: str) -> str:
    """The custom resource ``KIND.host`` names for process ``name`` (empty: none): one per
    process, or for the learner one per node."""
    host = getattr(topology, kind).host
    if isinstance(host, list):
        index = learner_node(topology, name) if kind == "learner" else \
            ProcessName.parse(name).index
        return host[index] if index < len(host) else ""
    return host


def learner_node(topology: Topology, name: str) -> int:
    """The learner node of rank process ``name`` (``learner-0`` or ``learner-0.rankR``): node
    k holds ranks k·nproc_per_node .. (k+1)·nproc_per_node − 1, as torchrun numbers them."""
    return ProcessName.parse(name).rank // topology.learner.nproc_per_node


def summed(resources: Iterable[dict[str, float]]) -> dict[str, float]:
    """The resources of several processes sharing one bundle."""
    total: dict[str, float] = {}
    for r in resources:
        for key, amount in r.items():
            total[key] = total.get(key, 0.0) + amount
    return total
