"""Weights from learner to sampler, per transport, side by side: publish-to-loaded seconds per
version and bytes moved, at the embedded model's size (SmolLM2-135M, fp32 on the CPU).

    python bench/bench_weights.py                    # shm, zmq, nccl (gloo here), 5 rounds
    python bench/bench_weights.py --transports shm,zmq --rounds 3
    python bench/bench_weights.py --device cuda --transports shm,ipc --model DIR   # on a GPU

``--device cuda``: the learner's weights are on its GPU (cuda:0) in bf16, as a learner computing
in bf16 publishes them, and the sampler's hf engine runs on a GPU: cuda:0 for ipc (the
learner's own GPU, the only place it can go), cuda:1 for nccl. A CPU transport's time includes
the learner's copy to host memory (the learner gathers to the CPU for them). Every version's
load is checked: the sampler reports a checksum of its model's weights, which must equal the
published tensors' (the version it reports is the one it holds).

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


def checksum(tensors) -> float:
    """The weights' sum in float64 (what both sides compare)."""
    return float(sum(t.double().sum().item() for _, t in tensors))


async def child(address: str, reports: str, model: str, device: str = "cpu") -> None:
    """A sampler: subscribe, load every version into the hf engine, report when it is in and
    the checksum of what its model then holds."""
    import anyio
    import zmq

    from actors.runtime.transports.base import ReceiveInto
    from actors.runtime.weights import WeightsSubscriber
    from actors.runtime.zmq_bridge import make_socket
    from actors.sampler.engines.hf import HFEngine

    engine = HFEngine(Path(model), "bfloat16" if device != "cpu" else "float32", 0,
                      device=device)
    zctx = zmq.Context()
    with make_socket(zctx, zmq.DEALER, connect=address) as sock, \
         make_socket(zctx, zmq.PUSH, connect=reports) as report:
        sub = WeightsSubscriber(sock, into=ReceiveInto(device=engine.device, timeout_s=120))
        async with anyio.create_task_group() as tg:
            tg.start_soon(sub.serve)
            while True:
                await sub.wait_for(sub.received + 1)
                got = sub.take()
                assert got is not None
                await engine.load_weights(*got)
                loaded = time.time()
                state = engine.model.state_dict()
                held = checksum((n, state[n]) for n in got[1] if n in state)
                await report.send_multipart([f"{got[0]} {loaded} {held!r}".encode()])


async def main_async(args) -> None:
    import anyio
    import torch
    import zmq
    from transformers import AutoModelForCausalLM

    from actors.model_store import resolve_model_path
    from actors.runtime.transports.table import TRANSPORTS
    from actors.runtime.weights import WeightsPublisher
    from actors.runtime.zmq_bridge import make_socket

    model = Path(args.model) if args.model else resolve_model_path("default")
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    tensors = [(n, p.detach().to("cuda:0" if cuda else "cpu", copy=True))
               for n, p in hf.named_parameters()]
    del hf
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    sampler_device = {"ipc": "cuda:0", "nccl": "cuda:1"} if cuda else {}
    bad: list[str] = []
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
                row = TRANSPORTS[name]
                options: dict = {"device": "cuda:0"} if cuda and row.gpu else {}
                if name == "nccl":
                    options.update(address="127.0.0.1", timeout_s=120)
                pubs[name] = WeightsPublisher(sock, row.load().sender(**options))
                tg.start_soon(pubs[name].serve)
                procs.append(await anyio.open_process(
                    [sys.executable, __file__, "--child", address, f"{address}-reports",
                     str(model), sampler_device.get(name, "cuda:0" if cuda else "cpu")],
                    cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                    stdout=None, stderr=None))
            for name in names:  # every sampler has polled: it waits for a version
                while not pubs[name].have:
                    await pubs[name]._polled.wait()
            for r in range(args.rounds + 1):  # round 0 warms up (first group, first load)
                order = names[r % len(names):] + names[:r % len(names)]
                tensors[-1][1].fill_(r)  # each version differs (the last norm's weight)
                expected = checksum(tensors)
                for name in order:
                    started = time.time()
                    sent = tensors
                    if cuda and not TRANSPORTS[name].gpu:  # the learner gathers to the CPU
                        sent = [(n, t.to("cpu")) for n, t in tensors]
                    await pubs[name].publish(r, sent, bucket_bytes=args.bucket_mb << 20)
                    returned = time.time() - started
                    version, loaded, held = (await pulls[name].recv_multipart())[0].decode().split()
                    assert int(version) == r
                    if abs(float(held) - expected) > 1e-6 * max(1.0, abs(expected)):
                        bad.append(f"{name} v{r}: holds {held}, published {expected!r}")
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
    print(f"weights: {len(tensors)} tensors, {nbytes / 2**20:.0f} MiB per version "
          f"({str(dtype).removeprefix('torch.')}, {args.device}), {args.rounds} rounds, "
          "medians (best)")
    print(f"{'transport':<10} {'publish->loaded s':>20} {'publish returns s':>20} "
          f"{'MiB/s':>8}  bytes moved per version and sampler")
    moved = {"zmq": "tensors over the socket, then copied into the model",
             "shm": "one file write (learner), mapped and copied into the model (sampler)",
             "nccl": f"one broadcast ({'NCCL' if cuda else 'gloo here'}), then copied into "
                     "the model",
             "ipc": "CUDA IPC handles, the model copies from the learner's memory"}
    for name in names:
        med, best = statistics.median(rows[name]), min(rows[name])
        ret = statistics.median(returns[name])
        print(f"{name:<10} {med:>12.3f} ({best:.3f}) {ret:>20.3f} {nbytes / 2**20 / med:>8.0f}  "
              f"{nbytes / 2**20:.0f} MiB: {moved.get(name, '')}")
    print("every load holds the version it reports" if not bad else
          "MISMATCH: " + "; ".join(bad))
    if bad:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transports", default="shm,zmq,nccl")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=256, help="learner.weights_bucket_mb")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the learner's weights and the sampler's engine are")
    parser.add_argument("--model", default="", help="a Hugging Face directory (default: the "
                        "embedded model)")
    parser.add_argument("--child", nargs=4, metavar=("ADDRESS", "REPORTS", "MODEL", "DEVICE"))
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
