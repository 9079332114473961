"""``learner.device`` / ``sampler.device`` and the ``dtype`` keys, resolved in the process that
computes (the runner never imports torch: ``auto`` is answered where the GPU would be used)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

# (the config's own modules, not its package: the weights transports, which the config's
# table names, import this module)
from actors.runtime.config.gpus import DEVICE_ENV, auto_device, process_share
from actors.runtime.config.placement import auto_dtype

P = ParamSpec("P")
R = TypeVar("R")


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """``auto`` → ``cuda:LOCAL_RANK`` when torch sees a GPU, else ``cpu``; ``cuda`` →
    ``cuda:LOCAL_RANK``; ``cuda:N`` and ``cpu`` as named (the config check has made sure a
    CUDA setting has a GPU behind it). A process the runner placed (``FLOWRL_DEVICE``) computes
    on the device the runner named, whatever the setting (but ``cpu``): ``cuda:0`` of the GPUs it
    was given, ``cuda:LOCAL_RANK`` for a learner rank, which sees all of its node's ranks' GPUs."""
    placed = os.environ.get(DEVICE_ENV)
    if placed and setting != "cpu":  # the runner placed this process: cuda:0 of what it sees
        setting = placed
    if setting == "auto":  # (torch's check touches the CUDA driver: asked for auto only)
        setting = auto_device(setting, torch.cuda.is_available())
    if setting == "cuda":
        setting = f"cuda:{local_rank}"
    device = torch.device(setting)
    set_thread_device(device)
    return device


def cap_memory(device: torch.device) -> float:
    """On a GPU this process shares with others, hold its caching allocator to the share of
    the GPU's memory the runner gave it (``config/gpus.py``); returns the share (0: none)."""
    share = process_share()
    if share and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(share, device)
    return share


class CudaMemory:
    """This process's caching allocator on ``device`` (``memory_lending.DeviceMemory``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = indexed(device)
        self.total = torch.cuda.get_device_properties(self.device).total_memory

    def cap(self, share: float) -> None:
        torch.cuda.set_per_process_memory_fraction(min(share, 1.0), self.device)

    def held(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)


def resolve_dtype(setting: str, device: torch.device, model_dtype: str) -> torch.dtype:
    """``setting`` as a torch dtype, ``auto`` answered for ``device`` (``auto_dtype``)."""
    return getattr(torch, auto_dtype(setting, device.type == "cuda", model_dtype))


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with an index: a bare ``cuda`` is ``cuda:0`` of the GPUs this process sees.
    ``torch.cuda.set_device`` refuses a CUDA device without one, and a device kept without it
    would follow whatever device the calling thread has current."""
    device = torch.device(device)
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


def set_thread_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for other devices).
    CUDA's current device is per thread: FSDP2, Triton kernels and ``torch.cuda`` calls without
    an index take it from the thread that runs them, and a fresh worker thread's is device 0."""
    if device.type == "cuda":
        torch.cuda.set_device(indexed(device))


def on_device(device: torch.device, fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` made to run with ``device`` current in whatever thread calls it: wrap every
    function handed to a worker thread (``anyio.to_thread.run_sync``, ``run_compute``) that does
    device work. The wrapper names its device (``.device``) and function (``__wrapped__``)."""
    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        set_thread_device(device)
        return fn(*args, **kwargs)

    run.device = device  # type: ignore[attr-defined]
    return run
