"""LoRA adapters in the vLLM engine: each published version its own ``LoRARequest``.

With ``learner.lora.rank > 0`` the learner publishes the adapters alone (``AdapterWeights``);
the engine starts with ``enable_lora`` (``max_lora_rank``: the smallest rank vLLM allows at or
above the learner's; ``max_loras`` = ``max_cpu_loras`` = ``algorithm.max_staleness + 2`` slots,
as TRL keeps them: the versions requests in flight may still use plus the new one) and loads
each version as a PEFT folder in ``/dev/shm`` named by version (vLLM's LoRA loading reads a
folder; the tensors never pass through the engine's weights). A request is pinned at
admission to the adapter of the version then newest and keeps it to its last token, so every
token of it carries that version however many versions arrive meanwhile; an adapter no
request uses and no longer newest is removed from the engine (``remove_lora``) and its folder
deleted. Loading an adapter never pauses generation: the base model's weights never change, and
vLLM's prefix cache is keyed by adapter, so nothing computed with another version is reused.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.runtime.transports.sources import AdapterWeights
from actors.sampler.engines.base import AdapterLimits

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's LoRAConfig.max_lora_rank


def lora_options(limits: AdapterLimits) -> dict[str, Any]:
    """vLLM's engine arguments that let it serve ``limits``' adapters."""
    rank = next(r for r in VLLM_RANKS if r >= limits.rank)  # checked at start: <= 512
    options = {"enable_lora": True, "max_lora_rank": rank, "max_loras": limits.slots,
               "max_cpu_loras": limits.slots}
    if limits.vision:  # without it vLLM applies no adapter inside the vision tower
        options["enable_tower_connector_lora"] = True
    return options


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """``tensors`` as one safetensors file, written atomically (temp name, then rename)."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(".partial")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def write_adapter(folder: Path, source: AdapterWeights) -> Path:
    """``source`` as a PEFT adapter folder (what ``PeftModel.from_pretrained`` and vLLM read)."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = source.spec
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha,
        "target_modules": list(spec.target_modules), "bias": "none", "lora_dropout": 0.0}))
    save_tensors(dict(source.tensors.items()), folder / "adapter_model.safetensors")
    return folder


@dataclass
class _Adapter:
    request: Any  # vllm LoRARequest
    version: int
    folder: Path
    users: int = 0  # requests in flight pinned to it


class AdapterSlots:
    """The adapter versions loaded into one engine (all on the engine's asyncio thread)."""

    def __init__(self, root: Path) -> None:
        self.root = root  # this engine's adapter folders
        self.ids = itertools.count(1)  # vLLM's lora_int_id: one per load (a resumed learner
        # may send a version number again, with other weights)
        self.loaded: dict[int, _Adapter] = {}  # lora_int_id -> adapter
        self.newest: _Adapter | None = None  # what a request admitted now is pinned to

    def reserve(self, version: int) -> tuple[int, Path]:
        """The id and folder a new load of ``version`` takes."""
        lora_id = next(self.ids)
        return lora_id, self.root / f"v{version}-{lora_id}"

    async def add(self, llm: Any, version: int, lora_id: int, folder: Path) -> None:
        """Load the adapter written to ``folder`` as ``version``'s and make it the newest."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"v{version}-{lora_id}", lora_id, str(folder))
        await llm.add_lora(request)
        self.loaded[lora_id] = self.newest = _Adapter(request, version, folder)
        await self.prune(llm)

    def pin(self) -> _Adapter | None:
        """The adapter a request admitted now generates with (None: none published yet)."""
        if self.newest is not None:
            self.newest.users += 1
        return self.newest

    def unpin(self, llm: Any, adapter: _Adapter | None) -> None:
        """A request pinned to ``adapter`` ended: prune beside it (never awaited in a finally
        a cancellation runs)."""
        if adapter is not None:
            adapter.users -= 1
            if adapter.users == 0 and adapter is not self.newest:
                asyncio.ensure_future(self.prune(llm))

    async def prune(self, llm: Any) -> None:
        """Remove every adapter that is not the newest and that no request uses."""
        for lora_id, a in list(self.loaded.items()):
            if a is not self.newest and a.users == 0 and self.loaded.pop(lora_id, None) is not None:
                await llm.remove_lora(lora_id)
                shutil.rmtree(a.folder, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
