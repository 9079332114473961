"""The transformers engine: ``generate`` on one left-padded batch per call (a batch engine).

The behaviour log-prob of a token is ``log_softmax(logits / temperature)`` at that token, before
top-p/top-k truncation: the same quantity the learner recomputes, so importance ratios compare
like with like (vLLM's ``processed_logprobs`` convention minus the truncation). Weights change
only between calls, so every token of a completion carries the same version.

The tokenizer is loaded only for what ``generate`` itself needs of it (the EOS and padding ids,
and matching stop strings); prompts arrive as token ids and completions leave as token ids.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from actors.runtime.actor import run_compute
from actors.sampler.engines.base import GenerateRequest, Generation, full_generation
from actors.sampler.engines.registry import EngineSpec
from kernels.logprobs import token_logprobs


class _Abort(StoppingCriteria):
    """Ends generation early when the actor is stopping (checked once per token)."""

    def __init__(self, flag: threading.Event) -> None:
        self.flag = flag

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool)


class HFEngine:
    """Holds the policy weights of one sampler and generates a batch per call."""

    continuous = False

    def __init__(self, model_path: Path, dtype: str, seed: int,
                 device: torch.device | str = "cpu") -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device = torch.device(device)  # the model, the prompts and the logits live here
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        self.params = dict(self.model.named_parameters())
        self.version = -1
        self.weight_sync_s = 0.0  # seconds spent copying weights in (generation waits), all loads
        self.abort = threading.Event()  # set by run_compute when the call is cancelled
        self.lock = anyio.Lock()  # one generate (or weight load) at a time: they share the model
        torch.manual_seed(seed)

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[list[Generation]]:
        """One ``generate`` for all ``requests``, which must share their parameters and ``n``
        (a batch engine runs one batch at one setting)."""
        if not requests:
            return []
        first = requests[0]
        if any(r.params != first.params or r.n != first.n for r in requests):
            raise ValueError("the HF engine generates one batch per call: every request of a "
                             "call needs the same sampling parameters and n")
        async with self.lock:
            return await run_compute(self._generate, [r.prompt_ids for r in requests],
                                     first, abort=self.abort)

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], like: GenerateRequest) -> list[list[Generation]]:
        """``like.n`` completions for each prompt (left-padded into one batch)."""
        params, n, tok = like.params, like.n, self.tokenizer
        greedy = params.temperature == 0
        width = max(len(p) for p in prompts)
        pad = tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        ids, attn = ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)  # (B·n, P)
        out = self.model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=params.max_tokens,
            **({"do_sample": False, "temperature": None, "top_p": None, "top_k": None} if greedy else
               {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k or None}),
            pad_token_id=pad, eos_token_id=tok.eos_token_id, output_logits=True,
            return_dict_in_generate=True, stop_strings=list(params.stop) or None,
            tokenizer=tok if params.stop else None,
            stopping_criteria=StoppingCriteriaList([_Abort(self.abort)]),
        )
        seqs = out.sequences[:, width:]  # (B·n, R)
        logits = torch.stack(out.logits, 1)  # (B·n, R, V) raw logits of each step
        lps = token_logprobs(logits, seqs, 1.0 if greedy else params.temperature,
                             chunk_size=1024).cpu()  # (B·n, R), the learner's quantity
        seqs = seqs.cpu()
        groups: list[list[Generation]] = [[] for _ in prompts]
        for row in range(seqs.shape[0]):
            length, reason = self._length(seqs[row], params.stop)
            groups[row // n].append(full_generation(seqs[row, :length].clone(),
                                                    lps[row, :length].clone(), self.version,
                                                    reason))
        return groups

    def _length(self, seq: torch.Tensor, stop: tuple[str, ...]) -> tuple[int, str]:
        """Tokens the model generated: up to and including the first EOS, or up to the end of
        the first stop string (the padding after it may be EOS tokens the model never
        sampled, when the pad token is EOS)."""
        eos = (seq == self.tokenizer.eos_token_id).nonzero()
        end = int(eos[0]) + 1 if len(eos) else len(seq)
        if stop:
            def stopped(k: int) -> bool:
                text = self.tokenizer.decode(seq[:k], skip_special_tokens=True)
                return any(s in text for s in stop)

            if stopped(end):  # the shortest prefix holding a stop string (it only grows)
                lo, hi = 1, end
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if stopped(mid) else (mid + 1, hi)
                return lo, "stop"
        return end, "stop" if len(eos) else "length"

    async def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        async with self.lock:
            started = time.perf_counter()
            try:
                await anyio.to_thread.run_sync(self._copy, tensors)
            except FileNotFoundError:  # shm: the learner's file was replaced by a newer version
                return  # (or removed at its exit) before it was opened: the old weights stay
            self.version = version
            self.weight_sync_s += time.perf_counter() - started

    @torch.no_grad()
    def _copy(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy new weights into the live model (names as in ``named_parameters``)."""
        unknown = set(tensors) - set(self.params)
        if unknown:
            raise KeyError(f"weights for unknown parameters: {sorted(unknown)[:5]}")
        for name, value in tensors.items():
            self.params[name].copy_(value)

    async def watch(self) -> None:
        await anyio.sleep_forever()  # in this process: it dies with the sampler

    async def aclose(self) -> None:
        pass


async def start(spec: EngineSpec) -> HFEngine:
    """The engine of ``sampler.engine = "hf"`` (registry row ``hf``): no section of its own."""
    return await anyio.to_thread.run_sync(HFEngine, spec.model, spec.dtype, spec.seed,
                                          spec.device)
