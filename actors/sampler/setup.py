"""What a sampler starts with: its engine (the one ``sampler.engine`` names) on its device, with
its seed, its weights transport and its LoRA limits, and what its weights receiver needs of the
engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from actors.runtime.actor import ActorContext
from actors.runtime.cores import CoreTable, table_path
from actors.runtime.devices import resolve_device, resolve_dtype
from actors.runtime.memory_lending import MemoryLender, holders_among, lender_slot
from actors.runtime.profiling import profile_dir
from actors.runtime.transports.base import ReceiveInto
from actors.sampler.engines.base import AdapterLimits, Engine, EngineSpec

if TYPE_CHECKING:
    from actors.runtime.config import EngineRow


async def start_engine(ctx: ActorContext) -> Engine:
    """The engine ``sampler.engine`` names (``auto`` was resolved when the topology loaded), on
    ``sampler.device`` in ``sampler.dtype``."""
    topo = ctx.topology
    cfg = topo.sampler
    device = placement(cfg.device, ctx.index)
    dtype = str(resolve_dtype(cfg.dtype, device, topo.model.dtype)).removeprefix("torch.")
    ctx.status.update(device=str(device), dtype=dtype)
    return await cfg.engine.start(EngineSpec(
        Path(topo.model.path), dtype, topo.run.seed * 1009 + seed_offset(ctx), device, cfg,
        label=f"{ctx.name} {ctx.run_dir}", transport=topo.learner.weights_transport,
        adapters=adapter_limits(topo), memory=lend_memory(ctx, device),
        profiles=profile_dir(ctx.run_dir, ctx.name)))


def receive_into(engine: EngineRow, device: Any, timeout_s: float, adapters: bool
                 ) -> ReceiveInto:
    """What a weights receiver needs of ``engine`` (the sampler's row): whether its own workers
    (one per GPU) take GPU transfers (``WorkerTransfer``). Not with LoRA (``adapters``): the
    sampler process receives the adapters itself and hands them to the engine as tensors
    (megabytes; vLLM's weight-transfer API moves full weights only, its LoRA loading reads
    adapter folders)."""
    in_worker = engine.in_worker and not adapters
    return ReceiveInto(device, in_worker, engine.gpus() if in_worker else 1, timeout_s)


def lend_memory(ctx: ActorContext, device: torch.device) -> MemoryLender | None:
    """On a GPU shared with learner ranks, with ``sampler.sleep_idle_s``: what the sleeping
    engine frees is lent to them (``actors/runtime/memory_lending.py``)."""
    if device.type != "cuda" or ctx.topology.sampler.sleep_idle_s <= 0 or ctx.index < 0:
        return None
    me = next((p for p in ctx.topology.placement if p.name == ctx.name), None)
    holders = holders_among(me.shared_with) if me is not None else []
    if not holders:
        return None
    return MemoryLender(CoreTable(table_path(ctx.run_dir)), lender_slot(ctx.index), holders)


def seed_offset(ctx: ActorContext) -> int:
    """Sampler i's seeds differ from every other's: an attached one (index -1) uses its pid."""
    return ctx.index if ctx.index >= 0 else 1_000_000 + os.getpid()


def adapter_limits(topo) -> AdapterLimits | None:
    """LoRA: the learner publishes adapters of its rank; versions in flight are at most
    max_staleness behind the newest, so max_staleness + 2 versions are held at once."""
    rank = topo.learner.lora.rank
    return AdapterLimits(rank, topo.algorithm.max_staleness + 2, vision=topo.learner.lora.vision) \
        if rank else None


def prompts_in_flight(setting: int, *, gpu: bool) -> int:
    """``sampler.max_concurrent_prompts`` (0: 8 on a CPU, 64 on a GPU)."""
    return setting or (64 if gpu else 8)


def placement(setting: str, index: int) -> torch.device:
    """``sampler.device``: under the runner, ``cuda:0`` of the GPUs its placement gave this
    sampler (``FLOWRL_DEVICE``); started otherwise, ``auto``/``cuda`` put sampler i on GPU i
    (modulo the GPUs there are)."""
    return resolve_device(setting, index % max(1, torch.cuda.device_count()))
