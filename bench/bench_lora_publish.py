"""LoRA publishes: the adapters alone against the merged full model, side by side, bytes and
seconds per version, on the embedded model (SmolLM2-135M, fp32 on the CPU); and the bytes
computed for a 1.5B shape (Qwen2.5-1.5B's).

    python bench/bench_lora_publish.py                     # ranks 8 and 64, shm and zmq, 5 rounds
    python bench/bench_lora_publish.py --ranks 8 --transports shm --rounds 3

Per variant, the learner's side is a ``Policy`` with LoRA of that rank (``learner.lora``) and
the sampler's an ``HFEngine`` fed by a ``WeightsSubscriber`` over a real ZeroMQ socket (one
process: the sockets, files and engine load are the job's own). "merged" publishes what the
learner published before adapters (``Policy.snapshot``: every weight, the adapters merged in)
into a plain engine; "adapters" publishes ``Policy.published`` (the adapters alone, with their
``AdapterSpec``) into an engine that applies them. Seconds: gather (the learner's copy of what
it sends) and publish->loaded (publish called until the engine holds the version); rounds
interleave the variants so background load that comes and goes hits all alike; medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Qwen2.5-1.5B: hidden 1536, 28 layers, MLP 8960, 12 query heads and 2 KV heads of 128, vocab
# 151936, tied embeddings (its config.json)
SHAPE_1_5B = {"hidden": 1536, "layers": 28, "inter": 8960, "heads": 12, "kv": 2, "head_dim": 128,
              "vocab": 151936, "tied": True}


def lora_params(shape: dict, rank: int) -> int:
    """Adapter parameters of rank ``rank`` on q, k, v, o, gate, up and down of every layer
    (A: rank x in, B: out x rank)."""
    h, q, kv, inter = shape["hidden"], shape["heads"] * shape["head_dim"], \
        shape["kv"] * shape["head_dim"], shape["inter"]
    per_layer = sum(i + o for i, o in ((h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter),
                                       (inter, h)))
    return shape["layers"] * per_layer * rank


def model_params(shape: dict) -> int:
    h, q, kv = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv"] * shape["head_dim"]
    per_layer = h * q + 2 * (h * kv + kv) + q + q * h + 3 * h * shape["inter"] + 2 * h
    return shape["layers"] * per_layer + shape["vocab"] * h * (1 if shape["tied"] else 2) + h


async def main_async(args) -> None:
    import anyio
    import torch
    import zmq

    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner.policy import Policy
    from actors.model_store import resolve_model_path
    from actors.runtime.transports.table import TRANSPORTS
    from actors.runtime.weights import WeightsPublisher, WeightsSubscriber
    from actors.runtime.zmq_bridge import make_socket
    from actors.sampler.engines.hf import HFEngine

    model = resolve_model_path("default")
    folder = tempfile.mkdtemp(prefix="flowrl-bench-lora-")
    ranks = [int(r) for r in args.ranks.split(",")]
    transports = args.transports.split(",")
    variants = [(kind, r, t) for t in transports for r in ranks
                for kind in ("merged", "adapters")]
    policies = {}
    for r in ranks:
        topo = decode_topology(apply_overrides({}, [f"model.path={model}", f"learner.lora.rank={r}"]))
        policies[r] = Policy(topo, Path(folder) / f"run-{r}", None)
        with torch.no_grad():  # adapters as after training (lora_B starts at 0)
            for name, p in policies[r].model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 1e-3)
    zctx = zmq.Context()
    loaded: dict[tuple, list[float]] = {v: [] for v in variants}
    gathered: dict[tuple, list[float]] = {v: [] for v in variants}
    sizes: dict[tuple, int] = {}
    try:
        async with anyio.create_task_group() as tg:
            ends = {}
            for i, (kind, r, t) in enumerate(variants):
                address = f"ipc://{folder}/w{i}"
                pub = WeightsPublisher(make_socket(zctx, zmq.ROUTER, bind=address),
                                       TRANSPORTS[t].load().sender())
                sub = WeightsSubscriber(make_socket(zctx, zmq.DEALER, connect=address))
                tg.start_soon(pub.serve)
                tg.start_soon(sub.serve)
                ends[(kind, r, t)] = (pub, sub, HFEngine(model, "float32", 0))
            for round_ in range(args.rounds + 1):  # round 0 warms up (and injects the adapters)
                k = round_ % len(variants)
                for v in variants[k:] + variants[:k]:
                    kind, r, t = v
                    pub, sub, engine = ends[v]
                    policy = policies[r]
                    started = time.perf_counter()
                    if kind == "merged":
                        tensors, spec = policy.snapshot(torch.float32), None
                    else:
                        tensors, spec = policy.published(torch.float32), policy.adapter_spec()
                    gather = time.perf_counter() - started
                    await pub.publish(round_, tensors, adapter=spec)
                    await sub.wait_for(round_)
                    await engine.load_weights(*sub.take())
                    if round_:
                        loaded[v].append(time.perf_counter() - started)
                        gathered[v].append(gather)
                    sizes[v] = sum(x.numel() * x.element_size() for _, x in tensors)
            tg.cancel_scope.cancel()
    finally:
        for pub, sub, _ in ends.values():
            pub.close()
            sub.close()
            pub.sock.close()
            sub.sock.close()
        zctx.destroy(linger=0)
    print(f"embedded model {model.name}: fp32, {args.rounds} rounds, medians")
    print(f"{'transport':<9} {'rank':>4} {'publishes':<9} {'MiB/version':>12} {'gather s':>9} "
          f"{'publish->loaded s':>18}")
    for v in variants:
        kind, r, t = v
        print(f"{t:<9} {r:>4} {kind:<9} {sizes[v] / 2**20:>12.2f} "
              f"{statistics.median(gathered[v]):>9.3f} {statistics.median(loaded[v]):>18.3f}")
    full = model_params(SHAPE_1_5B)
    print(f"\n1.5B shape (Qwen2.5-1.5B), computed: {full / 1e9:.3f}B parameters, "
          f"{full * 2 / 2**20:.0f} MiB per merged version in bf16")
    for r in ranks:
        n = lora_params(SHAPE_1_5B, r)
        print(f"  rank {r:>3}: {n / 1e6:.2f}M adapter parameters, {n * 2 / 2**20:.1f} MiB per "
              f"version in bf16 ({full / n:.0f}x fewer bytes than merged)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="8,64")
    parser.add_argument("--transports", default="shm,zmq")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import anyio
    import torch

    torch.set_num_threads(1)
    anyio.run(main_async, args, backend="trio")


if __name__ == "__main__":
    main()
