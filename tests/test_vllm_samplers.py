"""Untruncated behaviour log-probs from both of vLLM 0.32's model runners: the V1 runner's
sampler (the CPU's, and GPUs' when V2 is off) and the V2 runner's (every GPU where Triton works),
chosen by what the running engine's sampler is. The real sampler classes, without an engine."""

from __future__ import annotations

import pytest
import torch

from actors.runtime.config import vllm_problem

pytestmark = pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))


def v2_sampler():
    """vLLM's V2 sampler object, uninitialised (its constructor wants a GPU model runner's
    state); what the selection and the wrapper look at is its class and ``_sample_random``."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    sampler = object.__new__(Sampler)
    sampler.sampling_states = None
    return sampler


def test_the_v1_runners_sampler_is_wrapped_in_front_of_top_k_top_p():
    from vllm.v1.sample.sampler import Sampler

    from actors.sampler.engines.vllm.worker import UntruncatedLogprobs, make_untruncated

    sampler = Sampler(logprobs_mode="processed_logprobs")
    assert make_untruncated(sampler) == "v1"
    assert isinstance(sampler.topk_topp_sampler, UntruncatedLogprobs)
    inner = sampler.topk_topp_sampler
    assert make_untruncated(sampler) == "v1" and sampler.topk_topp_sampler is inner  # once


def test_the_v2_runners_sampler_returns_the_logits_before_truncation():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from actors.sampler.engines.vllm.worker import make_untruncated, sampler_kind

    sampler = v2_sampler()
    assert sampler_kind(sampler) == "v2"

    def sample_random(logits, expanded, idx_np, pos, top_k, top_p, fused):
        # what vLLM's non-fused path does to the logits: truncate (in place), then draw;
        # here the draw is the argmax (vLLM's is a Triton Gumbel kernel)
        truncated = apply_top_k_top_p_pytorch(logits, top_k, top_p)
        return truncated.argmax(-1), truncated

    sampler._sample_random = sample_random
    assert make_untruncated(sampler) == "v2"
    wrapped = sampler._sample_random
    assert make_untruncated(sampler) == "v2" and sampler._sample_random is wrapped  # once
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    before = logits.clone()
    top_k = torch.tensor([5, 5, 5])
    sampled, processed = sampler._sample_random(logits, None, None, None, top_k, None, False)
    torch.testing.assert_close(processed, before)  # log-probs are taken from these: untruncated
    assert torch.equal(sampled, before.argmax(-1))
    assert torch.isinf(logits).any()  # the draw itself did see the truncated logits
    # no request truncates: no copy is made
    plain = torch.randn(2, 50)
    assert sampler._sample_random(plain, None, None, None, None, None, False)[1] is plain


def test_an_unknown_sampler_is_an_error_naming_it():
    from actors.sampler.engines.vllm.worker import sampler_kind

    class Strange:
        pass

    with pytest.raises(RuntimeError, match="Strange"):
        sampler_kind(Strange())
