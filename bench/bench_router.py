"""Transport cost of the scoring router, side by side with a direct link and an HTTP proxy.

    .venv/bin/python bench/bench_router.py
    .venv/bin/python bench/bench_router.py --workers 2 --concurrency 1,32 --rounds 5 --requests 4000 --seconds 3

Every request is one ``ScoreItem`` (a ~200-character solution), answered by a trivial echo
worker with a fixed score: nothing is scored, so what is measured is the transport. Modes, each
with its own processes (client = this process; every other component its own process):

- ``direct``: client DEALER -> echo workers' ROUTERs over ipc (the DEALER round-robins over the
  workers), no router. Client and workers use the project's ``AsyncSocket`` on trio.
- ``router``: client DEALER -> ``router_actor`` (own process, trio, ipc) -> echo workers (DEALERs
  that say ``WorkerHello`` and heartbeat, as a reward worker does).
- ``http-direct``: aiohttp client -> one FastAPI/uvicorn echo worker (the proxy's hop removed;
  context only).
- ``http-proxy``: aiohttp client -> FastAPI/uvicorn proxy that forwards each POST with aiohttp to
  the least-busy (fewest requests in flight) of the FastAPI/uvicorn echo workers, the way verl's
  HTTP reward/rollout routers do. Bodies are msgspec JSON on both sides and the proxy forwards
  bytes without parsing them, which favours HTTP.

For each mode and each concurrency C, the client keeps C requests in flight (closed loop) for
``--requests`` requests or ``--seconds`` seconds, whichever comes first, after a warm-up.
Reported: requests/s, latency p50/p99. Every loop is bounded; children are killed at exit and
also exit on their own when this process dies or after ``--child-lifetime`` seconds.

Needs the ``bench`` extra (fastapi, uvicorn, aiohttp). Run by hand; results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from messages.reward import ScoreItem, ScoreReply, ScoreRequest, ScoreResult  # noqa: E402

try:  # the ``bench`` extra; at module level so that FastAPI can resolve the annotations below
    from fastapi import FastAPI, Request, Response
except ImportError:  # the zmq modes still run
    FastAPI = Request = Response = None  # type: ignore[assignment,misc]

SOLUTION = ("Let x be the number of apples. Then 3x + 4 = 25, so 3x = 21 and x = 7. "
            "Each basket holds 6 apples, so 7 * 6 = 42 apples in total. ") * 2
SOLUTION = (SOLUTION + "#### 42")[:200]
ITEM = ScoreItem("openai/gsm8k", SOLUTION, "42")
RESULT = [ScoreResult(score=1.0)]


# ----------------------------------------------------------------------------- children

def _die_with_parent(parent: int, lifetime: float) -> None:
    """Exit when the parent is gone or the lifetime is over (no orphans, whatever happens)."""
    deadline = time.monotonic() + lifetime

    def watch() -> None:
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.25)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def role_zmq_worker(args: argparse.Namespace) -> None:
    """Echo worker: a ROUTER bound at ``--bind`` (direct) or a DEALER to the router (``--connect``)."""
    import anyio
    import zmq

    from actors.runtime.zmq_bridge import make_socket
    from messages.codec import Codec, encode
    from messages.reward import ToWorker, WorkerHeartbeat, WorkerHello

    async def main() -> None:
        zctx = zmq.Context()
        codec: Codec[ToWorker] = Codec(ToWorker)
        if args.bind:
            sock = make_socket(zctx, zmq.ROUTER, bind=args.bind, hwm=10000)
        else:
            sock = make_socket(zctx, zmq.DEALER, connect=args.connect, hwm=10000,
                               identity=args.name.encode())
        with sock:
            async with anyio.create_task_group() as tg:
                if not args.bind:
                    await sock.send_multipart([encode(WorkerHello(name=args.name, capacity=256))])

                    async def heartbeat() -> None:
                        while True:
                            await anyio.sleep(0.5)
                            await sock.send_multipart(
                                [encode(WorkerHeartbeat(name=args.name, capacity=256))])

                    tg.start_soon(heartbeat)
                while True:
                    *route, payload = await sock.recv_multipart()
                    msg = codec.decode(payload)
                    if isinstance(msg, ScoreRequest):
                        reply = ScoreReply(request_id=msg.request_id, results=RESULT * len(msg.items))
                        await sock.send_multipart([*route, encode(reply)])

    anyio.run(main, backend="trio")


def role_router(args: argparse.Namespace) -> None:
    """The project's router actor, as the runner would start it (trio, no control channel)."""
    from actors.router import router_actor
    from actors.runtime.actor import run_actor
    from actors.runtime.config import apply_overrides, decode_topology

    topo = decode_topology(apply_overrides({}, [
        f"router.address={args.bind}", f"router.worker_address={args.connect}"]))
    run_dir = Path(args.bind.removeprefix("ipc://")).parent / "router-run"  # the sockets' folder
    run_actor("router", 0, topo, run_dir, router_actor, supervised=False)


