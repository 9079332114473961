"""The Ray launcher: the runner is a Ray driver; Ray reserves each process's resources, puts it
on a node, starts it there and tells the runner when the node is gone.

At the start (``addresses``) the runner joins the cluster named by ``ray.address`` (or starts
a Ray of its own on this machine), reserves placement-group bundles (``ray_plan.py``: one per
learner node, holding that node's ranks, each on a Ray node of its own; one per other process,
by ``ray.strategy``; a ``KIND.host`` adds that custom resource), and gives every ``auto``
address the address of the node that binds it, with the ports ``run.base_port`` says, and the
learner's rendezvous the address of rank 0's node. Each process is then started by a keeper in
its bundle (``ray_host.py``) with the GPUs Ray gave it. When a keeper is lost (its node died) its process
counts as killed: the supervisor restarts it per its kind's ``restart`` policy, in the same
bundle, which Ray moves to a node with room; a lost replay buffer, router or learner stops the
job (``runner.py ... run.dir=...`` resumes it). Messages never pass through Ray.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from actors.job.config.hosts import CONTROL_PORT, MASTER_PORT, PORTS, _get
from actors.job.config.layout import place
from actors.job.launchers.base import FAILED, NO_ROOM, NODE_LOST, Child, Launcher
from actors.job.launchers.ray_plan import Wanted, plan_bundles
from actors.runtime.config import ConfigError, Topology
from actors.runtime.rundir import LOGS, TOPOLOGY


@dataclass
class Bundle:
    """One process's reservation: the bundle it is placed in (a learner node's ranks share
    one), its own resources there, and where the cluster put them."""

    group: Any  # its ray.util.placement_group.PlacementGroup
    index: int
    resources: dict[str, float]  # the process's own share of the bundle
    node: str = ""  # the node's address, once reserved
    node_id: str = ""  # its Ray id


class RayChild:
    """A process started by its keeper on a Ray node (a ``Child`` for the supervisor)."""

    def __init__(self, name: str, keeper: Any, pid: int, node: str, node_id: str) -> None:
        self.name, self.keeper, self.pid, self.node = name, keeper, pid, node
        self.node_id = node_id  # the Ray node it runs on
        self.returncode: int | None = None
        self.cause = FAILED  # why it ended: its own exit, or NODE_LOST with its keeper
        self._exit = keeper.wait.remote()

    def _result(self) -> int:
        import ray
        from ray.exceptions import RayActorError

        try:
            return int(ray.get(self._exit))
        except RayActorError as exc:  # its keeper is gone, and with it the process: the
            # keeper does nothing but wait, so what took it is its node (or its raylet)
            self.cause = NODE_LOST
            print(f"!!! ray: {self.name} lost with its keeper on node {self.node} "
                  f"({type(exc).__name__}: the node died or left the cluster)", flush=True)
            return -signal.SIGKILL

    async def wait(self) -> int:
        if self.returncode is None:
            code = await trio.to_thread.run_sync(self._result, abandon_on_cancel=True)
            self.returncode = code if self.returncode is None else self.returncode
        return self.returncode

    def terminate(self) -> None:
        self.keeper.signal.remote(signal.SIGTERM)

    def kill(self) -> None:
        self.keeper.signal.remote(signal.SIGKILL)


class NotStarted:
    """A process its keeper could not start (the reason is printed): it exits at once with 1,
    for ``cause`` (``NO_ROOM``: no live node can hold its reservation)."""

    pid = 0
    returncode = 1

    def __init__(self, cause: str = FAILED) -> None:
        self.cause = cause

    async def wait(self) -> int:
        return 1

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass


class RayLauncher(Launcher):
    def __init__(self, topology: Topology) -> None:
        self.options = topology.ray
        self.temp: str | None = None  # a Ray started for the job: its temp dir, removed at close
        self.bundles: dict[str, Bundle] = {}
        self.needs: dict[str, dict[str, float]] = {}  # each process's own resources
        self.groups: list[Any] = []
        self.keepers: dict[str, Any] = {}
        self.children: dict[str, RayChild] = {}  # each process's last start
        self.unborn: dict[str, str] = {}  # a process whose start its node's loss cut short:
        # that node's id (its next start waits for the bundle to move, as after a loss)
        self.cluster_gpus = 0
        self.topology_file = ""

    def connect(self, processes: int) -> None:
        import ray

        o = self.options
        if o.address:
            reachable(o.address)
            try:
                ray.init(address=o.address, namespace=o.namespace, log_to_driver=True)
            except ConnectionError as exc:  # auto with no cluster here, among others
                raise ConfigError(f"ray.address: cannot join {o.address!r}: {exc}") from None
        else:
            self.temp = o.temp_dir or tempfile.mkdtemp(prefix="flowrl-ray-", dir="/tmp")
            # Ray's CPUs are counted, not pinned: room for every process however many cores
            ray.init(namespace=o.namespace, include_dashboard=False, _temp_dir=self.temp,
                     num_cpus=max(os.cpu_count() or 1, int(processes * o.cpus + 1)),
                     object_store_memory=o.object_store_mb * 2**20, log_to_driver=True)
        self.cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
        print(f"=== ray: joined {ray.get_runtime_context().gcs_address} "
              f"({len([n for n in ray.nodes() if n['Alive']])} nodes); each actor's output goes "
              f"to RUN_DIR/{LOGS}/NAME.log", flush=True)

    def gpus(self) -> list[str]:
        return [str(i) for i in range(self.cluster_gpus)]

    def addresses(self, topology: Topology, names: Sequence[str]) -> Topology:
        """Join the cluster, reserve every process's bundle, and fill in the addresses."""
        import ray

        self.connect(len(names))
        self.topology_file = str(Path(topology.run.dir) / TOPOLOGY)
        placed = {p.name: p for p in place(topology, names, self.gpus())}
        plan = plan_bundles(topology, names, placed, ray.cluster_resources())
        self.needs = plan.needs
        for strategy, wanted in plan.groups:
            self.reserve(wanted, strategy)
        return self.fill(topology)

    def reserve(self, wanted: Wanted, strategy: str) -> None:
        """One bundle per entry of ``wanted``: its processes and the resources they share."""
        from ray.util.placement_group import placement_group

        if not wanted:
            return
        group = placement_group([r for _, r in wanted], strategy=strategy)
        self.groups.append(group)
        if not group.wait(timeout_seconds=self.options.reserve_timeout_s):
            import ray

            need = "; ".join(f"{'+'.join(n)}: {r}" for n, r in wanted)
            raise ConfigError(
                f"ray.reserve_timeout_s: the cluster did not grant the job's resources within "
                f"{self.options.reserve_timeout_s:g}s ({strategy} of {need}; the cluster has "
                f"{ray.available_resources()} free)")
        for index, (names, _) in enumerate(wanted):
            for name in names:
                self.bundles[name] = Bundle(group, index, self.needs[name])
        self.locate(group)
        print("=== ray: " + "; ".join(f"{n} on {where(self.bundles[n].node, self.bundles[n].node_id)}"
                                      for names, _ in wanted for n in names), flush=True)

    def locate(self, group: Any) -> None:
        """Each bundle of ``group``'s node address (bundles move when a node dies)."""
        import ray
        from ray.util.placement_group import placement_group_table

        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        where = placement_group_table(group)["bundles_to_node_id"]
        for bundle in self.bundles.values():
            if bundle.group is group and bundle.index in where:
                bundle.node_id = where[bundle.index]
                bundle.node = nodes.get(bundle.node_id, "")

    def fill(self, topology: Topology) -> Topology:
        """Every ``auto`` address as ``tcp://NODE:PORT`` on the node of the process binding it,
        and the runner's own on this machine."""
        import ray

        base, rep = topology.run.base_port, msgspec.structs.replace

        def addr(key: str, name: str) -> str:
            value = _get(topology, key)
            return value if value != "auto" else \
                f"tcp://{self.bundles[name].node}:{base + PORTS[key]}"

        L = topology.learner
        control = topology.control_address
        if control == "auto":
            control = f"tcp://{ray.util.get_node_ip_address()}:{base + CONTROL_PORT}"
        return rep(
            topology,
            replay=rep(topology.replay, address=addr("replay.address", "replay-0")),
            router=rep(topology.router, address=addr("router.address", "router-0"),
                       worker_address=addr("router.worker_address", "router-0")),
            # the rendezvous on rank 0's node, as with [hosts], unless the topology says where
            learner=rep(L, weights_address=addr("learner.weights_address", "learner-0"),
                        master_addr=self.bundles["learner-0"].node
                        if L.master_addr == "127.0.0.1" else L.master_addr,
                        master_port=L.master_port or base + MASTER_PORT),
            control_address=control)

    async def spawn(self, name: str, args: Sequence[str], env: dict[str, str],
                    log: Path | None) -> Child:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.job.launchers.ray_host import ProcessKeeper

        bundle = self.bundles[name]
        custom = {k: v for k, v in bundle.resources.items() if k not in ("CPU", "GPU")}
        again = self.keepers.pop(name, None)
        if again is not None:
            ray.kill(again)
        last = self.children.pop(name, None)
        lost = last.node_id if last is not None and last.cause == NODE_LOST \
            else self.unborn.pop(name, "")
        if lost:  # its bundle is still on that node until Ray marks it dead and moves the
            # bundle: started now, it would die unborn
            problem = await trio.to_thread.run_sync(self.moved, bundle, lost,
                                                    abandon_on_cancel=True)
            if problem is not None:
                print(f"!!! ray: {name} cannot be started again: {problem}", flush=True)
                return NotStarted(NO_ROOM)
        keeper: Any = ray.remote(ProcessKeeper).options(
            num_cpus=bundle.resources["CPU"], num_gpus=bundle.resources.get("GPU", 0),
            resources=custom, max_restarts=0, max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(bundle.group, bundle.index),
        ).remote()
        self.keepers[name] = keeper
        # on its node, a process's output goes to the run directory: Ray's own forwarding of
        # a worker's output reaches the driver late or not at all once the node is gone
        log = log or Path(self.topology_file).parent / LOGS / f"{name}.log"
        if "OMP_NUM_THREADS" in os.environ:  # the runner's own setting holds, as for a local one
            env = {**env, "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
        started = keeper.start.remote(list(args), env, self.topology_file, str(log))
        try:
            pid, node, node_id = await trio.to_thread.run_sync(ray.get, started,
                                                               abandon_on_cancel=True)
        except Exception as exc:  # Ray's errors carry the keeper's: said once, as the exit
            print(f"!!! ray: {name} could not be started: {exc}", flush=True)
            if self.alive(bundle.node_id):
                return NotStarted(FAILED)
            self.unborn[name] = bundle.node_id  # a node lost as it started: not its failure
            return NotStarted(NODE_LOST)
        if again is not None:  # (a restart: its bundle may have moved with a lost node)
            print(f"=== ray: {name} on {where(node, node_id)}", flush=True)
        child = self.children[name] = RayChild(name, keeper, pid, where(node, node_id), node_id)
        return child

    def alive(self, node_id: str) -> bool:
        import ray

        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

    def moved(self, bundle: Bundle, lost: str) -> str | None:
        """Wait until Ray has marked node ``lost`` dead and placed ``bundle`` on a live node
        (None), or for ``ray.reserve_timeout_s``: then what is missing, in one line."""
        import time

        import ray
        from ray.util.placement_group import placement_group_table

        deadline = time.monotonic() + self.options.reserve_timeout_s
        while time.monotonic() < deadline:
            table = placement_group_table(bundle.group)
            node = table["bundles_to_node_id"].get(bundle.index, "")
            if (table["state"] == "CREATED" and node and node != lost and self.alive(node)
                    and not self.alive(lost)):
                self.locate(bundle.group)
                return None
            time.sleep(0.5)
        free = {k: v for k, v in ray.available_resources().items()
                if not k.startswith(("node:", "bundle_group", "object_store", "memory"))}
        missing = {k: v for k, v in bundle.resources.items() if free.get(k, 0.0) < v}
        return (f"no live node has room for its reservation {bundle.resources} after "
                f"ray.reserve_timeout_s ({self.options.reserve_timeout_s:g}s): missing "
                f"{missing or bundle.resources} on one node (the cluster has {free} free); "
                "add a node with it, then resume")

    def close(self) -> None:
        """Stop every keeper (their processes die with them), release the reservations, leave
        the cluster, and remove the temp dir of a Ray started for the job."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        for keeper in self.keepers.values():
            ray.kill(keeper)
        for group in self.groups:
            remove_placement_group(group)
        ray.shutdown()
        if self.temp is not None and not self.options.temp_dir:
            shutil.rmtree(self.temp, ignore_errors=True)


def reachable(address: str, timeout_s: float = 10.0) -> None:
    """ConfigError unless something listens at ``HOST:PORT`` (``ray://`` too): Ray itself
    retries an address where nothing listens for minutes, saying little."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"ray.address: nothing answers at {address} ({exc}): is the Ray "
                          "head running, and is this its address?") from None


def where(node: str, node_id: str) -> str:
    return f"{node} (node {node_id[:8]})"
