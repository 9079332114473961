"""A process that dies with its parent: the kernel's parent-death signal (Linux's
``PR_SET_PDEATHSIG``), for the processes flowrl starts that must never outlive what started
them (a sandboxed program, a Ray node's actor, a fork-server zygote, an environment server).

The signal follows the *thread* that started the process, not the whole parent process: call
it only in a process started from a thread that lives as long as its parent (a main thread, or
a keeper's own). Torch-free, importing nothing of the project: a sandboxed child or a server
started with ``python -c`` calls it first.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> bool:
    """Have the kernel kill this process (SIGKILL) when its parent ends; whether the parent is
    still there after the call (``parent``: the pid it must be; none: any but init), since
    one that ended just before would never send the signal: the caller then exits itself."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent if parent is not None else os.getppid() != 1
