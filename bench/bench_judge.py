"""Judge scoring throughput: through the router against the judge engine alone, side by side.

    .venv/bin/python bench/bench_judge.py
    .venv/bin/python bench/bench_judge.py --model PATH --concurrency 1,8 --items 8 --requests 32

A request is one ``ScoreRequest`` of ``--items`` responses (a group, as a sampler sends it),
scored by a judge pool (``[[reward.models]]`` with ``kind = "judge"``, the hf engine, greedy,
``--max-tokens`` per answer) on the CPU. Two modes, interleaved round by round:

- ``engine``: the judge alone, in this process: ``ServedScoring`` (the replica's scorer: the
  engine, the template, the parser, batching across concurrent requests), called by C tasks.
- ``router``: C tasks of the sampler's ``ScoringClient`` -> ``router_actor`` (own process) ->
  ``--replicas`` judge replicas (``reward_actor`` processes, as the runner starts them).

Each keeps C requests in flight (closed loop) until ``--requests`` are answered, after a warm-up
request. Reported per mode and C: requests/s, responses/s, latency p50/p99, and the share of
responses the parser could not read (a tiny random judge writes no score: that is a recorded
error, and costs the same generation). Default model: the tests' tiny random llama (built in a
temporary folder), so what is measured is the path, not a judge's quality. Run by hand; results
go in BENCHMARKS.md with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "question {prompt}\nanswer {response}\nscore 1 to 10"
sys.path.insert(0, str(ROOT))


def topology(args: argparse.Namespace, sockets: str):
    from actors.job.config.load import apply_overrides, decode_topology

    return decode_topology(apply_overrides({}, [
        f"router.address=ipc://{sockets}/router", f"router.worker_address=ipc://{sockets}/workers",
        "sampler.engine=hf", "reward.count=0", "reward.rules=false", "run.heartbeat_interval=0.5",
        f"reward.models=[{{name=\"judge\", kind=\"judge\", path=\"{args.model}\", "
        f"replicas={args.replicas}, capacity={args.capacity}, max_tokens={args.max_tokens}, "
        f"batch_size={args.batch_size}, template={json.dumps(args.template)}}}]"]))


def request(items: int):
    from messages.reward import Response, ScoreRequest
    from messages.rollout import ChatMessage

    return ScoreRequest("arithmetic", "5", [Response(f"the sum is {i} i think", 8)
                                            for i in range(items)],
                        prompt=[ChatMessage("user", "what is 2 + 3?")])


def role(args: argparse.Namespace) -> None:
    """A child: the router, or judge replica ``--index``."""
    from actors.runtime.actor import run_actor

    topo = topology(args, args.sockets)
    run_dir = Path(args.sockets) / "run"
    if args.role == "router":
        from actors.router.actor import router_actor

        run_actor("router", 0, topo, run_dir, router_actor, supervised=False)
    else:
        from actors.reward import reward_actor

        run_actor("reward", args.index, topo, run_dir, reward_actor, supervised=False)


async def closed_loop(score, concurrency: int, total: int) -> tuple[float, list[float], int]:
    """``total`` calls of ``score()`` with ``concurrency`` in flight: seconds, latencies, errors."""
    import anyio

    latencies: list[float] = []
    errors = 0
    issued = 0

    async def lane() -> None:
        nonlocal issued, errors
        while issued < total:
            issued += 1
            started = time.perf_counter()
            results = await score()
            latencies.append(time.perf_counter() - started)
            errors += sum(1 for r in results if r.error)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(lane)
    return time.perf_counter() - started, latencies, errors


async def measure(args: argparse.Namespace, sockets: str) -> None:
    import anyio
    import zmq

    from actors.runtime.zmq_bridge import make_socket
    from actors.sampler.scoring_client import ScoringClient
    from actors.scoring.items import items_of
    from actors.scoring.served import ServedScoring

    topo = topology(args, sockets)
    req = request(args.items)
    alone = ServedScoring(topo.reward.models[0], topo)
    await alone.load()
    zctx = zmq.Context()
    sock = make_socket(zctx, zmq.DEALER, connect=topo.router.address)
    client = ScoringClient(sock, timeout_s=300, attempts=1, targets=(("judge", 1.0),))
    modes = {"engine": lambda: alone.score(items_of(req)),
             "router": lambda: _replies(client, req)}
    rows: dict[tuple[str, int], list[tuple[float, list[float], int]]] = {}
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.serve)
            with anyio.fail_after(300):
                await modes["router"]()  # every replica loaded and routed to (warm-up)
                await modes["engine"]()
            for r in range(args.rounds):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for c in args.concurrency:
                    for mode in order:
                        rows.setdefault((mode, c), []).append(
                            await closed_loop(modes[mode], c, args.requests))
            tg.cancel_scope.cancel()
    finally:
        sock.close(linger=0)
        zctx.term()
        await alone.aclose()
    print(f"judge: {args.model} (hf, greedy, {args.max_tokens} tokens per answer, "
          f"batch_size {args.batch_size}); {args.items} responses per request; "
          f"{args.replicas} replica(s) behind the router; {args.rounds} round(s) of "
          f"{args.requests} requests")
    print(f"{'mode':8} {'C':>3} {'req/s':>8} {'resp/s':>8} {'p50 ms':>9} {'p99 ms':>9} "
          f"{'unread':>7}")
    for (mode, c), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        seconds = sum(s for s, _, _ in runs)
        lat = sorted(x for _, xs, _ in runs for x in xs)
        n = len(lat)
        errors = sum(e for _, _, e in runs)
        p99 = lat[min(n - 1, int(n * 0.99))]
        print(f"{mode:8} {c:>3} {n / seconds:>8.2f} {n * args.items / seconds:>8.1f} "
              f"{statistics.median(lat) * 1e3:>9.1f} {p99 * 1e3:>9.1f} "
              f"{errors / (n * args.items):>7.0%}")


async def _replies(client, req):
    reply = await client.score(req)
    if reply is None:
        raise RuntimeError(f"the router answered no reply: {client.router_error}")
    return reply.results


def spawn(args: argparse.Namespace, sockets: str) -> list[subprocess.Popen]:
    """The router and the judge replicas, each its own process."""
    common = ["--sockets", sockets, "--model", str(args.model), "--replicas", str(args.replicas),
              "--capacity", str(args.capacity), "--max-tokens", str(args.max_tokens),
              "--batch-size", str(args.batch_size), "--template", args.template]
    return [subprocess.Popen([sys.executable, __file__, "--role", "router", *common])] + [
        subprocess.Popen([sys.executable, __file__, "--role", "replica", "--index", str(k),
                          *common]) for k in range(args.replicas)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="judge model (default: tiny)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8], help="requests in flight, a list")
    parser.add_argument("--items", type=int, default=8, help="responses per request")
    parser.add_argument("--requests", type=int, default=32, help="requests per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--template", default=TEMPLATE,
                        help="the judge's template (default: a short one: the tiny model's "
                             "tokenizer makes a token of every character, its context is 256)")
    parser.add_argument("--role", choices=["router", "replica"], default=None)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--sockets", default="")
    args = parser.parse_args()
    if args.role:
        role(args)
        return 0
    import anyio
    import torch

    torch.set_num_threads(1)  # as the replica (its pool's threads = 1)
    if args.model is None:
        from tests.tiny_model import build_tiny_model

        args.model = build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-judge-model-")) / "m")
    sockets = tempfile.mkdtemp(dir="/tmp", prefix="bench-judge-")
    children = spawn(args, sockets)
    try:
        anyio.run(measure, args, sockets, backend="trio")
    finally:
        for child in children:
            child.kill()
            child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
