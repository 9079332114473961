"""The transformers engine: ``generate`` on one left-padded batch per call (a batch engine).

The behaviour log-prob of a token is ``log_softmax(logits / temperature)`` at that token, before
top-p/top-k truncation: the same quantity the learner recomputes, so importance ratios compare
like with like (vLLM's ``processed_logprobs`` convention minus the truncation). Weights change
only between calls, so every token of a completion carries the same version.

The log-prob of each sampled token is taken as it is generated (``_TokenLogprobs``, one
``(B, V)`` row of log-probs held at a time), never the whole ``(B, R, V)`` logits of a
completion (40 GB for 32 sequences x 1k tokens at V = 152k). ``generate`` runs with the job's
sampling parameters only (``sampling_config``, ``sampling_processors``): the model's own
``generation_config`` (e.g. ``repetition_penalty = 1.05`` in Qwen2.5-Instruct's) is replaced at
load, since the behaviour log-probs and the learner's recomputation account for temperature
alone. Every tensor made during ``generate`` (stopping criteria, the log-prob recorder) is on
the input's device.

The tokenizer is loaded only for what ``generate`` itself needs of it (the EOS and padding ids,
and matching stop strings); prompts arrive as token ids and completions leave as token ids.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import torch
from transformers import (
    AutoTokenizer,
    CompileConfig,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from actors.data.vision import ImageProcessor, is_vision_model
from actors.model_store import PolicyModel
from actors.runtime.compute import run_compute
from actors.runtime.devices import cap_memory, indexed, on_device
from actors.runtime.profiling import profiled
from actors.runtime.transports.sources import AdapterWeights, WeightsSource, WorkerTransfer
from actors.sampler.engines.base import EngineSpec, GenerateRequest, Generation, full_generation
from kernels.logprobs import token_logprobs
from messages.rollout import SamplingParams
from messages.weights import AdapterSpec

if TYPE_CHECKING:
    from actors.runtime.config import HFOptions


class _Abort(StoppingCriteria):
    """Ends generation early when the actor is stopping (checked once per token)."""

    def __init__(self, flag: threading.Event) -> None:
        self.flag = flag

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        # on the input's device: transformers ORs it into a tensor there (a CUDA one on a GPU)
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool,
                          device=input_ids.device)


class _TokenLogprobs(LogitsProcessor):
    """Records the behaviour log-prob of each sampled token as ``generate`` runs.

    Called once per step with the raw logits of the next token (first of the processors: before
    temperature and top-k/top-p, ``sampling_processors``), it keeps that step's
    ``(B, V)`` logits and, at the next step, takes ``log_softmax(logits / temperature)`` at the
    token just chosen (the last column of ``input_ids``: ``kernels.logprobs.token_logprobs``,
    the learner's formula); ``finish`` takes the last step's. The scores pass through unchanged."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # (B, V) logits of the step not yet chosen
        self.taken: list[torch.Tensor] = []  # (B,) per generated token, on the input's device

    def _take(self, chosen: torch.Tensor) -> None:  # chosen: (B,) token ids
        if self.pending is not None:
            self.taken.append(token_logprobs(self.pending[:, None], chosen[:, None].long(),
                                             self.temperature)[:, 0])
            self.pending = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        self.pending = scores.clone()  # (the warpers after this one must not change it)
        return scores

    def finish(self, sequences: torch.Tensor, width: int) -> torch.Tensor:
        """``(B, R)`` log-probs of the ``R`` tokens after the prompt's ``width``."""
        self._take(sequences[:, -1])
        if not self.taken:
            return torch.zeros(sequences.shape[0], 0, device=sequences.device)
        lps = torch.stack(self.taken, 1)  # (B, R)
        assert lps.shape[1] == sequences.shape[1] - width, (lps.shape, sequences.shape, width)
        return lps


def float32_head(model: Any) -> None:
    """Make the model's LM head return float32 logits from its own (bf16 or fp16) hidden states
    and weight, as the learner's fused log-prob kernel does (``kernels/triton_logprobs.py``
    accumulates ``hidden @ weight.T`` in float32 and never rounds it): logits rounded to bf16
    alone move a token's log-prob by tenths of a nat (``BENCHMARKS.md``, the parity row), and the
    importance ratios would correct for that rounding instead of for staleness. The head keeps
    its parameters (weights load by name as before); only its forward changes."""
    head = model.get_output_embeddings()
    if head is None or head.weight.dtype == torch.float32:
        return

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., V) float32
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)

    head.forward = forward


