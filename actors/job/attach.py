"""``runner.py attach KIND --to RUN_DIR|ADDRESS``: one more worker of a pool, joined to a running
job in this process.

What a kind needs is its registry row (``actors/registry.py``: ``attachable``, ``by_address``),
so a new pool kind attaches by its row alone. ``--to RUN_DIR`` (or its ``topology.json``) takes
the job's resolved topology from the run directory. ``--to ADDRESS`` (another machine) means, per
the row, the router's worker address (the worker runs with its section's defaults and the
overrides given) or the job runner's control address, which sends the job's topology
(``AskTopology``; with ``[security]``, only to an authorized CURVE key). A worker that knows the
runner's address reports to it, so it shows in the status and the live panel as attached, and the
runner's Stop ends it with the job; it stops when its process gets SIGTERM or Ctrl-C (a drain,
for kinds that drain: ``ActorContext.drain_grace_s``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from actors.job.config.load import apply_overrides, decode_topology
from actors.registry import BY_NAME
from actors.runtime.actor import run_actor, stop_signalled
from actors.runtime.config import ConfigError
from actors.runtime.rundir import TOPOLOGY
from actors.runtime.security import FAILURES, HandshakeRefused, attach_keys
from messages.codec import Codec, DecodeError, encode
from messages.control import AskTopology, JobTopology, ToAttacher


class StoppedBeforeAttaching(Exception):
    """A stop signal came before the worker joined the job: it leaves with nothing to hand back."""


ASK_TIMEOUT_S = 15.0  # how long the runner's answer is waited for
ASK_AGAIN_S = 1.0  # the question is repeated this often (a CURVE handshake may come late)


def ask_topology(address: str, server_key: str, key: str | None) -> dict:
    """The job's topology from its runner at ``address`` (raises ConfigError)."""
    data: dict = {"security": {"curve": True, "server_key": server_key}} if server_key else {}
    curve = attach_keys(decode_topology(data), key)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = None
        if curve is not None:
            curve.configure(sock, server=False)
            monitor = sock.get_monitor_socket(sum(FAILURES))  # a refused key, said at once
        sock.connect(address)
        poller = zmq.Poller()
        for s in (sock, monitor):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        codec: Codec[ToAttacher] = Codec(ToAttacher)
        for _ in range(int(ASK_TIMEOUT_S / ASK_AGAIN_S)):
            if stop_signalled():  # Ctrl-C or SIGTERM while waiting: nothing to attach
                raise StoppedBeforeAttaching(f"stopped while asking {address} for the job")
            sock.send(encode(AskTopology()))
            ready = dict(poller.poll(int(ASK_AGAIN_S * 1000)))
            if monitor is not None and monitor in ready:
                event = int(parse_monitor_message(monitor.recv_multipart())["event"])
                if event in FAILURES:
                    assert curve is not None
                    raise HandshakeRefused(f"{address} " + FAILURES[event].format(
                        key=curve.public.decode()[:8]))
            if sock in ready:
                try:
                    reply = codec.decode(sock.recv_multipart()[-1])
                except DecodeError:
                    continue
                if isinstance(reply, JobTopology):
                    return msgspec.json.decode(reply.topology)
                raise ConfigError(f"--to {address}: the runner answered: {reply.error}")
        hint = " (is --server-key the job's security.server_key, and --key authorized?)" \
            if server_key else " (a job with [security] needs --server-key and --key)"
        raise ConfigError(f"--to {address}: no answer from a job runner within "
                          f"{ASK_TIMEOUT_S:g}s{hint}")
    finally:
        ctx.destroy(linger=0)


def job_topology(args: argparse.Namespace) -> tuple[dict, str]:
    """The job's topology as data and the runner address to report to ("" for none); raises
    ConfigError."""
    row = BY_NAME[args.kind]
    if "://" in args.to:  # from another machine
        if not args.to.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"--to {args.to}: an address is tcp://HOST:PORT or ipc://PATH")
        if row.by_address == "runner":
            return ask_topology(args.to, args.server_key, args.key), args.to
        data: dict = {"router": {"worker_address": args.to}}
        if args.server_key:
            data["security"] = {"curve": True, "server_key": args.server_key}
        return data, ""
    path = Path(args.to)
    topo_file = path if path.suffix == ".json" else path / TOPOLOGY
    if not topo_file.is_file():
        raise ConfigError(f"no resolved topology at {topo_file} (is it the run directory of a "
                          "job started with runner.py?)")
    if args.server_key:
        raise ConfigError("--server-key goes with --to ADDRESS; a run directory's topology.json "
                          "already holds the job's server key")
    data = msgspec.json.decode(topo_file.read_bytes())
    control = data.get("control_address", "auto")
    return data, "" if control == "auto" else control


def attached_index(topology, kind: str, pool: str) -> int:
    """The process index an attached worker runs as: -1, or with ``--pool NAME`` (reward) the
    index of that model pool's first replica, so it serves the pool with the pool's model
    (``config/pools.py``'s ``model_replica``); raises ConfigError naming ``--pool``."""
    if not pool:
        return -1
    if kind != "reward":
        raise ConfigError(f"--pool {pool}: only reward workers serve model pools ([[reward.models]])")
    R = topology.reward
    index = R.count
    for m in R.models:
        if m.name == pool:
            return index
        index += m.replicas
    names = ", ".join(m.name for m in R.models) or "none"
    raise ConfigError(f"--pool {pool}: the job has no such model pool (its reward.models: {names})")


def attach_command(args: argparse.Namespace) -> int:
    """Start one worker of ``args.kind`` in this process, joined to the running job."""
    try:
        data, report_to = job_topology(args)
    except StoppedBeforeAttaching as exc:
        print(f"=== {exc}", flush=True)
        return 0
    except HandshakeRefused as exc:  # as a refused worker says it (status 1)
        print(f"error: [{args.kind} attach] {exc}", file=sys.stderr)
        return 1
    except (ConfigError, msgspec.DecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        bad = [o for o in args.overrides if not o.split("=", 1)[0].strip().startswith(f"{args.kind}.")]
        if bad:
            raise ConfigError(f"only {args.kind}.* keys can be overridden when attaching: {', '.join(bad)}")
        # a resolved topology with [hosts] holds its runner's own control address, which the
        # checks of a topology file refuse (there it must be auto): checked as auto, then put back
        control = data.get("control_address", "auto") if data.get("hosts") else "auto"
        topology = decode_topology(apply_overrides({**data, "control_address": "auto"}
                                                   if control != "auto" else data,
                                                   list(args.overrides)))
        if control != "auto":
            topology = msgspec.structs.replace(topology, control_address=control)
        curve = attach_keys(topology, args.key)
    except (ConfigError, msgspec.DecodeError) as exc:
        print(f"error: bad topology {args.to}: {exc}", file=sys.stderr)
        return 2
    try:
        index = attached_index(topology, args.kind, getattr(args, "pool", ""))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = args.name or f"{args.kind}-attached-{os.getpid()}"
    if "://" in args.to:  # no run directory here: logs go to ./attached/NAME/logs
        run_dir = Path("attached") / name
    else:
        to = Path(args.to)
        run_dir = Path(topology.run.dir) if topology.run.dir else \
            to.parent if to.suffix == ".json" else to
    body = BY_NAME[args.kind].load()
    print(f"=== {name} (pid {os.getpid()}) attaching to the job at {args.to}; Ctrl-C detaches it",
          flush=True)
    return run_actor(args.kind, index, topology, run_dir, body, name=name, supervised=False,
                     curve=curve, report_to=report_to)
