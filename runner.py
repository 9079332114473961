"""Run an RL post-training job: ``python runner.py topology.toml [dotted.key=value ...]``.

Attach one more reward worker to a running job:
``python runner.py attach reward --to RUN_DIR [--name NAME] [--key KEY] [reward.key=value ...]``.
It runs in the foreground, unsupervised by the job's runner, until Ctrl-C or SIGTERM: then it
says bye to the router, answers what it has in flight and exits 0 (detach). A job with
``[security] curve = true`` lets it in only with an authorized key (``--key NAME.key_secret``,
made by ``python runner.py keygen NAME``); a refused key ends it with an error and status 1.

Debug a recorded run offline (``actors/offline``): ``python runner.py replay RUN_DIR --step N``
trains step N again and compares its metrics with the recorded ones; ``python runner.py replay
RUN_DIR --rescore FILE.py[:NAME]`` re-scores the recorded completions; ``python runner.py
inspect RUN_DIR`` summarises the run and plots it.

The runner reads the topology into typed config, resolves the run directory, the model and
every ``auto`` address, writes the result to ``RUN_DIR/topology.json``, starts one OS process
per actor instance and supervises them: it prints one line per learner step and a live status
table, reports an actor that dies with its traceback (restarting it when its ``restart`` policy
says so), and on Ctrl-C, a failure or the learner's completion stops every process (Stop
message, then SIGTERM, then SIGKILL) and reaps them all. Exit status: 0 when the learner
finished, 130 on Ctrl-C, 1 on failure, 2 on a bad topology.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import anyio
import msgspec
import trio
import zmq

from actors.runtime.config import ACTOR_KINDS, ConfigError, Topology, load_topology
from actors.runtime.security import ZapHandler, attach_keys, job_keys, keygen, prepare_job_keys
from actors.runtime.zmq_bridge import make_socket
from messages.codec import Codec, DecodeError, encode
from messages.control import Finished, Heartbeat, Ready, StepReport, Stop, ToRunner

START_ORDER = ("replay", "router", "learner", "reward", "sampler")
STOP_GRACE_S = 90.0  # time for a stop message to end an actor (the learner's final checkpoint)
TERM_GRACE_S = 10.0
ROOT = Path(__file__).resolve().parent


def resolve(topology: Topology, *, model_ready: bool = True) -> tuple[Topology, Path]:
    """Fill in the run directory, the model directory and every ``auto`` address."""
    from actors.model_store import resolve_model_path

    run_dir = Path(topology.run.dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))).resolve()
    sockets = topology.run.socket_dir or tempfile.mkdtemp(prefix="flowrl-", dir="/tmp")
    Path(sockets).mkdir(parents=True, exist_ok=True)

    def addr(value: str, name: str) -> str:
        return f"ipc://{sockets}/{name}" if value == "auto" else value

    model = str(resolve_model_path(topology.model.path)) if model_ready else topology.model.path
    resolved = msgspec.structs.replace(
        topology,
        run=msgspec.structs.replace(topology.run, dir=str(run_dir), socket_dir=sockets),
        model=msgspec.structs.replace(topology.model, path=model),
        replay=msgspec.structs.replace(topology.replay, address=addr(topology.replay.address, "replay")),
        router=msgspec.structs.replace(
            topology.router, address=addr(topology.router.address, "router"),
            worker_address=addr(topology.router.worker_address, "router-workers")),
        learner=msgspec.structs.replace(
            topology.learner, weights_address=addr(topology.learner.weights_address, "weights")),
        control_address=addr(topology.control_address, "control"),
    )
    return resolved, run_dir


@dataclasses.dataclass
class Proc:
    kind: str
    index: int
    process: trio.Process | None = None
    restarts: int = 0
    ready: bool = False
    finished: bool = False
    last_seen: float = 0.0
    status: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"


def format_step(r: StepReport, total: int, max_staleness: int) -> str:
    m = r.metrics
    return (
        f"step {r.step:4d}/{total} | reward {m.get('critic/score/mean', 0):.3f}"
        f" | len {m.get('response_length/mean', 0):5.1f}"
        f" | kl {m.get('rollout_corr/kl', 0):+.4f} k3 {m.get('rollout_corr/k3_kl', 0):.4f}"
        f" | is_w {m.get('rollout_corr/is_weight_mean', 1):.3f}"
        f" clip {100 * m.get('rollout_corr/is_clip_frac', 0):.1f}%"
        f" | stale {m.get('staleness/mean', 0):.2f}/{max_staleness}"
        f" | {m.get('perf/throughput', 0):6.1f} tok/s | {m.get('timing_s/step', 0):5.1f}s"
    )


def format_status(procs: dict[str, Proc], started: float) -> str:
    lines = [f"--- status at {time.monotonic() - started:6.0f}s ---"]
    for p in procs.values():
        pid = p.process.pid if p.process else "-"
        shown = {k: v for k, v in p.status.items() if k not in ("uptime_s",)}
        state = shown.pop("state", "starting" if not p.ready else "running")
        detail = " ".join(f"{k}={v}" for k, v in shown.items())
        lines.append(f"  {p.name:<10} pid={pid:<7} {state:<9} {detail}")
    return "\n".join(lines)


class Job:
    def __init__(self, topology: Topology, run_dir: Path) -> None:
        self.topo = topology
        self.run_dir = run_dir
        self.procs = {
            p.name: p
            for kind in START_ORDER
            for p in (Proc(kind, i) for i in range(getattr(topology, kind).count))
        }
        self.outcome: str | None = None  # "finished", "interrupted" or "failed: ..."
        self.done = trio.Event()
        self.stopping = False
        self.started = time.monotonic()
        self.zmq = zmq.Context()
        curve = job_keys(topology)
        self.zap = None if curve is None else ZapHandler(
            self.zmq, {curve.public}, topology.security.authorized_keys,
            log=lambda text: print(f"!!! runner: {text}", flush=True))
        self.control = make_socket(self.zmq, zmq.ROUTER, bind=topology.control_address, curve=curve)
        self.control.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # restarted actors keep their name

    def end(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.done.set()

    async def spawn(self, p: Proc) -> None:
        cmd = [sys.executable, "-m", "actors.main", str(self.run_dir), p.kind, str(p.index)]
        p.ready, p.status, p.last_seen = False, {}, time.monotonic()
        p.process = await trio.lowlevel.open_process(cmd, cwd=ROOT)

    async def supervise(self, p: Proc) -> None:
        """Wait for a process to exit; restart it or end the job, per its restart policy."""
        while True:
            assert p.process is not None
            rc = await p.process.wait()
            if self.stopping:
                return
            if rc == 0 and p.finished:
                if p.kind == "learner":
                    self.end("finished")
                return
            tb_file = self.run_dir / "logs" / f"{p.name}.traceback"
            if tb_file.is_file():
                tb = tb_file.read_text()
            elif rc < 0:
                tb = f"(no traceback: killed by signal {signal.Signals(-rc).name})"
            else:
                tb = "(no traceback: it stopped without being asked to)"
            print(f"!!! actor {p.name} (pid {p.process.pid}) exited with status {rc}\n{tb}",
                  flush=True)
            cfg = getattr(self.topo, p.kind)
            if cfg.restart == "on-failure" and p.restarts < cfg.max_restarts:
                p.restarts += 1
                tb_file.unlink(missing_ok=True)
                print(f"!!! restarting {p.name} ({p.restarts}/{cfg.max_restarts})", flush=True)
                await self.spawn(p)
                continue
            self.end(f"failed: actor {p.name} exited with status {rc}")
            return

    async def listen(self) -> None:
        codec: Codec[ToRunner] = Codec(ToRunner)
        total, stale = self.topo.learner.total_steps, self.topo.algorithm.max_staleness
        while True:
            ident, *frames = await self.control.recv_multipart()
            p = self.procs.get(ident.decode(errors="replace"))
            try:
                msg = codec.decode(frames[-1] if frames else b"")
            except DecodeError:
                continue
            if p is None:
                continue
            p.last_seen = time.monotonic()
            match msg:
                case Ready():
                    p.ready = True
                case Heartbeat(status=status):
                    p.status = status
                case StepReport() as report:
                    print(format_step(report, total, stale), flush=True)
                    self.record_status(report.step)
                case Finished(detail=detail):
                    p.finished = True
                    print(f"=== {p.name} finished: {detail}", flush=True)

    def record_status(self, step: int) -> None:
        """One ``status.jsonl`` line per learner step: every actor's last reported status (the
        router's per-worker in flight, done, failed and latency percentiles among them)."""
        line = {"step": step, "time": time.time(),
                **{p.name: p.status for p in self.procs.values() if p.status}}
        with (self.run_dir / "status.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    async def watch(self) -> None:
        """Print the status table and treat an actor silent past the timeout as dead."""
        interval = self.topo.run.status_interval
        last_print = time.monotonic()
        while True:
            await trio.sleep(1.0)
            now = time.monotonic()
            for p in self.procs.values():
                silent = now - p.last_seen
                if p.process and p.process.returncode is None and silent > self.topo.run.heartbeat_timeout:
                    print(f"!!! {p.name} silent for {silent:.0f}s: killing it", flush=True)
                    p.process.kill()
            if interval > 0 and now - last_print >= interval:
                last_print = now
                print(format_status(self.procs, self.started), flush=True)

    async def signals(self) -> None:
        """First Ctrl-C: orderly stop (final checkpoint). A second one: kill every actor now."""
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
            async for _ in received:
                if self.outcome is None:
                    print("=== interrupted: stopping every actor (final checkpoint first; "
                          "Ctrl-C again to kill)", flush=True)
                    self.end("interrupted")
                    continue
                print("=== interrupted again: killing every actor", flush=True)
                for p in self.procs.values():
                    if p.process is not None and p.process.returncode is None:
                        p.process.kill()

    async def shutdown(self) -> None:
        """Stop message, then SIGTERM, then SIGKILL; every child is reaped before returning."""
        self.stopping = True
        live = [p for p in self.procs.values() if p.process and p.process.returncode is None]
        for p in live:
            try:
                self.control.send_multipart_nowait([p.name.encode(), encode(Stop(reason=self.outcome or ""))])
            except zmq.ZMQError:
                pass
        for grace, action in ((STOP_GRACE_S, "terminate"), (TERM_GRACE_S, "kill"), (None, None)):
            with trio.move_on_after(grace if grace is not None else 30):
                for p in live:
                    await p.process.wait()
            live = [p for p in live if p.process.returncode is None]
            if not live or action is None:
                break
            print(f"=== {', '.join(p.name for p in live)} did not stop: {action}", flush=True)
            for p in live:
                getattr(p.process, action)()

    async def run(self) -> int:
        async with trio.open_nursery() as outer:
            outer.start_soon(self.signals)  # stays on through shutdown
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.listen)
                    for p in self.procs.values():
                        await self.spawn(p)
                        nursery.start_soon(self.supervise, p)
                    nursery.start_soon(self.watch)
                    await self.done.wait()
                    nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    await self.shutdown()
                self.control.close()
                if self.zap is not None:
                    self.zap.close()
                self.zmq.destroy(linger=0)
                outer.cancel_scope.cancel()
        print(f"=== job {self.outcome}; run directory: {self.run_dir}", flush=True)
        if self.outcome == "finished":
            return 0
        if self.outcome == "interrupted":
            print(f"    resume with: python runner.py TOPOLOGY run.dir={self.run_dir}", flush=True)
            return 130
        return 1


