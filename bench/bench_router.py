"""Transport cost of the scoring router, side by side with a direct link and an HTTP proxy.

    .venv/bin/python bench/bench_router.py
    .venv/bin/python bench/bench_router.py --workers 2 --concurrency 1,32 --items 1,8 --clients 1 \
        --rounds 5 --seconds 2

A request is one ``ScoreRequest`` carrying ``--items`` responses (a ~200-character solution
each; a sampler sends the n completions of a prompt as one request, so 8 is the realistic case),
answered by a trivial echo worker with one fixed score per response: nothing is scored, so what
is measured is the transport. On zmq a request and a reply are two frames, an ``Envelope`` (id,
pool) and the encoded body, as the sampler's scoring client and the reward worker send them; the
router reads the envelope only and forwards the body bytes. Every component is its own process:

- ``direct``: client DEALER -> echo workers' ROUTERs over ipc (the DEALER round-robins over the
  workers), no router.
- ``router``: client DEALER -> ``router_actor`` (own process, trio, ipc) -> echo workers (DEALERs
  that say ``WorkerHello`` and heartbeat, as a reward worker does).
- ``http-direct``: aiohttp client -> one FastAPI/uvicorn echo worker (the proxy's hop removed;
  context only).
- ``http-proxy``: aiohttp client -> FastAPI/uvicorn proxy that forwards each POST with aiohttp to
  the least-busy (fewest requests in flight) of the FastAPI/uvicorn echo workers, the way verl's
  HTTP reward/rollout routers do. Bodies are msgspec JSON on both sides and the proxy forwards
  bytes without parsing them, which favours HTTP.

Workers: the zmq echo worker is the project's ``AsyncSocket`` on trio, one message at a time
(as the reward worker); the HTTP echo worker is a FastAPI endpoint. Both decode the request
and encode a reply.

Clients: ``--clients`` processes (the same number for every mode) share the C requests in
flight. Each is the leanest client of its kind, so that it is not what limits a mode: for zmq a
plain pyzmq loop that keeps its requests in flight, blocks for the first ready reply and then
takes every queued one without blocking, sending a new request per reply; for HTTP an asyncio
loop with one aiohttp task per request in flight over keep-alive connections (HTTP/1.1 has one
request per connection at a time). Both encode every request and decode every reply with
msgspec.

A measurement keeps C requests in flight (closed loop) for ``--seconds`` (or ``--requests``),
after each client process has warmed up its connections. Reported per mode, C and items:
requests/s, items/s (= requests/s x items), latency p50/p99, and CPU time per request of each
kind of process (client, hop = router or proxy, workers; from /proc, so ~10 ms resolution per
process), which says where the time goes independently of how many cores there are. Modes are
interleaved round by round in a rotated order. Every loop is bounded; children are killed at
exit and also exit on their own when this process dies or after ``--child-lifetime`` seconds.

Needs the ``bench`` extra (fastapi, uvicorn, aiohttp). Run by hand; results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
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

from messages.reward import Response as Completion  # noqa: E402
from messages.reward import ScoreReply, ScoreRequest, ScoreResult  # noqa: E402
from messages.routing import Envelope  # noqa: E402

try:  # the ``bench`` extra; at module level so that FastAPI can resolve the annotations below
    from fastapi import FastAPI, Request, Response
except ImportError:  # the zmq modes still run
    FastAPI = Request = Response = None  # type: ignore[assignment,misc]

SOLUTION = ("Let x be the number of apples. Then 3x + 4 = 25, so 3x = 21 and x = 7. "
            "Each basket holds 6 apples, so 7 * 6 = 42 apples in total. ") * 2
SOLUTION = (SOLUTION + "#### 42")[:200]
RESULT = [ScoreResult(score=1.0)]


def score_request(n: int) -> ScoreRequest:
    """One group's request: the prompt's fields once, ``n`` responses."""
    return ScoreRequest("openai/gsm8k", "42", [Completion(SOLUTION, 60)] * n)


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
    from messages.reward import ToRewardWorker
    from messages.routing import ToWorker, WorkerHeartbeat, WorkerHello

    async def main() -> None:
        zctx = zmq.Context()
        codec: Codec[ToWorker] = Codec(ToWorker)
        body_codec: Codec[ToRewardWorker] = Codec(ToRewardWorker)
        routes = 1 if args.bind else 0  # a ROUTER's frames start with the client's identity
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
                    frames = await sock.recv_multipart()
                    route, rest = frames[:routes], frames[routes:]
                    if len(rest) != 2:  # the router's acknowledgements and errors: one frame
                        continue
                    envelope = codec.decode(rest[0])
                    if isinstance(envelope, Envelope):
                        request = body_codec.decode(rest[1])
                        reply = ScoreReply(results=RESULT * len(request.responses))
                        await sock.send_multipart([*route, encode(Envelope(envelope.request_id)),
                                                   encode(reply)])

    anyio.run(main, backend="trio")


def role_router(args: argparse.Namespace) -> None:
    """The project's router actor, as the runner would start it (trio, no control channel)."""
    from actors.job.config.load import apply_overrides, decode_topology
    from actors.router.actor import router_actor
    from actors.runtime.actor import run_actor

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
        reply = ScoreReply(results=RESULT * len(msg.responses))
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