# Every GenerationConfig field that changes which tokens are sampled or their probabilities,
# with the value that leaves them alone (min_new_tokens stays None: set beside min_length,
# transformers warns at every call that both are set). ``generate`` fills fields the caller leaves None from
# the model's own generation_config, so each is set; fields whose neutral value is None
# (min_p, suppress_tokens, bad_words_ids, ...) stay None because the engine replaces the model's
# generation_config at load with one holding only the special token ids.
NEUTRAL = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
           "encoder_no_repeat_ngram_size": 0, "min_length": 0,
           "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "diversity_penalty": 0.0,
           "length_penalty": 1.0, "num_beams": 1, "num_beam_groups": 1, "guidance_scale": 1.0,
           "renormalize_logits": False, "remove_invalid_values": False}


def sampling_config(params: SamplingParams, pad: int, eos: int | list[int] | None
                    ) -> GenerationConfig:
    """The one GenerationConfig ``generate`` runs with: every logit-changing field neutral, and
    greedy, for the sampling is the engine's own processors' (``sampling_processors``: the
    job's temperature, top-k and top-p, then ``_Draw``). Raises ValueError naming the
    ``sampler`` key of a value the behaviour log-probs (untruncated ``log_softmax(logits / T)``)
    cannot stand for."""
    for ok, key, why in ((params.temperature >= 0, "temperature", "must be >= 0"),
                         (0 < params.top_p <= 1, "top_p", "must be in (0, 1]"),
                         (params.top_k >= 0, "top_k", "must be >= 0 (0: off)"),
                         (params.max_tokens >= 1, "max_tokens", "must be >= 1")):
        if not ok:
            raise ValueError(f"sampler.{key}: {why} (got {getattr(params, key)!r})")
    return GenerationConfig(
        **NEUTRAL, max_new_tokens=params.max_tokens, do_sample=False,
        pad_token_id=pad, eos_token_id=eos,
        output_logits=False, output_scores=False, return_dict_in_generate=True,
        stop_strings=list(params.stop) or None)


def sampling_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """How the next token is drawn: transformers' own warpers for the job's temperature, top-k
    and top-p, in the order its sampling applies them, then ``_Draw``; none for greedy decoding
    (temperature 0), whose pick is generate's own argmax."""
    if params.temperature == 0:
        return []
    warpers: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        warpers.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return [*warpers, _Draw()]


