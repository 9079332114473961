"""Where a learner step's time and memory went: verl's ``timing_s/*`` and ``perf/*`` metrics.

``StepTimes`` adds up the seconds of each phase of a step under verl's names
(``timing_s/old_log_prob``, ``ref``, ``values``, ``adv``, ``update_actor``, ``update_critic``);
on CUDA it synchronises the device at each phase's edges, so kernels queued in one phase are
not billed to the next.

``perf/mfu/actor`` is verl's (``verl/utils/flops_counter.py``, ``FlopsCounter`` for Qwen2 and
Llama): the FLOPs of the actor's updates, ``6·N·tokens`` for the dense weights (every linear
layer, the embedding and the LM head counted once each, as verl does even for tied ones) plus
``6·Σ L_i²·head_dim·heads·layers`` for attention, times the epochs, over the update time, the
device's peak and the ranks. A vision-language model's vision tower adds its own
(``vision_flops``): ``2·N·patches`` forward for the weights run on every patch (the patch
embedding and the blocks; the merger's on every merged token), and attention over each image's
patches (``4·P²·width`` per full-attention block, ``4·P·window·width`` per windowed one),
times 3 when the tower trains (forward and backward) and once when it is frozen (no backward
runs through it). The peak is a table of dense bf16 tensor-core figures for GPUs
(verl's, from the vendors' data sheets). On a CPU there is no MFU: its peak depends on the
cores the learner is given, their vector units and what else runs on them (verl's constant
448 GFLOP/s fits no machine in particular), so a ratio against it would look exact and mean
nothing; ``perf/tflops/actor`` (the achieved rate) is reported on every device instead.

Memory: on CUDA ``perf/max_memory_allocated_gb`` and ``perf/max_memory_reserved_gb`` (torch's
peaks since the learner started, as verl reports them); on a CPU ``perf/cpu_max_rss_gb``, the
learner process's peak resident memory (the kernel's ``ru_maxrss``), which also counts what
Python and the libraries hold, so it is not comparable with the CUDA figures.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from dataclasses import dataclass

import torch

from actors.model_shape import head_width, layer_weights

# dense bf16 peak FLOP/s per device, matched as a substring of torch's device name (longest
# name first, so "H200" is not read as "H20"); verl's table, checked against the data sheets
PEAK_FLOPS = {
    "GB200": 2.5e15, "B200": 2.25e15, "MI300X": 1336e12, "H100": 989e12, "H800": 989e12,
    "H200": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362.05e12, "L40": 181.05e12,
    "A40": 149.7e12, "L20": 119.5e12, "H20": 148e12, "RTX 4090": 165.2e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None (a CPU, an unknown GPU)."""
    if device.type != "cuda":
        return None
    return peak_of(torch.cuda.get_device_name(device))


