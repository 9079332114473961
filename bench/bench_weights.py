"""Weights from learner to sampler, per transport, side by side: publish-to-loaded seconds per
version and bytes moved, at the embedded model's size (SmolLM2-135M, fp32 on the CPU).

    python bench/bench_weights.py                    # shm, zmq, nccl (gloo here), 5 rounds
    python bench/bench_weights.py --transports shm,zmq --rounds 3

The learner's side is this process: a ``WeightsPublisher`` per transport, publishing the
model's parameters (CPU tensors, as ``Policy.snapshot`` hands them to shm and zmq). Each
sampler is a child process (``--child``) running the sampler's own ``WeightsSubscriber`` and
the hf engine (``HFEngine.load_weights``), which reports the wall time at which each version
was loaded into its model. Publish-to-loaded = that time minus the time ``publish`` was called
(one host, one clock). "publish returns" is how long the learner's own ``publish`` call took
(a GPU transport's broadcast runs after it, beside training). Rounds interleave the transports
(A B C, B C A, ...), so background load that comes and goes hits all alike; the table gives
the median and the best round. nccl runs over gloo here (no GPU): its numbers are gloo's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def child(address: str, reports: str, model: str) -> None:
    """A sampler: subscribe, load every version into the hf engine, report when it is in."""
    import anyio
    import zmq

    from actors.runtime.transports.base import ReceiveInto
    from actors.runtime.weights import WeightsSubscriber
    from actors.runtime.zmq_bridge import make_socket
    from actors.sampler.engines.hf import HFEngine

    engine = HFEngine(Path(model), "float32", 0)
    zctx = zmq.Context()
    with make_socket(zctx, zmq.DEALER, connect=address) as sock, \
         make_socket(zctx, zmq.PUSH, connect=reports) as report:
        sub = WeightsSubscriber(sock, into=ReceiveInto(timeout_s=120))
        async with anyio.create_task_group() as tg:
            tg.start_soon(sub.serve)
            while True:
                await sub.wait_for(sub.received + 1)
                got = sub.take()
                assert got is not None
                await engine.load_weights(*got)
                await report.send_multipart([f"{got[0]} {time.time()}".encode()])


async def main_async(args) -> None:
    import anyio
    import torch
    import zmq
    from transformers import AutoModelForCausalLM

    from actors.model_store import resolve_model_path
    from actors.runtime.transports.base import TRANSPORTS
    from actors.runtime.weights import WeightsPublisher
    from actors.runtime.zmq_bridge import make_socket

    model = resolve_model_path("default")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tensors = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
    del hf
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    names = args.transports.split(",")
    folder = tempfile.mkdtemp(prefix="flowrl-bench-weights-")
    zctx = zmq.Context()
    procs, pubs, pulls = [], {}, {}
    rows: dict[str, list[float]] = {n: [] for n in names}
    returns: dict[str, list[float]] = {n: [] for n in names}
    try:
        async with anyio.create_task_group() as tg:
            for name in names:
                address = f"ipc://{folder}/{name}"
                sock = make_socket(zctx, zmq.ROUTER, bind=address)
                pulls[name] = make_socket(zctx, zmq.PULL, bind=f"{address}-reports")
                pubs[name] = WeightsPublisher(sock, TRANSPORTS[name].halves().sender(**(
                    {"address": "127.0.0.1", "timeout_s": 120} if name == "nccl" else {})))
                tg.start_soon(pubs[name].serve)
                procs.append(await anyio.open_process(
                    [sys.executable, __file__, "--child", address, f"{address}-reports",
                     str(model)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                    stdout=None, stderr=None))
            for name in names:  # every sampler has polled: it waits for a version
                while not pubs[name].have:
                    await pubs[name]._polled.wait()
            for r in range(args.rounds + 1):  # round 0 warms up (first group, first load)
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    started = time.time()
                    await pubs[name].publish(r, tensors, bucket_bytes=args.bucket_mb << 20)
                    returned = time.time() - started
                    version, loaded = (await pulls[name].recv_multipart())[0].decode().split()
                    assert int(version) == r
                    if r:
                        rows[name].append(float(loaded) - started)
                        returns[name].append(returned)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            for p in procs:
                p.kill()
                await p.wait()
        for name, pub in pubs.items():
            pub.close()
            pub.sock.close()
            pulls[name].close()
        zctx.destroy(linger=0)
    print(f"weights: {len(tensors)} tensors, {nbytes / 2**20:.0f} MiB per version (fp32), "
          f"{args.rounds} rounds, medians (best)")
    print(f"{'transport':<10} {'publish->loaded s':>20} {'publish returns s':>20} "
          f"{'MiB/s':>8}  bytes moved per version and sampler")
    moved = {"zmq": "tensors over the socket, then copied into the model",
             "shm": "one file write (learner), mapped and copied into the model (sampler)",
             "nccl": "one broadcast (gloo here), then copied into the model"}
    for name in names:
        med, best = statistics.median(rows[name]), min(rows[name])
        ret = statistics.median(returns[name])
        print(f"{name:<10} {med:>12.3f} ({best:.3f}) {ret:>20.3f} {nbytes / 2**20 / med:>8.0f}  "
              f"{nbytes / 2**20:.0f} MiB: {moved.get(name, '')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transports", default="shm,zmq,nccl")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=256, help="learner.weights_bucket_mb")
    parser.add_argument("--child", nargs=3, metavar=("ADDRESS", "REPORTS", "MODEL"))
    args = parser.parse_args()
    import anyio
    import torch

    torch.set_num_threads(1)
    if args.child:
        anyio.run(child, *args.child, backend="trio")
    else:
        anyio.run(main_async, args, backend="trio")


if __name__ == "__main__":
    main()