class _Draw(LogitsProcessor):
    """Draws the next token of each row from ``softmax(scores)`` by inverting its cumulative
    distribution (one uniform number per row, one search in the row's cumulative probabilities,
    summed in float64), and returns scores that are -inf everywhere but there, so generate's
    greedy pick takes it. The distribution is torch.multinomial's, which on a CPU draws an
    exponential for every entry of the vocabulary at every step: half of a small model's
    decoding step (BENCHMARKS.md, the sampler's engines)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cdf = torch.softmax(scores.float(), dim=-1).double().cumsum(-1)  # (B, V)
        u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
        chosen = torch.searchsorted(cdf, u, right=True).clamp_max(cdf.shape[1] - 1)  # (B, 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


# How ``generate`` decodes: ``eager`` (a growing cache) or ``inductor``: a static KV cache whose
# decode step torch.compile compiles once per batch shape (fused kernels; on a GPU replayed as
# CUDA graphs, mode reduce-overhead; on a CPU compiled too). Either way the prompts' cache is
# computed once per prompt and shared by its samples. Compiled decoding pads the prompts to a
# multiple of ``WIDTH_BUCKET`` and keeps one static cache per batch shape (``StaticCaches``) so
# a job's batches share a few shapes and the graphs' inputs keep their addresses.
WIDTH_BUCKET = 64


def compile_config(decode: str, device: torch.device) -> CompileConfig | None:
    if decode == "eager":
        return None
    if decode == "inductor":
        config = CompileConfig(backend="inductor",
                               mode="reduce-overhead" if device.type == "cuda" else "default")
        # generate compiles on accelerators only unless told (a documented CompileConfig field)
        config._compile_all_devices = True
        return config
    raise ValueError(f"decode must be eager or inductor (got {decode!r})")


class StaticCaches:
    """One static KV cache per batch shape (rows, length), reset before each ``generate`` that
    takes it, the few most recent shapes kept. transformers builds a new cache at every call,
    and a new cache is new tensors: CUDA graph trees record their graphs again whenever a static
    input's address changes (no limit), so every batch would capture its graphs anew."""

    KEEP = 4  # shapes held (each holds rows x length x layers x KV width of the model's dtype)

    def __init__(self, config: Any) -> None:
        self.config = config
        self.caches: collections.OrderedDict[tuple[int, int], StaticCache] = \
            collections.OrderedDict()
        self.made = 0  # caches built (not reused)

    def get(self, rows: int, length: int, prompts: Any = None) -> StaticCache:
        """The cache of this shape, empty, or holding ``prompts`` (a cache of the batch's rows
        over the prompts but their last token: ``HFEngine._shared_prompts``), written into it
        in place (``generate`` then goes on from there, as from the eager path's cache)."""
        cache = self.caches.pop((rows, length), None)
        if cache is None:
            cache = StaticCache(config=self.config, max_cache_len=length)
            self.made += 1
            while len(self.caches) >= self.KEEP:
                self.caches.popitem(last=False)
        else:
            cache.reset()  # in place: the tensors keep their addresses
        if prompts is not None:
            for i, layer in enumerate(prompts.layers):
                cache.update(layer.keys, layer.values, i, {"cache_position": torch.arange(
                    layer.keys.shape[-2], device=layer.keys.device)})
        self.caches[(rows, length)] = cache
        return cache


def graph_trees_here() -> None:
    """Give this thread the thread-local state torch's CUDA graph trees keep (compiled decode
    replays its graphs through them). torch sets it up in the main thread and in autograd's own
    threads only; in a worker thread (``run_compute``) the compiled decode step otherwise fails
    at its first replay with an AssertionError in ``cudagraph_trees.get_obj``. Each thread that
    decodes records its own graphs. What torch's module does for its own thread at import, in
    the same words on every torch from 2.6 on (the helper that later releases have for it, and
    their ``get_obj`` that calls it, are not in the older ones)."""
    if torch._C._is_key_in_tls("tree_manager_containers"):
        return
    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local  # a threading.local: these attributes are this thread's
    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)
    # (autograd's threads copy what is stashed in the thread-local state)
    stash_in_tls("tree_manager_containers", local.tree_manager_containers)
    stash_in_tls("tree_manager_locks", local.tree_manager_locks)