def role_http_worker(args: argparse.Namespace) -> None:
    import uvicorn

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"ok": "yes"}

    @app.post("/score")
    async def score(request: Request) -> Response:
        msg = msgspec.json.decode(await request.body(), type=ScoreRequest)
        reply = ScoreReply(request_id=msg.request_id, results=RESULT * len(msg.items))
        return Response(content=msgspec.json.encode(reply), media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


def role_http_proxy(args: argparse.Namespace) -> None:
    """FastAPI proxy: each POST goes to the worker with the fewest requests in flight (aiohttp)."""
    import contextlib

    import aiohttp
    import uvicorn

    upstreams = [f"http://127.0.0.1:{p}/score" for p in args.upstreams.split(",")]
    in_flight = dict.fromkeys(upstreams, 0)
    session: dict[str, aiohttp.ClientSession] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        session["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=30))
        yield
        await session["s"].close()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"ok": "yes"}

    @app.post("/score")
    async def score(request: Request) -> Response:
        body = await request.body()
        url = min(upstreams, key=in_flight.__getitem__)  # least requests
        in_flight[url] += 1
        try:
            async with session["s"].post(url, data=body,
                                         headers={"content-type": "application/json"}) as resp:
                data = await resp.read()
                status = resp.status
        finally:
            in_flight[url] -= 1
        return Response(content=data, status_code=status, media_type="application/json")

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


ROLES = {"zmq-worker": role_zmq_worker, "router": role_router,
         "http-worker": role_http_worker, "http-proxy": role_http_proxy}


# ----------------------------------------------------------------------------- parent

CHILDREN: list[subprocess.Popen] = []


def spawn(role: str, lifetime: float, **kw: str | int) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role,
           "--parent", str(os.getpid()), "--child-lifetime", str(lifetime)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    CHILDREN.append(proc)
    return proc


def kill_children() -> None:
    for proc in CHILDREN:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 3
    for proc in CHILDREN:
        try:
            proc.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=3)
    CHILDREN.clear()


atexit.register(kill_children)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"HTTP server on port {port} did not start in {timeout} s")


def pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def zmq_run(endpoints: list[str], conc: int, n: int, seconds: float) -> tuple[int, float, list[float]]:
    """Closed loop over one DEALER: ``conc`` requests in flight; returns (done, seconds, latencies)."""
    import anyio
    import zmq

    from actors.runtime.zmq_bridge import make_socket
    from messages.codec import Codec, encode
    from messages.reward import ToClient

    async def main() -> tuple[int, float, list[float]]:
        zctx = zmq.Context()
        codec: Codec[ToClient] = Codec(ToClient)
        sent_at: dict[int, float] = {}
        lat: list[float] = []
        try:
            with make_socket(zctx, zmq.DEALER, connect=endpoints[0], hwm=10000) as sock:
                for ep in endpoints[1:]:
                    sock.socket.connect(ep)
                sent = 0

                async def send_one() -> None:
                    nonlocal sent
                    sent_at[sent] = time.perf_counter()
                    await sock.send_multipart([encode(ScoreRequest(request_id=sent, items=[ITEM]))])
                    sent += 1

                with anyio.fail_after(seconds + 20):  # a lost reply fails loudly, never hangs
                    start = time.perf_counter()
                    stop_at = start + seconds
                    for _ in range(min(conc, n)):
                        await send_one()
                    while len(lat) < sent:
                        reply = codec.decode((await sock.recv_multipart())[-1])
                        now = time.perf_counter()
                        assert isinstance(reply, ScoreReply), reply
                        lat.append(now - sent_at.pop(reply.request_id))
                        if sent < n and now < stop_at:
                            await send_one()
                    elapsed = time.perf_counter() - start
        finally:
            zctx.destroy(linger=0)
        return len(lat), elapsed, lat

    return anyio.run(main, backend="trio")


