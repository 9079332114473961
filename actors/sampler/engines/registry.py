"""The engines, one row each, and the one place an engine is chosen.

An engine is one file under ``actors/sampler/engines/`` holding its class, its ``start(spec)``
(what it needs from the topology: its own config section and the sampler's keys), its defaults
and its availability check; its row here says what the rest of the system needs to know
without importing it (this module is torch-free: the config checks read it). ``sampler.engine
= "auto"`` is resolved by ``auto_engine`` alone, every other use goes through ``ENGINES``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.runtime.config import SamplerConfig
    from actors.sampler.engines.base import Engine


@dataclass(frozen=True)
class EngineRow:
    """What the system knows of an engine without importing it."""

    name: str  # sampler.engine
    module: str  # its file: defines ``start(spec) -> Engine``
    problem: str = ""  # "module:function" returning why it cannot run here, or None ("": never)
    continuous: bool = False  # takes prompts one by one and can load weights in flight
    prefer_on_gpu: bool = False  # auto picks it when the sampler has a GPU and it can run
    in_worker: bool = False  # its own worker receives GPU weight transfers (WorkerTransfer)
    ranks: str = ""  # the sampler key giving its receiving workers ("": one), dotted
    receives: tuple[str, ...] = ("zmq", "shm")  # the weights transports it has a receiver for
    needs_cuda: tuple[str, ...] = ()  # of those, the ones it can take only on CUDA
    adapters: bool = False  # applies LoRA adapters published alone (learner.lora.rank > 0)
    max_adapter_rank: int = 0  # the highest LoRA rank it serves (0: any)


ENGINES: dict[str, EngineRow] = {row.name: row for row in (
    EngineRow("hf", "actors.sampler.engines.hf", receives=("zmq", "shm", "nccl", "ipc"),
              needs_cuda=("ipc",), adapters=True),  # nccl: gloo on a CPU
    EngineRow("vllm", "actors.sampler.engines.vllm.engine",
              problem="actors.sampler.engines.vllm.options:vllm_problem", continuous=True,
              prefer_on_gpu=True, in_worker=True, ranks="vllm.tensor_parallel_size",
              receives=("zmq", "shm", "nccl", "ipc"), needs_cuda=("ipc",),  # nccl: gloo on CPU
              adapters=True, max_adapter_rank=512),
)}


@dataclass(frozen=True)
class AdapterLimits:
    """The LoRA adapters an engine applies (``learner.lora.rank > 0``), known at its start."""

    rank: int  # learner.lora.rank
    slots: int  # adapter versions held at once: algorithm.max_staleness + 2 (in flight + new)


@dataclass(frozen=True)
class EngineSpec:
    """What an engine's ``start`` is given."""

    model: Path  # the Hugging Face directory of the policy
    dtype: str  # torch dtype name the engine computes in
    seed: int  # this sampler's seed
    device: Any  # torch.device the engine runs on
    sampler: SamplerConfig  # the sampler's section (the engine's own section is a key of it)
    label: str = ""  # names the engine's processes (sampler name and run directory)
    transport: str = "zmq"  # the weights transport (GPU ones configure the engine's worker)
    adapters: AdapterLimits | None = None  # LoRA: the versions arrive as adapters of this


def worker_receives(name: str, adapters: bool) -> bool:
    """Whether engine ``name``'s own workers take GPU weight transfers (``WorkerTransfer``).
    Not for LoRA adapters (``adapters``): the sampler process receives those itself over the
    same transport and hands them to the engine as tensors (megabytes; vLLM's weight-transfer
    API moves full weights only, its LoRA loading reads adapter folders)."""
    return ENGINES[name].in_worker and not adapters


def receiving_ranks(name: str, sampler: SamplerConfig, adapters: bool = False) -> int:
    """The processes of engine ``name`` that receive a GPU weights transfer."""
    if not worker_receives(name, adapters):
        return 1
    value: Any = sampler
    for key in ENGINES[name].ranks.split(".") if ENGINES[name].ranks else ():
        value = getattr(value, key)
    return value if isinstance(value, int) else 1


def engine_problem(name: str) -> str | None:
    """Why engine ``name`` cannot run in this environment (with how to fix it), or None."""
    row = ENGINES[name]
    if not row.problem:
        return None
    module, _, function = row.problem.partition(":")
    return getattr(importlib.import_module(module), function)()


def auto_engine() -> str:
    """``sampler.engine = "auto"``: the first engine preferred on a GPU that can run, when the
    sampler has a GPU; hf otherwise. On the 2-core CPU hf and vllm were measured in the default
    job side by side: hf 542 s, vllm 559 s for 10 steps (BENCHMARKS.md, "In the default job");
    again with the cores shared between sampler and learner (issue 23; a quiet machine, 10
    steps and one validation round): hf 154.7 s, vllm 153.0 s, while vLLM's start costs about
    45 s more and its engine cannot borrow the learner's threads. So a CPU keeps hf."""
    candidates = [r.name for r in ENGINES.values() if r.prefer_on_gpu]
    runnable = [name for name in candidates if engine_problem(name) is None]
    if not runnable:
        return "hf"
    import torch  # only with a GPU engine installed: a config check stays torch-free without

    return runnable[0] if torch.cuda.is_available() else "hf"


async def start_engine(name: str, spec: EngineSpec) -> Engine:
    """Start the engine ``name`` (``auto`` resolved already)."""
    return await importlib.import_module(ENGINES[name].module).start(spec)
