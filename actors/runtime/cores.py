"""Cores lent between the actors of one host: a sampler with nothing to generate lends its
threads, the learner takes them until the sampler has work again (and the other way round: a
learner waiting for its batch lends its threads to a sampler's in-process engine).

Why: on a small machine the sampler generates the next batch in a fraction of the learner's
step and then waits on admission (the staleness bound), its core idle, while the learner
trains on one thread. A fixed ``learner.threads = 2`` is worse than 1 there: its second thread
(and OpenMP's spin-waiting between operations) competes with the sampler whenever the sampler
generates. So the split follows the work instead: each lender has a slot in a small shared
table saying how many threads it lends now, and the learner, before every decoder layer's
forward and backward, sets its torch thread count to its own plus its share of what is lent.
A lender that starts generating takes its threads back within one layer of the learner's
work (tens of milliseconds on a CPU), without a message, a lock or a system call on either
side: the table is a memory-mapped file of int32 slots, each written by one process only.

The table is host-local (in the temporary directory, named by the run directory and the host
name), so actors of other hosts never see each other's slots. A lender that dies while lending
leaves its slot set until its restart clears it; the cost is threads competing, never a wrong
result. On a GPU the same table says how much GPU memory a sleeping engine lends the learner
on its GPU, and how much of it the learner holds (``memory_lending.py``).
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLOTS = 512
SAMPLERS = range(0, 128)  # sampler i lends in slot SAMPLERS[i % 128]
LEARNERS = range(128, 256)  # learner rank r of this host in LEARNERS[r]
MEMORY_LENT = range(256, 384)  # MiB of GPU memory sampler i's sleeping engine lends
MEMORY_HELD = range(384, 512)  # MiB of lent GPU memory learner rank r holds now
_SIZE = SLOTS * 4


def table_path(run_dir: Path) -> Path:
    """The host-local table of the run in ``run_dir``."""
    key = f"{Path(run_dir).resolve()}|{socket.gethostname()}".encode()
    return Path(tempfile.gettempdir()) / f"flowrl-cores-{hashlib.sha1(key).hexdigest()[:16]}"


class CoreTable:
    """The shared table: ``lend`` writes this process's slot, ``lent`` sums the others'."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # kept open: ``locked``
        if os.fstat(self._fd).st_size < _SIZE:  # every opener grows it to the same size: no race
            os.ftruncate(self._fd, _SIZE)
        self._map = mmap.mmap(self._fd, _SIZE)
        self.slots = memoryview(self._map).cast("i")  # (SLOTS,) int32, one writer each

    def lend(self, slot: int, threads: int) -> None:
        self.slots[slot] = threads

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The whole table to this caller, across processes (a file lock): for exchanges
        whose write and read must not interleave with another process's (GPU memory; the
        threads' slots need none: a stale read there costs speed, never a wrong result)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def lent(self, among: range) -> int:
        """Threads lent now by the slots in ``among``."""
        return sum(self.slots[i] for i in among)

    def close(self) -> None:
        self.slots.release()
        self._map.close()
        os.close(self._fd)


def remove_table(run_dir: Path) -> None:
    """At the end of a job: the table is gone with it (a later run makes a new one)."""
    Path(table_path(run_dir)).unlink(missing_ok=True)


class Lender:
    """One process's threads, lent while none of its calls computes.

    ``working()`` brackets every call that computes (a sampler's generations and weight
    loads); calls may overlap (a continuous engine runs many at once): the threads are lent
    only while none runs. ``idle()`` is the other way round: lent while it lasts (a learner
    waiting for its batch)."""

    def __init__(self, table: CoreTable | None, slot: int, threads: int) -> None:
        self.table, self.slot, self.threads = table, slot, threads
        self.active = 0  # calls computing now
        self.lent_s = 0.0  # total time lent (the sampler's status shows it)
        self._since: float | None = None
        if table is not None:
            table.lend(slot, 0)  # a restarted lender: whatever its predecessor left is stale

    @contextmanager
    def working(self) -> Iterator[None]:
        if self.active == 0 and self.table is not None:
            self.table.lend(self.slot, 0)
            if self._since is not None:
                self.lent_s += time.monotonic() - self._since
                self._since = None
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0 and self.table is not None:
                self.table.lend(self.slot, self.threads)
                self._since = time.monotonic()

    @contextmanager
    def idle(self) -> Iterator[None]:
        if self.table is not None:
            self.table.lend(self.slot, self.threads)
        try:
            yield
        finally:
            if self.table is not None:
                self.table.lend(self.slot, 0)

    def close(self) -> None:
        """Nothing lent from now on (the table stays open: it is ``Share``'s)."""
        if self.table is not None:
            self.table.lend(self.slot, 0)
            self.table = None


