"""``[sampler]``: the engine, its sampling and admission (its placement keys:
``SamplerPlacement``, first)."""

from __future__ import annotations

from typing import Literal

from actors.runtime.config.constraints import (
    Device,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    Share,
)
from actors.runtime.config.engines import AutoEngine, EngineChoice
from actors.runtime.config.schema_base import ActorCommon, Restart


# the keys of where it computes (checked by placement.check_placement)
class SamplerPlacement(ActorCommon, frozen=True):
    device: Device = "auto"
    """auto (cuda when a GPU is visible, else cpu), cpu, cuda, or cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The engine's dtype (auto: bfloat16 on a GPU, model.dtype on a CPU)."""


class SamplerConfig(SamplerPlacement, frozen=True):
    engine: EngineChoice = AutoEngine()
    """What generates, by name, with its own options (``[sampler.engine]``, ``name = "vllm"``,
    ``tensor_parallel_size = 2``; a name alone is that engine with its defaults): vllm (vLLM's
    AsyncLLM: continuous batching, weights loaded in flight), hf (transformers generate, one
    batch at a time), or auto: vllm when the sampler has a GPU and vLLM is installed, hf
    otherwise (hf is the faster on a CPU: BENCHMARKS.md). Each engine's row, with its options:
    actors/runtime/config/engines.py."""
    profile_batches: list[PositiveInt] = []
    """hf: batches of each sampler to run under torch.profiler (1: its first generate call):
    each writes RUN_DIR/profiles/sampler-I/step_N.txt and step_N.trace.json, as
    learner.profile_steps does (vllm: vLLM's own profiler, VLLM_TORCH_PROFILER_DIR)."""
    weight_update: Literal["between_batches", "in_flight"] = "between_batches"
    """When new weights go into the engine: once the requests in it have finished, or at once,
    pausing generation and keeping its requests (vllm only): tokens after the swap carry the
    new version, so one sample can span two."""
    clear_cache: bool = True
    """in_flight: drop the KV cache computed with the old weights at a swap (the kept requests
    recompute it); false keeps it (faster; later tokens then attend to old-weight keys)."""
    sleep_idle_s: NonNegFloat = 0.0
    """vllm on a GPU shared with the learner: put the engine to sleep (vLLM sleep level 1:
    weights to host memory, KV cache freed) once it has had no request for this many seconds;
    what it frees is lent to the learner, whose allocator may use it for the steps it takes
    meanwhile. It wakes for the next generation or weights load, once the learner has given the
    memory back at the end of its step (0: never sleeps; vLLM's CPU build has no sleep mode)."""
    max_concurrent_prompts: NonNegInt = 0
    """Most prompts in a continuous engine at once (each with its n completions); a group goes
    to scoring as soon as its own completions are done (0: 8 on a CPU, 64 on a GPU)."""
    prompts_per_request: PositiveInt = 4
    """Prompts a sampler asks for (and generates) per batch."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (the learner computes log-probs at the same temperature)."""
    top_p: Share = 1.0
    """Nucleus sampling mass."""
    top_k: NonNegInt = 0
    """Top-k sampling (0 disables)."""
    max_tokens: PositiveInt = 32
    """Maximum response tokens."""
    stop: list[str] = []
    """Extra stop strings (EOS always stops)."""
    score_timeout_s: NonNegFloat = 0.0
    """Seconds a group's scoring request may go unanswered before it is sent again (0: the
    router's request_timeout plus reward.timeout_s plus 10 s, so the router's own failover to
    another worker comes first)."""
    score_attempts: PositiveInt = 3
    """Sends of a scoring request before its group is given up: recorded and dropped as
    ``score_failed``, never waited on forever."""
    restart: Restart = "on-failure"
    """Samplers hold no state worth keeping, so they restart by default."""
    drain_grace_s: NonNegFloat = 20.0
    """On SIGTERM or Ctrl-C (a detach, or a spot machine's notice) a sampler takes no more
    prompts, finishes what it holds for at most this many seconds, then hands the rest back to
    the replay buffer (issued again to the others) and exits; a second signal ends it at once."""
