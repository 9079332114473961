"""torch.profiler over chosen steps of a real job (``learner.profile_steps``,
``sampler.profile_batches``): what one step costs by op, inside the job, where a standalone bench
cannot see the job's own work (its threads, recording, the batch's assembly).

Each profiled step writes, under ``RUN_DIR/profiles/NAME/``, ``step_N.txt`` (the ops by CPU
time, by their own CPU time and, on a GPU, by CUDA time) and ``step_N.trace.json`` (every op on
a time line: open it in https://ui.perfetto.dev or chrome://tracing). docs/debugging.md says how
to read them. The profiler runs in the thread that computes: torch records the ops of the
thread that started it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

PROFILES = "profiles"  # RUN_DIR/profiles/NAME/step_N.{txt,trace.json}
ROWS = 30  # ops per table


def profile_dir(run_dir: Path, name: str) -> Path:
    return run_dir / PROFILES / name


@contextlib.contextmanager
def profiled(where: Path | None, step: int, device: torch.device) -> Iterator[None]:
    """Profile the body as step ``step`` into ``where`` (None: not profiled, no cost)."""
    if where is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield
        if cuda:
            torch.cuda.synchronize(device)
    where.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages()
    sorts = [("cpu_time_total", "by CPU time, the op and what it called"),
             ("self_cpu_time_total", "by the op's own CPU time")]
    if cuda:
        sorts.append(("self_cuda_time_total", "by CUDA kernel time"))
    text = [f"step {step}: torch.profiler, {len(prof.events())} op calls\n"]
    for key, what in sorts:
        text.append(f"\n== ops {what} (top {ROWS})\n")
        text.append(table.table(sort_by=key, row_limit=ROWS, max_name_column_width=60))
    (where / f"step_{step}.txt").write_text("".join(text) + "\n")
    prof.export_chrome_trace(str(where / f"step_{step}.trace.json"))
