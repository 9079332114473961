"""A model pool's sleep and wake: its memory given back while no request comes.

``TorchSleep`` puts a plain torch model to sleep: on a GPU its parameters move to host memory
(and back on waking); on a CPU, where host memory is the memory to free, they are dropped (each
parameter left as an empty tensor) and read again from the checkpoint's safetensors files on
waking. Buffers stay (they are small, and the rotary tables are not in the checkpoint). The
parameter objects themselves never change, so whatever holds them (an engine's parameter
table, an optimizer-free inference model) sees the same weights after waking.

``SleepPolicy`` says when: asleep once idle ``idle_s``; a request wakes it first (the wake runs
in the request's path, so a request waits at most one wake, never on a sleeping pool).
``SleepStatistics`` is what a replica reports: sleeps, time asleep, the last and the longest
wake, and the memory freed by the last sleep.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from actors.sampler.engines.sleep_clock import SleepClock


class TorchSleep:
    """Sleep and wake of ``module``'s parameters (blocking calls: run them on a worker thread,
    with nothing computing on the module)."""

    def __init__(self, module: Any, checkpoint: Path) -> None:
        import torch

        self.module, self.checkpoint = module, checkpoint
        self.params: dict[str, torch.nn.Parameter] = dict(module.named_parameters())  # tied: once
        self.device = next(iter(self.params.values())).device
        self.dtypes = {name: p.dtype for name, p in self.params.items()}
        self.shapes = {name: p.shape for name, p in self.params.items()}
        self.clock = SleepClock()
        self.asleep = False

    def resident_bytes(self) -> int:
        """Bytes the parameters hold now."""
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def sleep(self) -> int:
        """Give the parameters' memory back; the bytes freed."""
        import torch

        if self.asleep:
            return 0
        freed = self.resident_bytes()
        for p in self.params.values():
            if self.device.type == "cuda":
                p.data = p.data.to("cpu", non_blocking=False)
            else:  # read again from the checkpoint on waking
                p.data = torch.empty(0, dtype=p.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True
        self.clock.slept(freed)
        return freed

    def wake(self) -> None:
        """Put the parameters back where they were, with the same values."""
        if not self.asleep:
            return
        started = time.monotonic()
        if self.device.type == "cuda":
            for p in self.params.values():
                p.data = p.data.to(self.device)
        else:
            self._read_checkpoint()
        self.asleep = False
        self.clock.woke(started)

    def _read_checkpoint(self) -> None:
        from safetensors import safe_open

        files = sorted(self.checkpoint.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.checkpoint}: no safetensors files to wake from")
        missing = set(self.params)
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    name = key if key in self.params else _unprefixed(key, self.params)
                    if name is None or name not in missing:
                        continue
                    tensor = f.get_tensor(key)
                    if tensor.shape != self.shapes[name]:
                        raise ValueError(f"{file.name}: {key} has shape {tuple(tensor.shape)}, "
                                         f"the model's is {tuple(self.shapes[name])}")
                    self.params[name].data = tensor.to(self.dtypes[name]).contiguous()
                    missing.discard(name)
        if missing:
            raise ValueError(f"{self.checkpoint}: no weights for {sorted(missing)[:3]} "
                             f"({len(missing)} parameters) to wake with")


def _unprefixed(key: str, params: dict[str, Any]) -> str | None:
    """A checkpoint key that names a parameter under another prefix (``model.`` added or not)."""
    for candidate in (f"model.{key}", key.removeprefix("model.")):
        if candidate in params:
            return candidate
    return None