# ----------------------------------------------------------------------------- parent

CHILDREN: list[subprocess.Popen] = []


def spawn(role: str, lifetime: float, stdin=None, stdout=None, **kw: str | int | float) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role,
           "--parent", str(os.getpid()), "--child-lifetime", str(lifetime)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=stdin, stdout=stdout)
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


def role_zmq_client(args: argparse.Namespace) -> None:
    """Pipelined pyzmq client: ``--concurrency`` requests in flight over one DEALER."""
    import zmq

    from messages.routing import ToClient

    decode_envelope = msgspec.msgpack.Decoder(ToClient).decode
    decode = msgspec.msgpack.Decoder(ScoreReply).decode
    encode = msgspec.msgpack.Encoder().encode
    request = score_request(args.items)
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    for opt, val in ((zmq.SNDHWM, 100_000), (zmq.RCVHWM, 100_000), (zmq.LINGER, 0),
                     (zmq.RCVTIMEO, int((args.seconds + 20) * 1000))):  # a lost reply fails loudly
        sock.setsockopt(opt, val)
    for ep in args.connect.split(","):
        sock.connect(ep)
    sent_at: dict[int, float] = {}
    lat: list[float] = []
    sent = 0

    def send_request() -> None:
        # the body is encoded per request, as the sampler does (one group each)
        nonlocal sent
        sent_at[sent] = time.perf_counter()
        sock.send(encode(Envelope(sent, "reward")), zmq.SNDMORE)
        sock.send(encode(request))
        sent += 1

    def run(conc: int, n: int, seconds: float) -> float:
        first = sent
        start = time.perf_counter()
        stop_at = start + seconds
        for _ in range(min(conc, n)):
            send_request()
        while sent_at:
            frame = sock.recv(copy=False)  # blocks for the first; zmq.Again after RCVTIMEO
            while True:
                assert frame.more  # an envelope, then the body
                envelope = decode_envelope(frame.buffer)
                body = sock.recv(copy=False)
                assert not body.more
                reply = decode(body.buffer)
                now = time.perf_counter()
                assert isinstance(envelope, Envelope), envelope
                assert len(reply.results) == len(request.responses), reply
                lat.append(now - sent_at.pop(envelope.request_id))
                if sent - first < n and now < stop_at:
                    send_request()
                try:
                    frame = sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
        return time.perf_counter() - start

    try:
        run(4, 200, 10.0)  # warm-up: every connection up, so the DEALER spreads over all workers
        lat.clear()
        client_ready_then_measure(args, run, lat)
    finally:
        zctx.destroy(linger=0)


