"""What flowrl adds to vLLM's worker (``worker_extension_cls``): weight loads into the running
model, and behaviour log-probs in the learner's convention.

This module is imported inside vLLM's engine process (the worker lives there), never by the
sampler's own code; its methods are called through ``AsyncLLM.collective_rpc``, whose arguments
must be msgpack-able: a weights update passes the path of a safetensors file in shared memory
(``/dev/shm``), never tensors.

Importing it also ties the engine process's life to its parent's: the kernel kills it
(``PR_SET_PDEATHSIG``) when the thread that started it, the sampler's engine thread, dies, so a
``kill -9`` of the sampler leaves no vLLM process behind.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import time

import torch


def _die_with_parent() -> None:
    # only in a process vLLM started (the engine core, or its workers): never in the sampler,
    # which a runner started and which must outlive the runner's thread that spawned it
    if not sys.platform.startswith("linux") or multiprocessing.parent_process() is None:
        return
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the line above: nobody will reap us
        os._exit(1)


_die_with_parent()
# a reload warns "Failed to load weights" for every layer that has none in the checkpoint: the
# rotary embedding, and the lm_head when it is tied to the embedding (its weight is loaded
# through the embedding). Both are expected; real failures raise.
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)


class UntruncatedLogprobs(torch.nn.Module):
    """Wraps vLLM's top-k/top-p sampler so that the log-probs it returns are
    ``log_softmax(logits / T)`` before truncation: the learner's quantity (see
    ``actors/sampler/engines/base.py``). vLLM's own ``processed_logprobs`` are taken after
    top-k/top-p, renormalised over the kept tokens (about +0.07 nats at top_p 0.9), which the
    learner's recomputation does not do. Sampling itself is unchanged."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        inner.logprobs_mode = "raw_logprobs"  # it need not compute the truncated ones

    def forward(self, logits: torch.Tensor, generators, k, p):
        # (B, V) logits already divided by the temperature; the inner sampler truncates them in
        # place, so the log-probs are taken first
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        sampled, _ = self.inner(logits, generators, k, p)
        return sampled, logprobs


def untruncated_v2(sampler) -> None:
    """The same for vLLM's V2 model runner (``vllm/v1/worker/gpu/sample/sampler.py``, chosen
    wherever Triton works, so on every GPU), whose sampler has no ``topk_topp_sampler``: its
    ``sample`` applies penalties, temperature and min-p, then ``_sample_random`` truncates the
    logits to top-k/top-p (in place, maybe) and returns them as the processed logits the
    log-probs are taken from. The instance's ``_sample_random`` is wrapped to return the logits
    as they were before the truncation (a copy only when a request truncates)."""
    inner = sampler._sample_random

    def _sample_random(processed_logits, expanded_idx_mapping, idx_mapping_np, pos, top_k,
                       top_p, use_fused_sampler):
        # (B, V) logits divided by the temperature
        kept = processed_logits if top_k is None and top_p is None else processed_logits.clone()
        sampled, _ = inner(processed_logits, expanded_idx_mapping, idx_mapping_np, pos, top_k,
                           top_p, use_fused_sampler)
        return sampled, kept

    _sample_random.flowrl_untruncated = True  # type: ignore[attr-defined]
    sampler._sample_random = _sample_random


def sampler_kind(sampler) -> str:
    """Which of vLLM's samplers the running model runner has: ``"v1"`` (``topk_topp_sampler``,
    the V1 runner's, and the CPU's), ``"v2"`` (``_sample_random``, the V2 runner's), or a
    RuntimeError naming what it is. Decided by the object, not by guessing from the platform."""
    if hasattr(sampler, "topk_topp_sampler"):
        return "v1"
    if callable(getattr(sampler, "_sample_random", None)) and hasattr(sampler, "sampling_states"):
        return "v2"
    raise RuntimeError(f"flowrl does not know vLLM's sampler {type(sampler).__module__}."
                       f"{type(sampler).__qualname__}: it cannot make untruncated behaviour "
                       "log-probs with it (supported: vLLM 0.32's V1 and V2 model runners)")


def make_untruncated(sampler) -> str:
    """Make ``sampler`` return untruncated log-probs (once); returns its kind."""
    kind = sampler_kind(sampler)
    if kind == "v1":
        if not isinstance(sampler.topk_topp_sampler, UntruncatedLogprobs):
            sampler.topk_topp_sampler = UntruncatedLogprobs(sampler.topk_topp_sampler)
    elif not getattr(sampler._sample_random, "flowrl_untruncated", False):
        untruncated_v2(sampler)
    return kind


class FlowrlWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``)."""

    def flowrl_untruncated_logprobs(self) -> str:
        """Untruncated log-probs from this worker's sampler; returns its kind (v1 or v2)."""
        return make_untruncated(self.model_runner.sampler)  # type: ignore[attr-defined]

    def flowrl_free_memory(self) -> int:
        """Bytes free on this worker's device now (a sleep frees the difference)."""
        torch.accelerator.synchronize()
        return int(torch.accelerator.get_memory_info()[0])

    def flowrl_load_weights(self, path: str) -> float:
        """Load the safetensors file ``path`` (HF parameter names) into the running model;
        returns the seconds it took (-1 when the file is gone: nothing was loaded). Layerwise reload: on the CPU a plain ``load_weights``
        would write into weights that oneDNN has already repacked."""
        from safetensors import safe_open
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        started = time.perf_counter()
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        try:  # opened (mapped) before the model is touched: a file removed later stays readable
            f = safe_open(path, framework="pt")
        except FileNotFoundError:
            return -1.0  # the learner replaced it with a newer version already: nothing loaded
        with f:
            initialize_layerwise_reload(model)
            model.load_weights((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118
            finalize_layerwise_reload(model, runner.model_config)
        self._flowrl_redispatch_tied_head(model, runner)
        return time.perf_counter() - started

    @staticmethod
    def _flowrl_redispatch_tied_head(model: torch.nn.Module, runner) -> None:
        """With tied embeddings the CPU ``lm_head`` keeps the packed copy of the old embedding
        it was dispatched with (nothing loads into it: its weight is the embedding's), so it is
        dispatched again from the new weight. GPUs read the shared weight directly."""
        from vllm.platforms import current_platform

        head = getattr(model, "lm_head", None)
        if (head is None or not current_platform.is_cpu()
                or not getattr(runner.model_config.hf_config, "tie_word_embeddings", False)):
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
