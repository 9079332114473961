"""Time and peak memory of ``lm_head_logprobs`` paths, forward plus backward, side by side.

    python bench/bench_logprobs.py --n 8192 --vocab 49152 --hidden 576 --dtype float32
    python bench/bench_logprobs.py --chunk-sizes 512,1024,2048,4096   # one chunked row each

Each path runs in a fresh subprocess so that one path's peak cannot hide another's. The worker
allocates the inputs, notes the memory in use, runs one warm-up step and ``--repeats`` timed
steps (a step is the forward pass and ``backward`` of ``sum(logprobs * u)``, plus the entropy
term with ``--entropy``, into fresh ``.grad`` buffers) and reports the median time and the peak
memory above that baseline. On CPU that is the process's peak resident set (``ru_maxrss``)
minus its resident set after allocating the inputs, where the peak is first reset through
``/proc/self/clear_refs`` so that import-time peaks cannot mask the step's; on CUDA it is
``torch.cuda.max_memory_allocated`` minus the memory allocated after the inputs. Both include
the two gradient buffers, which every path returns.
Run by hand, not from the tests; results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8192, help="tokens N = B * T")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size V")
    parser.add_argument("--hidden", type=int, default=576, help="hidden size H")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda if present)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--entropy", action="store_true", help="also compute the entropy")
    parser.add_argument("--chunk-sizes", default="1024", help="comma list, one chunked row each")
    parser.add_argument("--impls", default="auto", help="comma list; auto: naive, chunked, triton")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "impl:chunk_size", internal
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_measure(args)))
        return

    import torch  # the parent only needs it to pick the device

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    impls = args.impls.split(",") if args.impls != "auto" else ["naive", "chunked"]
    if args.impls == "auto" and device == "cuda":
        impls.append("triton")
    runs = []
    for impl in impls:
        sizes = args.chunk_sizes.split(",") if impl != "naive" else ["-"]
        runs += [f"{impl}:{size}" for size in sizes]

    print(
        f"N={args.n} V={args.vocab} H={args.hidden} dtype={args.dtype} device={device} "
        f"T={args.temperature} entropy={args.entropy} repeats={args.repeats} (+1 warm-up), "
        f"torch threads={torch.get_num_threads()}"
    )
    print(f"float32 (N, V) logits alone: {args.n * args.vocab * 4 / 2**20:,.0f} MiB")
    print(f"{'path':<16}{'median s':>10}{'min s':>9}{'peak MiB':>11}")
    results = {}
    for run in runs:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--device", device, "--worker", run]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            print(f"{run:<16} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        results[run] = res
        print(
            f"{run:<16}{res['median_s']:>10.3f}{min(res['times_s']):>9.3f}"
            f"{res['peak_bytes'] / 2**20:>11,.0f}"
        )
    naive = results.get("naive:-")
    if naive is None:
        return
    print("ratios against naive (memory target <= 0.25, time target <= 1.00):")
    for run, res in results.items():
        if run == "naive:-":
            continue
        mem = res["peak_bytes"] / naive["peak_bytes"]
        tim = res["median_s"] / naive["median_s"]
        print(
            f"  {run:<14} peak memory {mem:.3f} ({'met' if mem <= 0.25 else 'NOT met'}), "
            f"time {tim:.3f} ({'met' if tim <= 1.0 else 'NOT met'})"
        )


def _measure(args: argparse.Namespace) -> dict:
    """One path in this fresh process: median step time and peak memory above the inputs."""
    sys.path.insert(0, str(ROOT))
    import torch

    from kernels.lm_head_logprobs import lm_head_logprobs

    impl, chunk = args.worker.split(":")
    chunk_size = 1024 if chunk == "-" else int(chunk)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.n, args.hidden, generator=gen, device=device).to(dtype)
    weight = torch.randn(args.vocab, args.hidden, generator=gen, device=device)
    weight = (weight * (3 / math.sqrt(args.hidden))).to(dtype)  # logits of std ~3
    targets = torch.randint(0, args.vocab, (args.n,), generator=gen, device=device)
    up_lp = torch.randn(args.n, generator=gen, device=device)
    up_ent = torch.randn(args.n, generator=gen, device=device)
    hidden.requires_grad_()
    weight.requires_grad_()

    def step() -> None:
        hidden.grad = weight.grad = None
        out = lm_head_logprobs(
            hidden,
            weight,
            targets,
            temperature=args.temperature,
            chunk_size=chunk_size,
            with_entropy=args.entropy,
            impl=impl,
        )
        if args.entropy:
            loss = (out[0] * up_lp).sum() + (out[1] * up_ent).sum()
        else:
            loss = (out * up_lp).sum()
        loss.backward()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        baseline = _current_rss_bytes()
    times = []
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        step()
        sync()
        if i > 0:  # the first step is the warm-up
            times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline  # KiB
    return {"median_s": statistics.median(times), "times_s": times, "peak_bytes": peak}


def _reset_peak_rss() -> None:
    # Linux >= 4.0: lower the process's peak resident set (what ru_maxrss reports) to the
    # current one, so earlier peaks (imports, building the inputs) cannot mask this run's.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":
    main()
