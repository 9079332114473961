"""Time and peak memory of ``lm_head_logprobs`` paths, forward plus backward, side by side.

    python bench/bench_logprobs.py --n 8192 --vocab 49152 --hidden 576 --dtype float32
    python bench/bench_logprobs.py --chunk-sizes 512,1024,2048,4096   # one chunked row each

A step is the forward pass and ``backward`` of ``sum(logprobs * u)`` (plus ``sum(entropy * u2)``
with ``--entropy``) into fresh ``.grad`` buffers.

Peak memory: each path runs two steps in a fresh subprocess, so no path's peak can hide
another's. On CPU it is the process's peak resident set (``ru_maxrss``) minus its resident set
after allocating the inputs, where the peak is first reset through ``/proc/self/clear_refs`` so
that import-time peaks cannot mask the step's; on CUDA it is ``torch.cuda.max_memory_allocated``
minus the memory allocated after the inputs. Both include the two gradient buffers, which every
path returns.

Time: one more subprocess warms every path up once, then runs ``--repeats`` rounds in which
every path takes one step, in a rotated order each round. Interleaving matters on a shared
machine: load that comes and goes then slows all paths alike instead of whichever ran during
it. The table gives the median and the minimum per path; the minimum is the least disturbed.

``liger`` is Liger-Kernel's fused linear cross entropy
(``LigerFusedLinearCrossEntropyLoss(reduction="none")``, which returns −log p per token; the
temperature is applied by scaling the hidden states), the reference the fused kernels are measured against. It
is in the table whenever ``liger_kernel`` imports (the ``bench`` extra), and computes no entropy,
so with ``--entropy`` its row says so. A path that runs out of memory, fails, or cannot run here
(Liger's Triton kernels need a GPU) gets that reason in its row instead of numbers: the other
rows are still measured.

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
sys.path.insert(0, str(ROOT))  # kernels/, also when run as a script from a clone not installed


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
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: "memory" or "time"
    parser.add_argument("--paths", help=argparse.SUPPRESS)  # internal: "impl:chunk_size,..."
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
    if args.impls == "auto" and _liger_import_error() is None:
        impls.append("liger")
    runs = []
    for impl in impls:
        sizes = args.chunk_sizes.split(",") if impl not in ("naive", "liger") else ["-"]
        runs += [f"{impl}:{size}" for size in sizes]

    print(
        f"N={args.n} V={args.vocab} H={args.hidden} dtype={args.dtype} device={device} "
        f"T={args.temperature} entropy={args.entropy} repeats={args.repeats} (+1 warm-up), "
        f"torch threads={torch.get_num_threads()}"
    )
    print(f"float32 (N, V) logits alone: {args.n * args.vocab * 4 / 2**20:,.0f} MiB")
    from kernels.lm_head_logprobs import resolve_impl

    cmd = [sys.executable, __file__, *sys.argv[1:], "--device", device]
    peaks, failed = {}, {}
    for run in runs:
        out = _worker(cmd + ["--worker", "memory", "--paths", run])
        if "error" in out:
            failed[run] = out["error"]
        else:
            peaks[run] = out["peak_bytes"]
    measured = [run for run in runs if run not in failed]
    times = {}
    if measured:
        out = _worker(cmd + ["--worker", "time", "--paths", ",".join(measured)])
        times = out.get("times_s", {})
        failed.update(out.get("failed", {}) if "error" not in out else
                      {run: out["error"] for run in measured})

    print(f"{'path':<16}{'median s':>10}{'min s':>9}{'peak MiB':>11}   all timed steps (s)")
    for run in runs:
        if run in failed or not times.get(run):
            print(f"{run:<16}{'-':>10}{'-':>9}{'-':>11}   {failed.get(run, 'not timed')}")
            continue
        steps = " ".join(f"{t:.2f}" for t in times[run])
        print(
            f"{run:<16}{statistics.median(times[run]):>10.3f}{min(times[run]):>9.3f}"
            f"{peaks[run] / 2**20:>11,.0f}   {steps}"
        )
    picked = resolve_impl("auto", torch.device(device))
    print(f"the learner's path for this shape: {picked} (kernels/lm_head_logprobs.py picks triton "
          "for CUDA tensors when triton is installed, else chunked, whatever the shape; never "
          "Liger, which computes no entropy, the learner's update asks for it, and rounds the "
          "logits to the inputs' dtype)")
    runs = [run for run in runs if run not in failed and times.get(run)]
    if "naive:-" not in runs:
        return
    print("against naive (targets: peak memory <= 0.25, time <= 1.00):")
    naive_median, naive_min = statistics.median(times["naive:-"]), min(times["naive:-"])
    for run in runs:
        if run == "naive:-":
            continue
        mem = peaks[run] / peaks["naive:-"]
        median = statistics.median(times[run]) / naive_median
        fastest = min(times[run]) / naive_min
        print(
            f"  {run:<14} peak memory {mem:.3f} ({'met' if mem <= 0.25 else 'NOT met'}), "
            f"time median {median:.3f} ({'met' if median <= 1.0 else 'NOT met'}), "
            f"time min {fastest:.3f} ({'met' if fastest <= 1.0 else 'NOT met'})"
        )


def _worker(cmd: list[str]) -> dict:
    """A worker's result, or ``{"error": why}`` when it died (killed: the OOM killer, likely)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        if proc.returncode < 0:
            return {"error": f"killed by signal {-proc.returncode} (out of memory?)"}
        last = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"error": f"failed (exit {proc.returncode}): {last[0][:160]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _liger_import_error() -> str | None:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any reason it cannot load is reported
        return f"{type(exc).__name__}: {exc}"
    return None