def http_run(port: int, conc: int, n: int, seconds: float) -> tuple[int, float, list[float]]:
    """Closed loop with aiohttp: ``conc`` tasks, each one request in flight."""
    import aiohttp

    url = f"http://127.0.0.1:{port}/score"
    headers = {"content-type": "application/json"}

    async def main() -> tuple[int, float, list[float]]:
        lat: list[float] = []
        counter = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=30)) as session:
            start = time.perf_counter()
            stop_at = start + seconds

            async def loop() -> None:
                nonlocal counter
                while counter < n and time.perf_counter() < stop_at:
                    rid = counter
                    counter += 1
                    body = msgspec.json.encode(ScoreRequest(request_id=rid, items=[ITEM]))
                    t0 = time.perf_counter()
                    async with session.post(url, data=body, headers=headers) as resp:
                        data = await resp.read()
                    lat.append(time.perf_counter() - t0)
                    reply = msgspec.json.decode(data, type=ScoreReply)
                    assert reply.request_id == rid

            async with asyncio.timeout(seconds + 20):
                await asyncio.gather(*(loop() for _ in range(conc)))
            elapsed = time.perf_counter() - start
        return len(lat), elapsed, lat

    return asyncio.run(main())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="echo workers behind router/proxy/direct")
    p.add_argument("--concurrency", default="1,32", help="requests in flight, comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians reported)")
    p.add_argument("--requests", type=int, default=4000, help="max requests per measurement")
    p.add_argument("--seconds", type=float, default=3.0, help="max seconds per measurement")
    p.add_argument("--warmup", type=int, default=300, help="warm-up requests per mode (C = 4)")
    p.add_argument("--modes", default="direct,router,http-direct,http-proxy")
    p.add_argument("--child-lifetime", type=float, default=600.0)
    # child-only
    p.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    p.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    p.add_argument("--bind", default="", help=argparse.SUPPRESS)
    p.add_argument("--connect", default="", help=argparse.SUPPRESS)
    p.add_argument("--name", default="echo", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--upstreams", default="", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.role:
        _die_with_parent(args.parent, args.child_lifetime)
        ROLES[args.role](args)
        return 0

    concs = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    sockets = tempfile.mkdtemp(dir="/tmp", prefix="bench-router-")
    life = args.child_lifetime
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()}, "
          f"workers={args.workers}, request = 1 ScoreItem ({len(SOLUTION)}-char solution), "
          f"msgpack {len(msgspec.msgpack.encode(ScoreRequest(0, [ITEM])))} B, "
          f"json {len(msgspec.json.encode(ScoreRequest(0, [ITEM])))} B, "
          f"{args.rounds} rounds x (<= {args.requests} req or <= {args.seconds} s) per mode and C",
          flush=True)

    # (mode, C) -> one (requests, req/s, p50 ms, p99 ms) per round
    results: dict[tuple[str, int], list[tuple[int, float, float, float]]] = {}
    try:
        # every mode's processes are up for the whole run (idle ones only heartbeat), and the
        # measurements are interleaved round by round in a rotated order: load from other jobs
        # that comes and goes then hits every mode alike
        runs = {}
        for mode in modes:
            if mode == "direct":
                eps = [f"ipc://{sockets}/direct-{i}" for i in range(args.workers)]
                for i, ep in enumerate(eps):
                    spawn("zmq-worker", life, bind=ep, name=f"echo-{i}")
                runs[mode] = lambda c, n, s, eps=eps: zmq_run(eps, c, n, s)
            elif mode == "router":
                front, back = f"ipc://{sockets}/router", f"ipc://{sockets}/router-workers"
                spawn("router", life, bind=front, connect=back)
                time.sleep(0.5)
                for i in range(args.workers):
                    spawn("zmq-worker", life, connect=back, name=f"echo-{i}")
                runs[mode] = lambda c, n, s, front=front: zmq_run([front], c, n, s)
            elif mode in ("http-direct", "http-proxy"):
                nw = 1 if mode == "http-direct" else args.workers
                ports = [free_port() for _ in range(nw)]
                for port in ports:
                    spawn("http-worker", life, port=port)
                for port in ports:
                    wait_http(port)
                target = ports[0]
                if mode == "http-proxy":
                    target = free_port()
                    spawn("http-proxy", life, port=target, upstreams=",".join(map(str, ports)))
                    wait_http(target)
                runs[mode] = lambda c, n, s, t=target: http_run(t, c, n, s)
            else:
                raise SystemExit(f"unknown mode {mode}")
        time.sleep(1.0)
        for mode in modes:
            runs[mode](4, args.warmup, args.seconds)  # warm-up: connections, imports, caches
        for r in range(args.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            print(f"round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.2f})", flush=True)
            for mode in order:
                for c in concs:
                    done, elapsed, lat = runs[mode](c, args.requests, args.seconds)
                    lat.sort()
                    row = (done, done / elapsed, pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3)
                    results.setdefault((mode, c), []).append(row)
                    print(f"  {mode:<12} C={c:<3} {done:>6} req in {elapsed:5.2f} s  {row[1]:>8.0f} req/s"
                          f"  p50 {row[2]:7.3f} ms  p99 {row[3]:7.3f} ms", flush=True)
    finally:
        kill_children()
        shutil.rmtree(sockets, ignore_errors=True)

    med = statistics.median
    print()
    print(f"medians over {args.rounds} rounds (per-round min..max in brackets)")
    print(f"{'mode':<12} {'C':>3} {'req/s':>20} {'p50 ms':>22} {'p99 ms':>8}")
    for (mode, c), rs in results.items():
        rps, p50, p99 = [x[1] for x in rs], [x[2] for x in rs], [x[3] for x in rs]
        print(f"{mode:<12} {c:>3} {med(rps):>7.0f} [{min(rps):>5.0f}..{max(rps):>5.0f}] "
              f"{med(p50):>7.3f} [{min(p50):.3f}..{max(p50):.3f}] {med(p99):>8.3f}")

    def ratio(a: tuple[str, int], b: tuple[str, int], field: int) -> str:
        per_round = [x[field] / y[field] for x, y in zip(results[a], results[b], strict=True)]
        return (f"{med(per_round):.2f}x (per round {min(per_round):.2f}..{max(per_round):.2f}; "
                f"of medians {med(x[field] for x in results[a]) / med(y[field] for y in results[b]):.2f}x)")

    c1, cmax = min(concs), max(concs)
    print()
    if ("router", c1) in results and ("direct", c1) in results:
        print(f"router p50 / direct p50 at C={c1}: {ratio(('router', c1), ('direct', c1), 2)}  target < 2x")
        for c in concs:
            print(f"router req/s / direct req/s at C={c}: {ratio(('router', c), ('direct', c), 1)}")
    if ("router", cmax) in results and ("http-proxy", cmax) in results:
        for c in concs:
            print(f"router req/s / http-proxy req/s at C={c}: {ratio(('router', c), ('http-proxy', c), 1)}"
                  + ("  target >= 10x" if c == cmax else ""))
        print(f"http-proxy p50 / router p50 at C={c1}: {ratio(('http-proxy', c1), ('router', c1), 2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