def stash_in_tls(key: str, obj: object) -> None:
    """``torch._C._stash_obj_in_tls`` holding a reference of its own to ``obj``, on every torch.
    On some releases (2.11 among them) it keeps the object without taking a reference (it
    steals the caller's) and drops one when the thread's state is destroyed: a thread that
    stashes and then exits (a worker thread idle too long) frees the object while the thread's
    ``local`` still holds it, and the second release corrupts the heap (a crash much later,
    anywhere). Torch's own module stashes only in the main thread, which never exits. The
    reference torch did not take is taken here, so the thread's end releases each one once."""
    before = sys.getrefcount(obj)
    torch._C._stash_obj_in_tls(key, obj)
    if sys.getrefcount(obj) == before:  # stolen, not taken
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class HFEngine:
    """Holds the policy weights of one sampler and generates a batch per call."""

    continuous = False

    def __init__(self, model_path: Path, dtype: str, seed: int,
                 device: torch.device | str = "cpu", profile: Sequence[int] = (),
                 profiles: Path | None = None, decode: str = "eager") -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device = indexed(device)  # the model, the prompts and the logits live here
        self.compiled = compile_config(decode, self.device)  # None: eager
        cap_memory(self.device)  # a GPU shared with the learner: the runner's split
        self.model: Any = PolicyModel.from_pretrained(model_path, dtype=getattr(torch, dtype))
        # a vision-language model: prompts' images become pixel tensors as the learner makes them
        self.processor = ImageProcessor(model_path) if is_vision_model(model_path) else None
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers types .to oddly
        float32_head(self.model)
        # generate must not apply the model's own sampling defaults (sampling_config)
        self.model.generation_config = GenerationConfig(
            bos_token_id=self.model.generation_config.bos_token_id,
            eos_token_id=self.model.generation_config.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id)
        self.params = dict(self.model.named_parameters())
        self.static_caches = StaticCaches(self.model.config)  # compiled decoding's caches
        self.adapter: AdapterSpec | None = None  # the LoRA adapters' spec once some arrived
        self.version = -1
        self.weight_sync_s = 0.0  # seconds spent copying weights in (generation waits), all loads
        self.abort = threading.Event()  # set by run_compute when the call is cancelled
        self.lock = anyio.Lock()  # one generate (or weight load) at a time: they share the model
        self.batches = 0  # generate calls so far; those in ``profile`` run under torch.profiler
        self.profile, self.profiles = set(profile), profiles
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
            self.batches += 1
            return await run_compute(on_device(self.device, self._profiled),
                                     [r.prompt_ids for r in requests], first,
                                     [r.images for r in requests], abort=self.abort)

    def _profiled(self, *args: Any) -> list[list[Generation]]:
        if self.compiled is not None:
            graph_trees_here()
        where = self.profiles if self.batches in self.profile else None
        with profiled(where, self.batches, self.device) as facts:
            groups = self._generate(*args)
            lengths = [len(g.token_ids) for group in groups for g in group]
            # each decoding step takes one token of every sequence: the steps are the longest
            facts.update(tokens=sum(lengths), decode_steps=max(lengths, default=0))
            return groups

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], like: GenerateRequest,
                  images: list[tuple[bytes, ...]] | None = None) -> list[list[Generation]]:
        """``like.n`` completions for each prompt (left-padded into one batch), each with its
        ``images`` (none: a text prompt)."""
        params, n, tok = like.params, like.n, self.tokenizer
        greedy = params.temperature == 0
        if like.seed is not None:  # the batch's draws follow from its place in the run alone
            torch.manual_seed(like.seed)
        width = max(len(p) for p in prompts)
        if self.compiled is not None:  # one static cache shape for many batches
            width = -(-width // WIDTH_BUCKET) * WIDTH_BUCKET
        pad = tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        vision = self._pixels(ids, images or [], n)
        shared = n > 1 and width > 1 and not vision  # (the cache would need the images' features)
        cache = self._shared_prompts(ids, attn, n) if shared else None
        ids, attn = ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)  # (B·n, P)
        if vision:
            vision["mm_token_type_ids"] = (ids == self.model.config.image_token_id).int()
        record = _TokenLogprobs(1.0 if greedy else params.temperature)
        config = sampling_config(params, pad, tok.eos_token_id)
        processors = LogitsProcessorList([record, *sampling_processors(params)])
        if self.compiled is not None:
            config.compile_config = self.compiled
            cache = self.static_caches.get(ids.shape[0], width + params.max_tokens,
                                           prompts=cache)
        out = self.model.generate(
            input_ids=ids, attention_mask=attn, past_key_values=cache, **vision,
            generation_config=config,
            tokenizer=tok if params.stop else None,
            logits_processor=processors,
            stopping_criteria=StoppingCriteriaList([_Abort(self.abort)]),
        )
        seqs = out.sequences[:, width:]  # (B·n, R)
        lps = record.finish(out.sequences, width).cpu()  # (B·n, R), the learner's quantity
        seqs = seqs.cpu()
        groups: list[list[Generation]] = [[] for _ in prompts]
        for row in range(seqs.shape[0]):
            length, reason = self._length(seqs[row], params.stop)
            groups[row // n].append(full_generation(seqs[row, :length].clone(),
                                                    lps[row, :length].clone(), self.version,
                                                    reason))
        return groups

    def _pixels(self, ids: torch.Tensor, images: list[tuple[bytes, ...]], n: int) -> dict:
        """``generate``'s vision inputs for prompts ``ids`` (B, P) with ``images``, each
        prompt's repeated for its ``n`` rows; empty when no prompt has images."""
        if not any(images):
            return {}
        if self.processor is None:
            raise ValueError("a prompt with images for a model without a vision tower")
        pixels, grids = [], []
        for prompt in images:
            if prompt:
                inputs = self.processor.pixels(prompt)
                pixels += [inputs.pixel_values] * n
                grids += [inputs.image_grid_thw] * n
        return {"pixel_values": torch.cat(pixels).to(self.device, self.model.dtype),
                "image_grid_thw": torch.cat(grids).to(self.device)}

    def _shared_prompts(self, ids: torch.Tensor, attn: torch.Tensor, n: int) -> Any:
        """The KV cache of every prompt but its last token, computed once per prompt and
        repeated for its ``n`` completions (``generate`` then starts from it): the prompt's
        forward is not done ``n`` times over (a third of a default-job batch's time on a CPU).
        Positions as ``generate`` numbers left-padded rows (from 0 at the first real token)."""
        position = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)  # (B, P)
        out = self.model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1],
                         position_ids=position[:, :-1], use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)  # (B·n, ...) in the order of repeat_interleave
        return cache

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

    async def load_weights(self, version: int, source: WeightsSource) -> None:
        async with self.lock:
            started = time.perf_counter()
            match source:
                case AdapterWeights():
                    copy: Callable[[Any], None] = self._copy_adapter
                case WorkerTransfer():
                    raise TypeError("the hf engine takes tensors, not a vLLM worker transfer")
                case _:
                    copy = self._copy
            try:
                await anyio.to_thread.run_sync(on_device(self.device, copy), source)
            except FileNotFoundError:  # shm: the learner's file was replaced by a newer version
                return  # (or removed at its exit) before it was opened: the old weights stay
            self.version = version
            self.weight_sync_s += time.perf_counter() - started

    @torch.no_grad()
    def _copy_adapter(self, source: AdapterWeights) -> None:
        """Copy a version's LoRA adapters into the live model's PEFT layers, in place. The
        first version injects the layers (PEFT's ``inject_adapter_in_model``: the model stays
        the transformers one, ``generate`` unchanged); the base weights are never touched."""
        spec = source.spec
        if self.adapter is None:
            from peft import LoraConfig, inject_adapter_in_model

            if self.version >= 0:
                raise ValueError("LoRA adapters sent to an engine that holds full weights")
            inject_adapter_in_model(LoraConfig(r=spec.rank, lora_alpha=spec.alpha,  # type: ignore[arg-type]
                                               target_modules=list(spec.target_modules)),
                                    self.model)
            self.model.eval()
            self.params = dict(self.model.named_parameters())
            self.adapter = spec
        elif spec != self.adapter:
            raise ValueError(f"LoRA adapters changed shape mid-run: {spec} after {self.adapter}")
        for name, value in source.tensors.items():
            target = adapter_parameter(name)
            if target not in self.params:
                raise KeyError(f"adapter weights for an unknown module: {name}")
            self.params[target].copy_(value)

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


def adapter_parameter(saved: str) -> str:
    """The engine's parameter of an adapter tensor under PEFT's saved name:
    ``base_model.model.X.lora_A.weight`` is ``X.lora_A.default.weight`` in a model that had the
    adapter injected (``inject_adapter_in_model``, adapter name ``default``)."""
    name = saved.removeprefix("base_model.model.")
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.", f".{part}.default.")
    return name


async def start(options: HFOptions, spec: EngineSpec) -> HFEngine:
    """The engine of ``sampler.engine = "hf"``, with its row's options."""
    return await anyio.to_thread.run_sync(on_device(spec.device, HFEngine), spec.model,
                                          spec.dtype, spec.seed, spec.device,
                                          spec.sampler.profile_batches, spec.profiles,
                                          options.decode)