class LayerHooks:
    """Calls ``check`` before each decoder layer's forward and backward (the layers of the
    model's layer lists: a transformer's decoder layers) and each optimizer step: where the
    thread count of a step may change."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def check(self, *_: Any) -> None:
        raise NotImplementedError

    def attach(self, model: Any, optimizer: Any | None = None) -> None:
        import torch

        def after_forward(_module: Any, _inputs: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(self._before_backward)

        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList):
                for layer in module:
                    self._handles.append(layer.register_forward_pre_hook(self.check))
                    self._handles.append(layer.register_forward_hook(after_forward))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self.check))

    def _before_backward(self, _grad: Any) -> None:
        self.check()

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _set_threads(count: int) -> bool:
    """The calling thread's torch thread count (OpenMP's is per thread, and steps may run in
    different worker threads), set when it differs; True when it did."""
    import torch

    if count == torch.get_num_threads():
        return False
    torch.set_num_threads(count)
    return True


class Borrower(LayerHooks):
    """The borrowing side: before each decoder layer's forward and backward (and each
    optimizer step), the calling thread's torch thread count becomes ``own`` plus its share of
    what ``lenders`` lend now.

    ``rank``/``ranks``: the borrowers of this host split what is lent (the learner's ranks, or
    the samplers; rank r gets one more of the remainder when r is below it).

    With ``keep_trace`` the counts it set are kept until ``take_trace``: torch's CPU kernels do
    not give the same bits on every thread count for every shape (a small matrix product may
    split its sum between threads), so a step is rerun exactly only on the counts it ran with
    (``RerunThreads``). Only a borrower whose steps are recorded keeps them (the learner's rank
    0, taking them every step); any other would only grow the list."""

    def __init__(self, table: CoreTable, lenders: range, own: int, rank: int = 0,
                 ranks: int = 1, keep_trace: bool = False) -> None:
        super().__init__()
        self.table, self.lenders, self.own = table, lenders, own
        self.rank, self.ranks = rank, ranks
        self.changes = 0  # how often the calling thread's count was changed
        self.borrowed_calls = 0  # checks that found threads to borrow
        self.checks = 0
        self.keep_trace = keep_trace
        self.trace: list[int] = []  # the count each check since the last take_trace set

    def share(self) -> int:
        lent = self.table.lent(self.lenders)
        return lent // self.ranks + (1 if self.rank < lent % self.ranks else 0)

    def check(self, *_: Any) -> None:
        """Set the calling thread's torch threads to what is free now (a hook's signature)."""
        want = self.own + self.share()
        self.checks += 1
        if want > self.own:
            self.borrowed_calls += 1
        if self.keep_trace:
            self.trace.append(want)
        if _set_threads(want):
            self.changes += 1

    def detach(self) -> None:
        super().detach()
        _set_threads(self.own)

    def take_share(self) -> float:
        """The share of the checks since the last call that found threads to borrow (a
        step's ``perf/borrowed_share``: roughly the share of its layers run on more threads)."""
        share = self.borrowed_calls / max(self.checks, 1)
        self.borrowed_calls = self.checks = 0
        return share

    def take_trace(self) -> list[int]:
        """The counts the checks since the last call set, run-length encoded as ``[count,
        checks, count, checks, ...]`` (a step's ``threads`` in the recording's batches)."""
        out: list[int] = []
        for count in self.trace:
            if out and out[-2] == count:
                out[-1] += 1
            else:
                out += [count, 1]
        self.trace = []
        return out


class RerunThreads(LayerHooks):
    """A rerun's side: each check sets the count the live step's check at the same place set
    (``Borrower.take_trace``), so a step that ran on borrowed threads reruns on them.

    ``start(trace)`` before a step, on the thread that runs it; a step recorded without a trace
    runs on ``own`` threads. ``finish()`` after it says whether the rerun checked at as many
    places as the live step (an override that changes the micro-batches does not: the counts
    then no longer line up, and metrics may differ by float rounding)."""

    def __init__(self, own: int) -> None:
        super().__init__()
        self.own = own
        self._counts: list[int] = []  # the live step's count at each check, in order
        self._checks = 0  # checks of this step so far

    def start(self, trace: list[int] | None) -> None:
        self._counts = [c for c, n in zip(trace[::2], trace[1::2], strict=True)
                        for _ in range(n)] if trace else []
        self._checks = 0
        if self._counts:
            self.check()  # the live step's first check was at its start
        else:
            _set_threads(self.own)

    def check(self, *_: Any) -> None:
        if self._checks < len(self._counts):
            _set_threads(self._counts[self._checks])
        self._checks += 1

    def finish(self) -> str:
        """"" when the step's checks matched the live step's, else what differed."""
        if not self._counts or self._checks == len(self._counts):
            return ""
        return (f"the thread count was checked at {self._checks} places, in the live step at "
                f"{len(self._counts)}: the rerun's threads follow the live step's only so far")


@dataclass
class Share:
    """One process's part in its host's table: the threads it lends, and the borrower that
    takes others' (None: it only lends)."""

    table: CoreTable
    lender: Lender
    borrower: Borrower | None = None

    def close(self) -> None:
        if self.borrower is not None:
            self.borrower.detach()
        self.lender.close()
        self.table.close()