def _failure(exc: BaseException) -> str:
    """A path's failure in one line: out of memory, or the exception."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "out of memory"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:160]}"


def _measure(args: argparse.Namespace) -> dict:
    """The worker: peak memory of one path, or interleaved step times of several."""
    import torch

    from kernels.lm_head_logprobs import lm_head_logprobs

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

    liger = None

    def step(run: str) -> float:
        nonlocal liger
        impl, chunk = run.split(":")
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        if impl == "liger":
            if args.entropy:
                raise NotImplementedError("Liger's fused linear cross entropy computes no entropy")
            if liger is None:
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
                liger = LigerFusedLinearCrossEntropyLoss(reduction="none")
            scaled = hidden / args.temperature if args.temperature != 1.0 else hidden
            loss = (-liger(weight, scaled, targets) * up_lp).sum()  # −(−log p)·u
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start
        out = lm_head_logprobs(
            hidden,
            weight,
            targets,
            temperature=args.temperature,
            chunk_size=1024 if chunk == "-" else int(chunk),
            with_entropy=args.entropy,
            impl=impl,
        )
        if args.entropy:
            loss = (out[0] * up_lp).sum() + (out[1] * up_ent).sum()
        else:
            loss = (out * up_lp).sum()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    runs = args.paths.split(",")
    if args.worker == "memory":
        (run,) = runs
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        else:
            _reset_peak_rss()
            baseline = _current_rss_bytes()
        try:
            step(run)
            step(run)
        except Exception as exc:  # noqa: BLE001 - reported in the path's row
            return {"error": _failure(exc)}
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated() - baseline
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline  # KiB
        return {"peak_bytes": peak}
    failed: dict[str, str] = {}

    def timed(run: str) -> float | None:
        try:
            return step(run)
        except Exception as exc:  # noqa: BLE001 - reported in the path's row
            failed[run] = _failure(exc)
            hidden.grad = weight.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None

    for run in runs:  # warm-up
        timed(run)
    times: dict[str, list[float]] = {run: [] for run in runs}
    for i in range(args.repeats):
        order = runs[i % len(runs) :] + runs[: i % len(runs)]
        for run in order:
            if run not in failed and (t := timed(run)) is not None:
                times[run].append(t)
    return {"times_s": {r: t for r, t in times.items() if r not in failed}, "failed": failed}


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