def run_command(args: argparse.Namespace) -> int:
    try:
        topology = load_topology(args.topology, args.overrides)
    except ConfigError as exc:
        print(f"error: bad topology: {exc}", file=sys.stderr)
        return 2
    own_sockets = not topology.run.socket_dir  # a fresh temp folder, removed at exit
    topology, run_dir = resolve(topology)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = open(run_dir / ".runner.lock", "w")  # noqa: SIM115 - held for the job's lifetime
    try:
        # released by the kernel when this process dies, however it dies (kill -9 included)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"error: another runner is using {run_dir}", file=sys.stderr)
        return 2
    try:
        _remove_stale_sockets(run_dir, Path(topology.run.socket_dir))
        try:
            topology = prepare_job_keys(topology, run_dir)
        except ConfigError as exc:
            print(f"error: bad topology: {exc}", file=sys.stderr)
            return 2
        (run_dir / "logs").mkdir(exist_ok=True)
        for stale in (run_dir / "logs").glob("*.traceback"):
            stale.unlink()
        resolved = run_dir / "topology.json"  # actors read it: replace it whole, never half-written
        tmp = resolved.with_name(f".topology.json.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(topology)))
        os.replace(tmp, resolved)
        print(f"=== run directory: {run_dir}", flush=True)
        print(f"=== model: {topology.model.path}", flush=True)
        counts = ", ".join(f"{k}×{getattr(topology, k).count}" for k in ACTOR_KINDS)
        print(f"=== actors: {counts}; max_staleness={topology.algorithm.max_staleness}", flush=True)
        return anyio.run(Job(topology, run_dir).run, backend="trio")
    finally:
        if own_sockets:
            shutil.rmtree(topology.run.socket_dir, ignore_errors=True)
        lock.close()


def _remove_stale_sockets(run_dir: Path, current: Path) -> None:
    """Remove the socket folder a killed earlier runner of this run directory left in /tmp.

    Only a folder the runner made itself (``/tmp/flowrl-*``, sockets only) and not this run's.
    """
    try:
        previous = Path(msgspec.json.decode((run_dir / "topology.json").read_bytes())
                        ["run"]["socket_dir"])
    except (OSError, msgspec.DecodeError, KeyError, TypeError):
        return
    if (previous == current or previous.parent != Path("/tmp")
            or not previous.name.startswith("flowrl-") or not previous.is_dir()):
        return
    if all(entry.is_socket() for entry in previous.iterdir()):
        shutil.rmtree(previous, ignore_errors=True)


ATTACHABLE = {"reward": ("actors.reward", "reward_actor")}


def attach_command(args: argparse.Namespace) -> int:
    """Start one worker of ``args.kind`` in this process, joined to the job's router."""
    import importlib
    import os

    from actors.runtime.actor import run_actor
    from actors.runtime.config import apply_overrides, decode_topology

    by_address = "://" in args.to  # the router's worker address, e.g. from another machine
    path = Path(args.to)
    topo_file = path if path.suffix == ".json" else path / "topology.json"
    if by_address:
        if not args.to.startswith(("tcp://", "ipc://")):
            print(f"error: --to {args.to}: an address is tcp://HOST:PORT or ipc://PATH",
                  file=sys.stderr)
            return 2
        data: dict = {"router": {"worker_address": args.to}}
        if args.server_key:
            data["security"] = {"curve": True, "server_key": args.server_key}
    elif not topo_file.is_file():
        print(f"error: no resolved topology at {topo_file} (is it the run directory of a job "
              "started with runner.py?)", file=sys.stderr)
        return 2
    elif args.server_key:
        print("error: --server-key goes with --to ADDRESS; a run directory's topology.json "
              "already holds the job's server key", file=sys.stderr)
        return 2
    try:
        if not by_address:
            data = msgspec.json.decode(topo_file.read_bytes())
        bad = [o for o in args.overrides if not o.split("=", 1)[0].strip().startswith(f"{args.kind}.")]
        if bad:
            raise ConfigError(f"only {args.kind}.* keys can be overridden when attaching: {', '.join(bad)}")
        topology = decode_topology(apply_overrides(data, list(args.overrides)))
    except (ConfigError, msgspec.DecodeError) as exc:
        print(f"error: bad topology {args.to if by_address else topo_file}: {exc}", file=sys.stderr)
        return 2
    try:
        curve = attach_keys(topology, args.key)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = args.name or f"{args.kind}-attached-{os.getpid()}"
    if by_address:  # no run directory here: logs go to ./attached/NAME/logs
        run_dir = Path("attached") / name
    else:
        run_dir = Path(topology.run.dir) if topology.run.dir else topo_file.parent
    module, fn = ATTACHABLE[args.kind]
    body = getattr(importlib.import_module(module), fn)
    print(f"=== {name} (pid {os.getpid()}) attaching to {topology.router.worker_address}; "
          "Ctrl-C detaches it", flush=True)
    return run_actor(args.kind, -1, topology, run_dir, body, name=name, supervised=False, curve=curve)


def attach_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py attach", description="Attach one worker to a running job (Ctrl-C detaches it).",
        epilog="example: python runner.py attach reward --to runs/20260101-120000 reward.capacity=8",
    )
    parser.add_argument("kind", choices=sorted(ATTACHABLE), help="kind of worker")
    parser.add_argument("--to", required=True, metavar="RUN_DIR|ADDRESS",
                        help="the job's run directory (or its topology.json), or the router's "
                             "worker address (tcp://HOST:PORT, ipc://PATH) with the default reward "
                             "config plus the reward.* overrides given")
    parser.add_argument("--server-key", default="", metavar="Z85",
                        help="with --to ADDRESS of a job with CURVE on: the job's server public "
                             "key (security.server_key in its topology.json); use with --key")
    parser.add_argument("--name", default="", help="worker name (unique; default KIND-attached-PID)")
    parser.add_argument("--key", default=None, metavar="KEY",
                        help="CURVE key (NAME.key_secret from runner.py keygen) for a job with "
                             "[security]; default: the job's own client key in its keys_dir")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the worker's section")
    return attach_command(parser.parse_intermixed_args(argv))


