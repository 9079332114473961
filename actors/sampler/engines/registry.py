"""The engines, one row each, and the one place an engine is chosen.

An engine is one file (or folder) under ``actors/sampler/engines/`` holding its class, its
``start(spec)``, its options section, its defaults and its availability check; its row here
says what the rest of the system needs to know without importing it (this module is
torch-free: the config reads it). ``sampler.engine = "auto"`` is resolved by ``auto_engine``
alone, when the topology loads; every other use goes through ``ENGINES``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from actors.runtime.transports.base import ReceiveInto
from actors.sampler.engines.vllm.options import vllm_problem

if TYPE_CHECKING:
    from actors.runtime.config import SamplerConfig
    from actors.sampler.engines.base import Engine, EngineSpec


async def _start_hf(spec: EngineSpec) -> Engine:
    from actors.sampler.engines.hf import start  # torch and transformers: only when started

    return await start(spec)


async def _start_vllm(spec: EngineSpec) -> Engine:
    from actors.sampler.engines.vllm.engine import start  # torch and vLLM: only when started

    return await start(spec)


@dataclass(frozen=True)
class EngineRow:
    """What the system knows of an engine without importing it."""

    name: str  # sampler.engine
    start: Callable[[EngineSpec], Awaitable[Engine]]  # its ``start`` (imported when called)
    problem: Callable[[], str | None] = lambda: None  # why it cannot run here, or None
    continuous: bool = False  # takes prompts one by one and can load weights in flight
    prefer_on_gpu: bool = False  # auto picks it when the sampler has a GPU and it can run
    in_worker: bool = False  # its own worker receives GPU weight transfers (WorkerTransfer)
    ranks: str = ""  # the sampler key giving its GPUs, one receiving worker each ("": one)
    adapters: bool = False  # applies LoRA adapters published alone (learner.lora.rank > 0)
    max_adapter_rank: int = 0  # the highest LoRA rank it serves (0: any)
    sleeps: bool = False  # has a sleep mode of its own, on a GPU (sampler.sleep_idle_s)
    measures_memory: bool = False  # sizes its cache from the GPU's free memory as it starts
    # (vLLM's profile run): started alone on a GPU it shares (``layout.start_after``)
    profiled: bool = False  # runs the batches of sampler.profile_batches under torch.profiler
    beside_learner: bool = False  # ``learner.weights_transport = "auto"`` sends it weights GPU
    # to GPU (the table's ``auto_beside`` row) when every sampler computes on the learner's
    # only GPU (``load.shares_learners_gpu``); else the host's file, as for any engine
    preload: tuple[str, ...] = ()  # its modules the local launcher's fork server imports ahead
    # of forking the samplers (none for an engine whose imports must happen in its process)


FALLBACK = "hf"  # auto's choice where no engine preferred on a GPU runs; a judge pool's default
ENGINES: dict[str, EngineRow] = {row.name: row for row in (
    # GPU to GPU beside the learner: 0.021 s per version at a 1.5B shape on an H200, against
    # 2.6 s through the host (BENCHMARKS.md "On one GPU"); vLLM's receiving side of it has not
    # run on a GPU yet
    EngineRow(FALLBACK, _start_hf, adapters=True, profiled=True, beside_learner=True,
              preload=("actors.sampler.engines.hf",)),
    EngineRow("vllm", _start_vllm, vllm_problem, continuous=True, prefer_on_gpu=True,
              in_worker=True, ranks="vllm.tensor_parallel_size", adapters=True,
              max_adapter_rank=512, sleeps=True, measures_memory=True),
)}
if TYPE_CHECKING:
    EngineName = str
    EngineChoice = str
else:  # the values of a pool's engine and of sampler.engine (auto too): decoding refuses others
    EngineName = Literal[tuple(ENGINES)]
    EngineChoice = Literal[("auto", *ENGINES)]


def receive_into(name: str, sampler: SamplerConfig, device: Any, timeout_s: float,
                 adapters: bool) -> ReceiveInto:
    """What a weights receiver needs of engine ``name``: whether its own workers (one per GPU)
    take GPU transfers (``WorkerTransfer``). Not with LoRA (``adapters``): the sampler process
    receives the adapters itself and hands them to the engine as tensors (megabytes; vLLM's
    weight-transfer API moves full weights only, its LoRA loading reads adapter folders)."""
    in_worker = ENGINES[name].in_worker and not adapters
    return ReceiveInto(device, in_worker, engine_gpus(name, sampler) if in_worker else 1,
                       timeout_s)


def engine_gpus(name: str, sampler: SamplerConfig) -> int:
    """The GPUs one engine ``name`` spans (its ``ranks`` key; 1 without one)."""
    value: Any = sampler
    for key in ENGINES[name].ranks.split(".") if ENGINES[name].ranks else ():
        value = getattr(value, key)
    return value if isinstance(value, int) else 1


def auto_engine(device: str = "auto") -> str:
    """``sampler.engine = "auto"`` for samplers on ``device`` (``sampler.device``): the first
    engine preferred on a GPU that can run, when the samplers compute on a GPU (``cuda``,
    ``cuda:N``, or ``auto`` where the runner sees one: ``visible_gpus``, the count placement
    hands out, found without importing torch); hf otherwise, and always for ``cpu``: a GPU
    engine started on a CPU sampler (no GPU visible to it) could only fail. On a CPU vllm trains
    the default job no faster than hf, starts later and cannot borrow the learner's threads, so
    a CPU keeps hf (the figures: BENCHMARKS.md, "The sampler's engines")."""
    if device == "cpu":
        return FALLBACK
    candidates = [r.name for r in ENGINES.values() if r.prefer_on_gpu]
    runnable = [name for name in candidates if ENGINES[name].problem() is None]
    if not runnable:
        return FALLBACK
    if device.startswith("cuda"):  # (the placement check makes sure there is one)
        return runnable[0]
    from actors.runtime.config.gpus import visible_gpus

    return runnable[0] if visible_gpus() else FALLBACK
