"""Which GPUs each process gets: what the runner resolved (``PlacedProcess``, decided in
``layout.place``), the variables each process is started with, and the GPU count.

The runner counts the GPUs it may use without importing torch (``CUDA_VISIBLE_DEVICES`` when it
is set, else ``nvidia-smi -L``; ``visible_gpus``), then ``layout.place`` hands them out: the learner's
ranks of this node first (one GPU each), then each sampler ``tensor_parallel_size`` GPUs (vLLM;
one for the transformers engine), in order. Processes that compute on a CPU (``device = "cpu"``,
reward workers, the replay buffer and the router) get no GPU at all. When there are fewer GPUs
than that, samplers share the GPUs again from the first one: a GPU used by several processes
is split between them (``SHARED_BUDGET`` of its memory, equally), and that share is passed on
(vLLM's ``gpu_memory_utilization``; ``torch.cuda.set_per_process_memory_fraction`` in the
learner and the transformers engine). A layout that cannot work (a GPU named that is not there,
a tensor-parallel engine wider than the GPUs, more processes on one GPU than ``MIN_SHARE``
allows) is a ``ConfigError`` naming the key.

Each process is started with its own ``CUDA_VISIBLE_DEVICES`` (``PlacedProcess.env``); inside it
its device is ``cuda:0`` of what it sees (``FLOWRL_DEVICE``, read by ``resolve_device``), but for
learner ranks: each sees all of the node's learner GPUs (as under torchrun, so NCCL can use
peer-to-peer between them) and computes on its own, ``cuda:LOCAL_RANK`` there. The
resolved placement is printed at start and written into ``topology.json`` (``Topology.placement``).

Torch-free: the runner imports it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping

import msgspec

from actors.runtime.config.constraints import Fraction

SHARED_BUDGET = 0.9  # of a shared GPU's memory handed out; the rest is CUDA contexts and slack
MIN_SHARE = 0.1  # below this a model and its cache or activations do not fit in practice
DEVICE_ENV = "FLOWRL_DEVICE"  # the process's device as it sees it: cpu or cuda:N
SHARE_ENV = "FLOWRL_GPU_MEMORY_SHARE"  # its share of each of its GPUs' memory, when shared


class PlacedProcess(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where one process of the job computes."""

    name: str
    """The actor's name (``learner-0``, ``learner-0.rank1``, ``sampler-2``, ``reward-0``...)."""
    gpus: list[str] = []
    """The GPUs it sees (entries of the runner's CUDA_VISIBLE_DEVICES, or indices); none: CPU."""
    memory_share: Fraction = 0.0
    """Share of each of its GPUs' memory it may use when it shares one (0: the GPU is its own)."""
    shared_with: list[str] = []
    """The other processes on its GPUs."""
    visible: list[str] = []
    """What its CUDA_VISIBLE_DEVICES lists when that is more than its own GPUs (a learner rank
    sees every GPU of the learner's ranks on its node, as torchrun's do: NCCL's peer-to-peer
    transport needs the peer GPU visible), its device then being its GPU's index there."""

    def env(self) -> dict[str, str]:
        """The variables the runner starts it with."""
        seen = self.visible or self.gpus
        env = {"CUDA_VISIBLE_DEVICES": ",".join(seen),
               DEVICE_ENV: f"cuda:{seen.index(self.gpus[0])}" if self.gpus else "cpu"}
        if self.memory_share:
            env[SHARE_ENV] = f"{self.memory_share:.2f}"
        return env

    def describe(self) -> str:
        if not self.gpus:
            return f"{self.name}: cpu"
        where = f"GPU {','.join(self.gpus)}"
        if self.memory_share:
            return (f"{self.name}: {where} ({self.memory_share:.0%} of memory, shared with "
                    f"{', '.join(self.shared_with)})")
        return f"{self.name}: {where}"


def auto_device(setting: str, gpu_visible: bool) -> str:
    """A ``device`` key with ``auto`` answered: ``cuda`` when a GPU is visible, else ``cpu``;
    any other setting as named. The one place the rule lives: the runner asks whether a GPU is
    visible without torch (``visible_gpus``), a computing process asks torch."""
    if setting == "auto":
        return "cuda" if gpu_visible else "cpu"
    return setting


def on_gpu(setting: str, gpu_visible: bool) -> bool:
    """Whether a process with ``device = setting`` computes on a GPU (``auto_device``)."""
    return auto_device(setting, gpu_visible).startswith("cuda")


def visible_gpus(env: Mapping[str, str] | None = None,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> list[str]:
    """The GPUs this runner may hand out, without torch: ``CUDA_VISIBLE_DEVICES`` when set
    (``""`` or ``-1``: none), else one per line of ``nvidia-smi -L`` (no nvidia-smi: none)."""
    env = os.environ if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = [e.strip() for e in listed.split(",") if e.strip()]
        # CUDA stops at the first invalid entry: "-1" hides every GPU after it
        out = []
        for e in entries:
            if e.startswith("-"):
                break
            out.append(e)
        return out
    try:
        done = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(
        ln for ln in done.stdout.splitlines() if ln.startswith("GPU "))]


def process_share(env: Mapping[str, str] | None = None) -> float:
    """This process's share of its GPUs' memory (0: the GPU is its own)."""
    env = os.environ if env is None else env
    return float(env.get(SHARE_ENV, "0") or 0)
