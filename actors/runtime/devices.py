"""``learner.device`` / ``sampler.device`` and the ``dtype`` keys, resolved in the process that
computes (the runner never imports torch: ``auto`` is answered where the GPU would be used)."""

from __future__ import annotations

import torch


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """``auto`` → ``cuda:LOCAL_RANK`` when torch sees a GPU, else ``cpu``; ``cuda`` →
    ``cuda:LOCAL_RANK``; ``cuda:N`` and ``cpu`` as named (the config check has made sure a
    CUDA setting has a GPU behind it)."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda":
        setting = f"cuda:{local_rank}"
    device = torch.device(setting)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def resolve_dtype(setting: str, device: torch.device, model_dtype: str) -> torch.dtype:
    """``auto`` → bfloat16 on a GPU, ``model.dtype`` on a CPU (where bf16 matmuls are slow)."""
    if setting == "auto":
        setting = "bfloat16" if device.type == "cuda" else model_dtype
    return getattr(torch, setting)
