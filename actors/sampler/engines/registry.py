"""Starting an engine by its row's name, and what its weights receiver needs of it.

The rows (what the rest of the system knows of an engine, its options, ``auto``) are the
config's (``actors/runtime/config/engines.py``); this module holds the code half: each
engine's ``start``, importing its file (torch, transformers or vLLM) only when it is started.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from actors.runtime.config import ENGINES, engine_gpus
from actors.runtime.transports.base import ReceiveInto

if TYPE_CHECKING:
    from actors.runtime.config import SamplerConfig
    from actors.sampler.engines.base import Engine, EngineSpec


async def _start_hf(spec: EngineSpec) -> Engine:
    from actors.sampler.engines.hf import start  # torch and transformers: only when started

    return await start(spec)


async def _start_vllm(spec: EngineSpec) -> Engine:
    from actors.sampler.engines.vllm.engine import start  # torch and vLLM: only when started

    return await start(spec)


STARTS: dict[str, Callable[[EngineSpec], Awaitable[Engine]]] = {
    "hf": _start_hf, "vllm": _start_vllm}  # one per row of ENGINES


async def start(name: str, spec: EngineSpec) -> Engine:
    """Engine ``name`` (a row of ``ENGINES``) started for ``spec``."""
    return await STARTS[name](spec)


def receive_into(name: str, sampler: SamplerConfig, device: Any, timeout_s: float,
                 adapters: bool) -> ReceiveInto:
    """What a weights receiver needs of engine ``name``: whether its own workers (one per GPU)
    take GPU transfers (``WorkerTransfer``). Not with LoRA (``adapters``): the sampler process
    receives the adapters itself and hands them to the engine as tensors (megabytes; vLLM's
    weight-transfer API moves full weights only, its LoRA loading reads adapter folders)."""
    in_worker = ENGINES[name].in_worker and not adapters
    return ReceiveInto(device, in_worker, engine_gpus(name, sampler) if in_worker else 1,
                       timeout_s)
