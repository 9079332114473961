"""torch.profiler over chosen steps of a real job (``learner.profile_steps``,
``sampler.profile_batches``): what one step costs by op, inside the job, where a standalone bench
cannot see the job's own work (its threads, recording, the batch's assembly).

Each profiled step writes, under ``RUN_DIR/profiles/NAME/``, ``step_N.txt`` (the ops by CPU
time, by their own CPU time and, on a GPU, by CUDA time), ``step_N.json`` (the ops dispatched
from outside torch, in all and by name, CUDA kernel launches, what the profiled code added:
the tokens a sampler batch decoded) and ``step_N.trace.json`` (every op on a time line: open it
in https://ui.perfetto.dev or chrome://tracing). docs/debugging.md says how
to read them. The profiler runs in the thread that computes: torch records the ops of the
thread that started it.
"""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

PROFILES = "profiles"  # RUN_DIR/profiles/NAME/step_N.{txt,trace.json}
ROWS = 30  # ops per table
CUDA_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                 "cudaGraphLaunch")  # the runtime calls a kernel launch is


def profile_dir(run_dir: Path, name: str) -> Path:
    return run_dir / PROFILES / name


def dispatched_ops(events) -> collections.Counter[str]:
    """The torch ops a profiled span called from outside torch (its Python, autograd's engine,
    compiled code), by name: each aten op the profiler saw that no other aten op called. Each
    costs a dispatch, the overhead that bounds a step of small kernels on a GPU (what an op does
    inside, the ops it calls itself, is its own kernel's business)."""
    counts: collections.Counter[str] = collections.Counter()
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            counts[e.name] += 1
    return counts


@contextlib.contextmanager
def profiled(where: Path | None, step: int, device: torch.device) -> Iterator[dict[str, Any]]:
    """Profile the body as step ``step`` into ``where`` (None: not profiled, no cost). The body
    may add facts of its own (``tokens`` it decoded) to the dict it gets: they are written with
    the op counts into ``step_N.json``."""
    facts: dict[str, Any] = {}
    if where is None:
        yield facts
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield facts
        if cuda:
            torch.cuda.synchronize(device)
    where.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages()
    sorts = [("cpu_time_total", "by CPU time, the op and what it called"),
             ("self_cpu_time_total", "by the op's own CPU time")]
    if cuda:
        sorts.append(("self_cuda_time_total", "by CUDA kernel time"))
    ops = dispatched_ops(prof.events())
    launches = sum(1 for e in prof.events() if e.name in CUDA_LAUNCHES)
    (where / f"step_{step}.json").write_text(json.dumps({
        "step": step, "ops": sum(ops.values()), "cuda_launches": launches, **facts,
        "ops_by_name": dict(ops.most_common())}, indent=1) + "\n")
    text = [f"step {step}: torch.profiler, {len(prof.events())} op calls, "
            f"{sum(ops.values())} dispatched from outside torch"
            + (f", {launches} CUDA kernel launches" if cuda else "") + "\n"]
    for key, what in sorts:
        text.append(f"\n== ops {what} (top {ROWS})\n")
        text.append(table.table(sort_by=key, row_limit=ROWS, max_name_column_width=60))
    (where / f"step_{step}.txt").write_text("".join(text) + "\n")
    prof.export_chrome_trace(str(where / f"step_{step}.trace.json"))