def replay_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py replay",
        description="Replay a recorded learner step offline and compare its metrics with the "
                    "recorded ones (--step), or re-score the recorded completions with another "
                    "reward function (--rescore). Exit status: 0 match, 1 mismatch, 2 bad input.",
        epilog="examples: python runner.py replay RUN_DIR --step 12 --dump 40:3; "
               "python runner.py replay RUN_DIR --rescore my_reward.py:compute_score --steps 1:10",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, help="the learner step to replay")
    what.add_argument("--rescore", metavar="FILE.py[:NAME]",
                      help="a verl-style compute_score function (NAME defaults to compute_score)")
    parser.add_argument("--dump", action="append", default=[], metavar="GROUP_ID[:SAMPLE]",
                        help="--step: print the per-token tensors of these samples (repeatable)")
    parser.add_argument("--dump-dir", metavar="DIR",
                        help="--step: write the dumped samples as .pt and .parquet into DIR")
    parser.add_argument("--steps", metavar="A:B", help="--rescore: only the batches of steps A..B")
    parser.add_argument("--limit", type=int, default=0,
                        help="--rescore: at most this many groups (0: all)")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="--rescore: a sample whose reward moved by more than this flips")
    parser.add_argument("--timeout", type=float, default=0.0, metavar="S",
                        help="--rescore: seconds per call before the child is killed "
                             "(default: the run's reward.timeout_s)")
    parser.add_argument("overrides", nargs="*",
                        help="--step: dotted topology overrides for a what-if (learner.lr=1e-4)")
    args = parser.parse_intermixed_args(argv)
    from actors.offline.recorded import OfflineError

    try:
        if args.step is not None:
            from actors.offline.replay import replay
            return replay(args.run_dir, args.step, overrides=args.overrides, dump=args.dump,
                          dump_dir=args.dump_dir)
        from actors.offline.rescore import rescore
        return rescore(args.run_dir, args.rescore, steps=args.steps, limit=args.limit,
                       threshold=args.threshold, timeout_s=args.timeout)
    except OfflineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def inspect_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py inspect",
        description="Summarise a recorded run: a table of the run, the best and worst samples of "
                    "a step, the staleness histogram, and PNG plots over steps.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    parser.add_argument("--step", type=int, help="step whose best/worst samples are shown "
                                                 "(default: the last)")
    parser.add_argument("--plots", metavar="DIR", help="where the PNGs go (default RUN_DIR/plots)")
    parser.add_argument("--top", type=int, default=3, help="best and worst samples shown")
    args = parser.parse_args(argv)
    from actors.offline.inspection import inspect_run
    from actors.offline.recorded import OfflineError

    try:
        return inspect_run(args.run_dir, step=args.step, plots=args.plots, top=args.top)
    except OfflineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def keygen_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py keygen", description="Make a CURVE keypair for attaching to a secured job.",
        epilog="example: python runner.py keygen keys/alice; then list keys/alice.key in the job's "
               "security.authorized_keys and attach with --key keys/alice.key_secret")
    parser.add_argument("name", help="writes NAME.key (public) and NAME.key_secret (mode 0600)")
    args = parser.parse_args(argv)
    try:
        public, secret = keygen(args.name)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "attach":
        return attach_main(argv[1:])
    if argv and argv[0] == "replay":
        return replay_main(argv[1:])
    if argv and argv[0] == "inspect":
        return inspect_main(argv[1:])
    if argv and argv[0] == "keygen":
        return keygen_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="runner.py", description="Run an async RL post-training job from a topology file.",
        epilog="example: python runner.py topology.toml learner.total_steps=3 sampler.count=2; "
               "python runner.py attach reward --to RUN_DIR adds a reward worker to a running job; "
               "python runner.py replay RUN_DIR --step N | --rescore FILE.py[:NAME] and "
               "python runner.py inspect RUN_DIR debug a recorded run; "
               "python runner.py keygen NAME makes a CURVE key for attaching to a secured job",
    )
    parser.add_argument("topology", help="topology TOML file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=2e-5")
    args = parser.parse_args(argv)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