def role_http_client(args: argparse.Namespace) -> None:
    """aiohttp client: ``--concurrency`` tasks, each with one request in flight."""
    import aiohttp

    url = f"http://127.0.0.1:{args.port}/score"
    headers = {"content-type": "application/json"}
    request = score_request(args.items)
    decode = msgspec.json.Decoder(ScoreReply).decode
    encode = msgspec.json.Encoder().encode
    lat: list[float] = []

    async def main() -> None:
        counter = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def run_async(conc: int, n: int, seconds: float) -> float:
                start = time.perf_counter()
                stop_at = start + seconds
                last = counter + n

                async def loop() -> None:
                    nonlocal counter
                    while counter < last and time.perf_counter() < stop_at:
                        counter += 1
                        t0 = time.perf_counter()
                        body = encode(request)  # HTTP/1.1 pairs a reply with its request
                        async with session.post(url, data=body, headers=headers) as resp:
                            data = await resp.read()
                        reply = decode(data)
                        lat.append(time.perf_counter() - t0)
                        assert len(reply.results) == len(request.responses)

                async with asyncio.timeout(seconds + 20):
                    await asyncio.gather(*(loop() for _ in range(conc)))
                return time.perf_counter() - start

            # warm-up: one keep-alive connection per task, all open before the measurement
            await run_async(args.concurrency, 4 * args.concurrency, 10.0)
            lat.clear()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, client_ready)
            cpu0 = time.process_time()
            elapsed = await run_async(args.concurrency, args.requests, args.seconds)
            client_report(elapsed, time.process_time() - cpu0, lat)

    asyncio.run(main())


def client_ready() -> None:
    """Tell the parent this client is warmed up, then wait for its go (one line on stdin)."""
    print("ready", flush=True)
    sys.stdin.readline()


def client_report(elapsed: float, cpu: float, lat: list[float]) -> None:
    print(json.dumps({"elapsed": elapsed, "cpu": cpu, "lat": [round(x * 1e6) for x in lat]}), flush=True)


def client_ready_then_measure(args: argparse.Namespace, run, lat: list[float]) -> None:
    client_ready()
    cpu0 = time.process_time()
    elapsed = run(args.concurrency, args.requests, args.seconds)
    client_report(elapsed, time.process_time() - cpu0, lat)


ROLES = {"zmq-worker": role_zmq_worker, "router": role_router,
         "http-worker": role_http_worker, "http-proxy": role_http_proxy,
         "zmq-client": role_zmq_client, "http-client": role_http_client}


def cpu_seconds(procs: list[subprocess.Popen]) -> float:
    """User + system CPU time of live processes so far (from /proc; clock-tick resolution)."""
    total = 0
    for proc in procs:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