def peak_of(name: str) -> float | None:
    """The table's peak for a device named ``name`` (e.g. "NVIDIA H200"), or None."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS[key]
    return None


def head_dim_of(config) -> int:
    """Width of one attention head (``head_dim`` when the config sets it)."""
    return head_width(config.hidden_size, config.num_attention_heads,
                      getattr(config, "head_dim", None))


def dense_parameters(config) -> int:
    """verl's dense ``N`` of a Qwen2/Llama-shaped config: per layer the SwiGLU MLP (3 matrices)
    and the attention projections (q, k, v, o), plus the embedding and the LM head."""
    layer = layer_weights(config.hidden_size, config.intermediate_size,
                          config.num_attention_heads, config.num_key_value_heads,
                          head_dim_of(config))
    return layer * config.num_hidden_layers + 2 * config.vocab_size * config.hidden_size


def train_flops(config, lengths: list[int]) -> float:
    """FLOPs of one forward and backward pass over sequences of ``lengths`` tokens (verl's)."""
    head_dim = head_dim_of(config)
    dense = 6 * dense_parameters(config) * sum(lengths)
    attention = (6 * sum(n * n for n in lengths) * head_dim * config.num_attention_heads
                 * config.num_hidden_layers)
    return float(dense + attention)


@dataclass(frozen=True)
class VisionTower:
    """What a vision tower's FLOPs depend on besides its images."""

    patch_params: int  # weights run on every patch (the patch embedding and the blocks)
    merged_params: int  # weights run on every merged token (the merger)
    merge: int  # patches per merged token (spatial_merge_size²)
    width: int  # the blocks' hidden size
    full_blocks: int  # blocks attending over the whole image
    windowed_blocks: int  # blocks attending within windows of ``window`` patches
    window: int
    trains: bool  # some of its parameters train: a backward runs through it


def vision_tower(model) -> VisionTower | None:
    """``model``'s vision tower (None: a text model), counted from its modules (shards counted
    whole), so any Qwen2-VL-family tower is measured as it is built."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    tower = getattr(getattr(core, "model", core), "visual", None)
    if tower is None:
        return None
    vc = core.config.vision_config
    params = [(n, p) for n, p in tower.named_parameters() if p.dim() >= 2]  # weights, no norms
    merged = sum(p.numel() for n, p in params if n.startswith("merger."))
    depth = int(vc.depth)
    full = getattr(vc, "fullatt_block_indexes", None)
    full_blocks = depth if full is None else len(full)
    return VisionTower(
        patch_params=sum(p.numel() for _, p in params) - merged, merged_params=merged,
        merge=int(vc.spatial_merge_size) ** 2,
        width=int(getattr(vc, "embed_dim", None) or vc.hidden_size),
        full_blocks=full_blocks, windowed_blocks=depth - full_blocks,
        window=(int(getattr(vc, "window_size", 0)) // int(vc.patch_size)) ** 2,
        trains=any(p.requires_grad for p in tower.parameters()))


def vision_flops(tower: VisionTower | None, patches: list[int]) -> float:
    """FLOPs of the vision tower over images of ``patches`` patches each, forward and (when it
    trains) backward; 0 for a text model."""
    if tower is None or not patches:
        return 0.0
    total = sum(patches)
    dense = 2 * (tower.patch_params * total + tower.merged_params * total // tower.merge)
    attention = sum(4 * p * tower.width * (tower.full_blocks * p + tower.windowed_blocks
                                           * min(p, tower.window or p)) for p in patches)
    return float((dense + attention) * (3 if tower.trains else 1))


class StepTimes:
    """Seconds per phase of one step (``with times("update_actor"): ...``); a phase entered
    several times (once per micro-batch) adds up."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self._started: dict[str, float] = {}  # phases begun and not ended

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self, phase: str) -> None:
        self._sync()
        self._started[phase] = time.perf_counter()

    def end(self, phase: str) -> None:
        self._sync()
        elapsed = time.perf_counter() - self._started.pop(phase)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self.begin(phase)
        try:
            yield
        finally:
            self.end(phase)

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


def perf_metrics(config, device: torch.device, lengths: list[int], epochs: int,
                 update_s: float, world: int, vision: float = 0.0) -> dict[str, float]:
    """``perf/tflops/actor``, ``perf/mfu/actor`` (where the peak is known) and the memory peaks
    (``lengths``: every sequence of the batch, whose updates took ``update_s`` on ``world``
    ranks together; ``vision``: the vision tower's FLOPs over the batch's images, per epoch)."""
    out: dict[str, float] = {}
    if update_s > 0 and all(hasattr(config, k) for k in ("intermediate_size", "num_key_value_heads")):
        flops = train_flops(config, lengths) + vision
        achieved = flops * epochs / update_s / world  # per rank
        out["perf/tflops/actor"] = achieved / 1e12
        peak = peak_flops(device)
        if peak is not None:
            out["perf/mfu/actor"] = achieved / peak
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        out["perf/cpu_max_rss_gb"] = rss / (2**30 if sys.platform == "darwin" else 2**20)
    return out