class Mode:
    """One mode's long-lived processes, and how its clients reach it."""

    def __init__(self, name: str, client_role: str, target: dict[str, str | int],
                 hop: list[subprocess.Popen], workers: list[subprocess.Popen]) -> None:
        self.name, self.client_role, self.target = name, client_role, target
        self.hop, self.workers = hop, workers

    def measure(self, args: argparse.Namespace, conc: int, items: int, n: int,
                seconds: float) -> dict[str, float]:
        """Run ``--clients`` client processes (at most ``conc``) sharing ``conc`` in flight."""
        k = max(1, min(args.clients, conc))
        shares = [conc // k + (i < conc % k) for i in range(k)]
        clients = [spawn(self.client_role, args.child_lifetime, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, concurrency=share, items=items,
                         requests=max(1, n // k), seconds=seconds, **self.target)
                   for share in shares]
        try:
            for proc in clients:
                if proc.stdout.readline().strip() != b"ready":
                    raise RuntimeError(f"{self.client_role} did not start")
            hop0, workers0 = cpu_seconds(self.hop), cpu_seconds(self.workers)
            for proc in clients:
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
            reports = []
            for proc in clients:
                out, _ = proc.communicate(timeout=seconds + 60)
                reports.append(json.loads(out))
            hop1, workers1 = cpu_seconds(self.hop), cpu_seconds(self.workers)
        finally:
            for proc in clients:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                CHILDREN.remove(proc)
        lat = sorted(x for r in reports for x in r["lat"])
        done = len(lat)
        elapsed = max(r["elapsed"] for r in reports)
        us = 1e6 / max(1, done)
        return {"done": done, "elapsed": elapsed, "rps": done / elapsed, "ips": done * items / elapsed,
                "p50": pct(lat, 0.5) / 1e3, "p99": pct(lat, 0.99) / 1e3,
                "cpu_client": sum(r["cpu"] for r in reports) * us,
                "cpu_hop": (hop1 - hop0) * us, "cpu_workers": (workers1 - workers0) * us}


def start_mode(mode: str, args: argparse.Namespace, sockets: str) -> Mode:
    life = args.child_lifetime
    if mode == "direct":
        eps = [f"ipc://{sockets}/direct-{i}" for i in range(args.workers)]
        workers = [spawn("zmq-worker", life, bind=ep, name=f"echo-{i}") for i, ep in enumerate(eps)]
        return Mode(mode, "zmq-client", {"connect": ",".join(eps)}, [], workers)
    if mode == "router":
        front, back = f"ipc://{sockets}/router", f"ipc://{sockets}/router-workers"
        hop = [spawn("router", life, bind=front, connect=back)]
        time.sleep(0.5)
        workers = [spawn("zmq-worker", life, connect=back, name=f"echo-{i}") for i in range(args.workers)]
        return Mode(mode, "zmq-client", {"connect": front}, hop, workers)
    if mode in ("http-direct", "http-proxy"):
        ports = [free_port() for _ in range(1 if mode == "http-direct" else args.workers)]
        workers = [spawn("http-worker", life, port=port) for port in ports]
        for port in ports:
            wait_http(port)
        if mode == "http-direct":
            return Mode(mode, "http-client", {"port": ports[0]}, [], workers)
        target = free_port()
        hop = [spawn("http-proxy", life, port=target, upstreams=",".join(map(str, ports)))]
        wait_http(target)
        return Mode(mode, "http-client", {"port": target}, hop, workers)
    raise SystemExit(f"unknown mode {mode}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="echo workers behind router/proxy/direct")
    p.add_argument("--concurrency", default="1,32", help="requests in flight, comma-separated")
    p.add_argument("--items", default="1,8", help="responses per request, comma-separated")
    p.add_argument("--clients", type=int, default=1, help="client processes (every mode alike)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians reported)")
    p.add_argument("--requests", type=int, default=200_000, help="max requests per measurement")
    p.add_argument("--seconds", type=float, default=2.0, help="max seconds per measurement")
    p.add_argument("--modes", default="direct,router,http-direct,http-proxy")
    p.add_argument("--child-lifetime", type=float, default=900.0)
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
        if args.role.endswith("-client"):
            args.concurrency, args.items = int(args.concurrency), int(args.items)
        ROLES[args.role](args)
        return 0

    concs = [int(c) for c in args.concurrency.split(",")]
    item_counts = [int(i) for i in args.items.split(",")]
    names = args.modes.split(",")
    sockets = tempfile.mkdtemp(dir="/tmp", prefix="bench-router-")
    envelope = len(msgspec.msgpack.encode(Envelope(0, "reward")))
    sizes = ", ".join(f"{i} items: msgpack {envelope} + {len(msgspec.msgpack.encode(score_request(i)))} B "
                      f"json {len(msgspec.json.encode(score_request(i)))} B" for i in item_counts)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()}, "
          f"workers={args.workers}, clients={args.clients}, item = {len(SOLUTION)}-char solution "
          f"({sizes}), {args.rounds} rounds x (<= {args.requests} req or <= {args.seconds} s) "
          f"per mode, C and items", flush=True)

    results: dict[tuple[str, int, int], list[dict[str, float]]] = {}
    try:
        # every mode's processes are up for the whole run (idle ones only heartbeat), and the
        # measurements are interleaved round by round in a rotated order: background load
        # that comes and goes then hits every mode alike
        modes = {name: start_mode(name, args, sockets) for name in names}
        time.sleep(1.0)
        for mode in modes.values():
            mode.measure(args, 4, 1, 2000, 0.5)  # warm-up: imports, caches, the router's workers
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            print(f"round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.2f})", flush=True)
            for name in order:
                for c in concs:
                    for items in item_counts:
                        row = modes[name].measure(args, c, items, args.requests, args.seconds)
                        results.setdefault((name, c, items), []).append(row)
                        print(f"  {name:<12} C={c:<3} items={items:<2} {row['done']:>6} req in "
                              f"{row['elapsed']:5.2f} s {row['rps']:>7.0f} req/s {row['ips']:>7.0f} "
                              f"items/s  p50 {row['p50']:7.3f} ms  p99 {row['p99']:7.3f} ms  CPU us/req "
                              f"client {row['cpu_client']:4.0f} hop {row['cpu_hop']:4.0f} "
                              f"workers {row['cpu_workers']:4.0f}", flush=True)
    finally:
        kill_children()
        shutil.rmtree(sockets, ignore_errors=True)

    med = statistics.median
    print()
    print(f"medians over {args.rounds} rounds (per-round min..max in brackets); "
          f"CPU = CPU time per request in us, by process kind")
    print(f"{'mode':<12} {'C':>3} {'items':>5} {'req/s':>20} {'items/s':>8} {'p50 ms':>22} {'p99 ms':>8} "
          f"{'CPU client':>10} {'hop':>5} {'workers':>7}")
    for (name, c, items), rs in results.items():
        col = {k: [x[k] for x in rs] for k in rs[0]}
        print(f"{name:<12} {c:>3} {items:>5} {med(col['rps']):>7.0f} [{min(col['rps']):>5.0f}..{max(col['rps']):>5.0f}] "
              f"{med(col['ips']):>8.0f} {med(col['p50']):>7.3f} [{min(col['p50']):.3f}..{max(col['p50']):.3f}] "
              f"{med(col['p99']):>8.3f} {med(col['cpu_client']):>10.0f} {med(col['cpu_hop']):>5.0f} "
              f"{med(col['cpu_workers']):>7.0f}")

    def ratio(a: tuple[str, int, int], b: tuple[str, int, int], key: str) -> str:
        per_round = [x[key] / y[key] for x, y in zip(results[a], results[b], strict=True)]
        of_medians = med(x[key] for x in results[a]) / med(y[key] for y in results[b])
        return (f"{med(per_round):.2f}x (per round {min(per_round):.2f}..{max(per_round):.2f}; "
                f"of medians {of_medians:.2f}x)")

    c1, cmax = min(concs), max(concs)
    for items in item_counts:
        print()
        print(f"items={items} per request (req/s ratios; items/s ratios are the same)")
        if ("router", c1, items) in results and ("direct", c1, items) in results:
            print(f"  router p50 / direct p50 at C={c1}: {ratio(('router', c1, items), ('direct', c1, items), 'p50')}"
                  + ("  target < 2x" if c1 == 1 else ""))
            for c in concs:
                print(f"  router req/s / direct req/s at C={c}: "
                      f"{ratio(('router', c, items), ('direct', c, items), 'rps')}")
        if ("router", cmax, items) in results and ("http-proxy", cmax, items) in results:
            for c in concs:
                print(f"  router req/s / http-proxy req/s at C={c}: "
                      f"{ratio(('router', c, items), ('http-proxy', c, items), 'rps')}"
                      + ("  target >= 10x" if c == cmax else ""))
            print(f"  http-proxy p50 / router p50 at C={c1}: "
                  f"{ratio(('http-proxy', c1, items), ('router', c1, items), 'p50')}")
            print(f"  http-proxy hop CPU / router hop CPU per request at C={cmax}: "
                  f"{ratio(('http-proxy', cmax, items), ('router', cmax, items), 'cpu_hop')}")
        if ("direct", cmax, items) in results and ("http-proxy", cmax, items) in results:
            print(f"  direct req/s / http-proxy req/s at C={cmax}: "
                  f"{ratio(('direct', cmax, items), ('http-proxy', cmax, items), 'rps')}  (no router at all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
