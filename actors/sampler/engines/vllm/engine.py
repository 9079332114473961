"""The vLLM engine: ``AsyncLLM`` (vLLM V1) behind the engine protocol, a continuous engine.

vLLM is asyncio; the sampler is trio. The engine runs its own asyncio loop in a daemon thread
(``_Loop``) and every call crosses over with ``asyncio.run_coroutine_threadsafe``; the trio side
waits on an event the asyncio side sets through the trio token, so the sampler's event loop
never blocks and no worker thread is held per request. Cancelling a trio call cancels its
asyncio task, which aborts its requests in the engine.

Processes: ``AsyncLLM`` starts vLLM's engine core as a child of the sampler (with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the default set here, the model runs inside it: two
processes in all, the fastest layout on a small CPU). The engine core imports
``worker.py`` (the worker extension), which ties its life to the sampler's. An engine that dies
under the sampler raises out of ``generate``: the sampler fails, the runner restarts it and the
replay buffer issues its prompts again.

Per request: each of the ``n`` completions is its own vLLM request with its own seed (recorded
in the ``Generation``; ``SamplingParams(seed=s)`` regenerates it exactly, alone or in a batch).
Behaviour log-probs are ``log_softmax(logits / T)`` at the sampled token before top-k/top-p
truncation (``worker.UntruncatedLogprobs``), the learner's quantity. A vision-language prompt
goes with its decoded images, its image tokens in the form vLLM expands (``images.py``).
Per-token versions come from vLLM's own weight-version spans: the engine core stamps every
step's output with the version it was computed with, and the version is changed only while
generation is paused.

Weight updates: ``load_weights`` matches on the typed source the weights transport hands it
(``actors/runtime/transports/sources.py``): a safetensors file in ``/dev/shm`` (shm; tensors
from zmq are written to one here first), loaded by the worker extension into the running model
(``collective_rpc``); or a GPU transfer (nccl, ipc) that vLLM's own weight-transfer engine in
the worker receives (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``).
``weight_update = "between_batches"`` waits until no request is running (new ones wait for the
load; the learner's broadcast of a GPU transfer waits with it) and resets the prefix cache (its
blocks hold keys computed with the old weights); ``"in_flight"`` pauses the engine keeping its
requests (``pause_generation(mode="keep")``), loads, and resumes: tokens after the swap carry
the new version. ``clear_cache`` drops the KV cache computed with the old weights (the kept
requests recompute it) or keeps it (faster; their next tokens attend to old-weight keys). LoRA
versions load as adapters without a pause (``lora.py``); an engine on a GPU shared with the
learner sleeps while idle (``sleep.py``). Both of vLLM 0.32's model runners are supported (V1:
the CPU's; V2: every GPU where Triton works), told apart by the running sampler
(``worker.sampler_kind``, ``sampler`` in the engine's statistics).

GPU note: the same code runs on a GPU with vLLM's CUDA build. With the shm or zmq transport the
file in ``/dev/shm`` is read by the worker and copied to the device by ``load_weights``;
``_die_with_parent``, the ``UntruncatedLogprobs`` wrapper (in front of FlashInfer's sampler when
it is chosen) and the tied ``lm_head`` re-dispatch (CPU only) are the lines whose GPU behaviour
no test here exercises.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import torch
import trio

from actors.data.vision import decode
from actors.runtime.transports.shm import SHM_ROOT
from actors.runtime.transports.sources import (
    AdapterWeights,
    SharedWeights,
    WeightsSource,
    WorkerTransfer,
)
from actors.runtime.transports.table import TRANSPORTS
from actors.sampler.engines.base import (
    AdapterLimits,
    EngineSpec,
    GenerateRequest,
    Generation,
    Rejected,
)
from actors.sampler.engines.vllm.images import check_expanded, image_token_id, tokens_prompt
from actors.sampler.engines.vllm.lora import AdapterSlots, lora_options, save_tensors, write_adapter
from actors.sampler.engines.vllm.receive import backend, calls, worker_env
from actors.sampler.engines.vllm.sleep import EngineSleep
from messages.rollout import SamplingParams

if TYPE_CHECKING:
    from actors.runtime.config import VLLMOptions


@dataclass(frozen=True)
class VLLMSettings:
    """What the engine needs from the topology (its row's options plus a few sampler keys)."""

    options: dict[str, Any]  # vLLM's own engine arguments (its row's), non-default ones
    weight_update: Literal["between_batches", "in_flight"] = "between_batches"
    clear_cache: bool = True  # in_flight: drop the old weights' KV cache at each update
    threads: int = 1  # CPU: OpenMP threads of the engine process (sampler.threads)
    label: str = ""  # names the engine's processes (their title: flowrl-vllm[LABEL]::EngineCore)
    sleep_idle_s: float = 0.0  # sleep after this long without requests (0: never; GPU only)
    weight_transfer: str = ""  # vLLM's weight-transfer backend its worker receives with ("": files)
    adapters: AdapterLimits | None = None  # LoRA: versions arrive as adapters (lora.py)
    memory: Any = None  # a MemoryLender: what the engine frees asleep is the learner's meanwhile


class _Loop:
    """An asyncio event loop in a daemon thread, and the one way trio code runs coroutines on
    it: ``await loop.call(coro)`` (cancellable, never blocking the trio loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-asyncio",
                                       daemon=True)
        self.thread.start()

    async def call(self, coro: Awaitable[Any]) -> Any:
        future: Any = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: object) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        future.add_done_callback(wake)
        try:
            await done.wait()
        except BaseException:
            future.cancel()  # the asyncio task aborts its requests; wait (a little) for that
            with anyio.move_on_after(10, shield=True):
                await done.wait()
            raise
        return future.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class VLLMEngine:
    """One ``AsyncLLM`` holding the policy weights of one sampler. Build it with ``start``."""

    continuous = True

    def __init__(self, model_path: Path, dtype: str, seed: int, settings: VLLMSettings) -> None:
        self.model_path, self.dtype, self.settings = model_path, dtype, settings
        self.version = -1
        self.seeds = itertools.count((seed * 1_000_003) % 2**31)  # one per completion
        self.ids = itertools.count()  # request ids (a regenerated seed may run twice at once)
        self.loop = _Loop()
        self.image_token = image_token_id(model_path)  # None: a text model
        self.llm: Any = None  # AsyncLLM, built on the loop's thread (its children hang off it)
        self.running = 0  # requests in the engine now (read and written on the loop's thread)
        self.idle: asyncio.Event | None = None  # set while running == 0 (the loop's thread)
        self.gate: asyncio.Event | None = None  # cleared while a between-batches load waits
        self.weight_sync_s = 0.0  # seconds between pause (or drain) and resume, all updates
        self.updates = 0
        self.updates_in_flight = 0  # updates that found requests in the engine and kept them
        self.load_s = 0.0  # of which: loading the file into the model
        self.sampler_kind = ""  # v1 or v2: which model runner's sampler the engine runs
        self.sleep = EngineSleep(settings.sleep_idle_s, settings.memory)
        self.slots = AdapterSlots(SHM_ROOT / f"flowrl-weights-{os.getpid()}-lora-{id(self)}") \
            if settings.adapters else None  # LoRA (a killed sampler's: remove_orphaned_shm)

    @classmethod
    async def start(cls, model_path: Path, dtype: str, seed: int,
                    settings: VLLMSettings) -> VLLMEngine:
        engine = cls(model_path, dtype, seed, settings)
        try:
            await engine.loop.call(engine._start())
        except BaseException:
            await engine.aclose()
            raise
        return engine

    async def _start(self) -> None:
        self.idle, self.gate = asyncio.Event(), asyncio.Event()
        self.idle.set()
        self.gate.set()
        # VLLM_LOGGING_LEVEL: vLLM's start-up notes (in this process and the engine's) would
        # drown the job's lines; errors still show, and the variable set by hand wins
        for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                           ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                           ("OMP_NUM_THREADS", str(self.settings.threads)),
                           ("VLLM_LOGGING_LEVEL", "ERROR")):
            os.environ.setdefault(key, value)
        if self.settings.label:  # read when vLLM is imported (below), so set first
            os.environ["VLLM_PROCESS_NAME_PREFIX"] = f"flowrl-vllm[{self.settings.label}]"
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        options = {"enforce_eager": True, "enable_prefix_caching": True,
                   **self.settings.options}
        if self.settings.sleep_idle_s > 0:
            options["enable_sleep_mode"] = True
        if self.settings.adapters:
            options.update(lora_options(self.settings.adapters))
        if self.settings.weight_transfer:  # the worker builds vLLM's transfer engine at start
            options["weight_transfer_config"] = {"backend": self.settings.weight_transfer}
        args = AsyncEngineArgs(
            model=str(self.model_path), dtype=self.dtype, seed=0,  # type: ignore[arg-type]
            logprobs_mode="processed_logprobs",
            worker_extension_cls=(
                "actors.sampler.engines.vllm.transfer.FlowrlTransferWorkerExtension"
                if self.settings.weight_transfer else
                "actors.sampler.engines.vllm.worker.FlowrlWorkerExtension"),
            **options)
        self.llm = AsyncLLM.from_engine_args(args, start_engine_loop=True)
        (self.sampler_kind, *_) = await self.llm.collective_rpc("flowrl_untruncated_logprobs")
        self.sleep.start(self.llm, lambda: self.running)

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[list[Generation]]:
        """The completions of every request, each completion its own engine request; raises
        ``Rejected`` when the engine refuses one (nothing of the call is returned then)."""
        prompts = await anyio.to_thread.run_sync(self._prompts, requests) \
            if any(r.images for r in requests) else self._prompts(requests)  # (decoding: a thread)
        jobs = [(r, p, [next(self.seeds) if r.seed is None else r.seed + i for i in range(r.n)])
                for r, p in zip(requests, prompts, strict=True)]
        return await self.loop.call(self._generate(jobs))

    def _prompts(self, requests: Sequence[GenerateRequest]) -> list[dict[str, Any]]:
        """vLLM's prompt of each request, its images decoded (``images.py``)."""
        return [tokens_prompt(r.prompt_ids, [decode(d, k) for k, d in enumerate(r.images)],
                              self.image_token) for r in requests]

    async def _generate(self, jobs: list[tuple[GenerateRequest, dict[str, Any], list[int]]]
                        ) -> list[list[Generation]]:
        tasks = [[asyncio.ensure_future(self._one(r.prompt_ids, p, r.params, s, r.stream, k))
                  for k, s in enumerate(seeds)] for r, p, seeds in jobs]
        try:
            return [list(await asyncio.gather(*group)) for group in tasks]
        finally:
            for group in tasks:
                for t in group:
                    t.cancel()

    async def _one(self, prompt_ids: list[int], prompt: dict[str, Any], params: SamplingParams,
                   seed: int, stream: Callable[[int, list[int], list[float]], None] | None = None,
                   index: int = 0) -> Generation:
        from vllm import SamplingParams as VSamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        assert self.gate is not None and self.idle is not None
        await self.gate.wait()  # a between-batches load is waiting for the engine to empty
        await self.sleep.wake(self.llm)
        greedy = params.temperature == 0
        sp = VSamplingParams(
            n=1, temperature=params.temperature, top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k, max_tokens=params.max_tokens,
            stop=list(params.stop) or None, logprobs=0, seed=seed,
            output_kind=RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY,
            detokenize=bool(params.stop))
        self.running += 1
        self.idle.clear()
        adapter = self.slots.pin() if self.slots else None  # LoRA: its version's, to the end
        try:
            final, seen = None, 0
            async for out in self.llm.generate(TokensPrompt(**prompt), sp,  # type: ignore[typeddict-item]
                                               request_id=f"{seed}-{next(self.ids)}",
                                               lora_request=adapter and adapter.request):
                if stream is not None:  # the tokens sampled since the last step (vLLM may
                    c = out.outputs[0]  # reuse one output object: count, do not compare)
                    new = list(c.token_ids[seen:])
                    if new:
                        stream(index, new, [lp[t].logprob for lp, t in
                                            zip(c.logprobs[seen:seen + len(new)], new,
                                                strict=True)])
                        seen += len(new)
                final = out
        except VLLMClientError as exc:  # the request itself is bad (EngineDeadError is not one)
            raise Rejected(str(exc)) from None
        finally:
            if self.slots:
                self.slots.unpin(self.llm, adapter)
            self.running -= 1
            if self.running == 0:
                self.idle.set()
                self.sleep.idle(asyncio.get_running_loop().time())
        assert final is not None
        if "multi_modal_data" in prompt:
            check_expanded(prompt_ids, final.prompt_token_ids)
        c = final.outputs[0]
        ids = torch.tensor(list(c.token_ids), dtype=torch.int32)  # (R,)
        lps = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)],
                           dtype=torch.float32)  # (R,)
        versions = torch.full((len(ids),), adapter.version if adapter else self.version,
                              dtype=torch.int32)
        for span in () if self.slots else c.weight_versions or ():
            versions[span.start:span.end] = int(span.version) if span.version.lstrip("-").isdigit() \
                else self.version
        n = len(ids)
        return Generation(ids, lps, versions, torch.ones(n, dtype=torch.int8),
                          "length" if c.finish_reason == "length" else "stop",
                          int(versions[0]) if n else self.version, seed=seed)

    # -- weights ---------------------------------------------------------------------------------

    async def load_weights(self, version: int, source: WeightsSource) -> None:
        """Load ``source`` into the running engine: a file in shared memory (the shm
        transport) from there, a GPU transfer through vLLM's weight-transfer API (the worker
        receives the bytes), and tensors in this process through a file in ``/dev/shm``."""
        match source:
            case AdapterWeights() if self.slots is not None:  # no pause: see lora.py
                started = time.perf_counter()
                lora_id, folder = self.slots.reserve(version)
                await anyio.to_thread.run_sync(write_adapter, folder, source)
                await self.loop.call(self.slots.add(self.llm, version, lora_id, folder))
                self.version = version
                self.load_s += time.perf_counter() - started
                self.updates += 1
            case AdapterWeights():
                raise ValueError("LoRA adapters reached a vLLM engine started without LoRA")
            case SharedWeights(path=path):
                await self.loop.call(self._swap(version, self._load_file(str(path))))
            case WorkerTransfer():  # ended either way, so the subscriber asks for the next
                try:
                    await self.loop.call(self._swap(version, self._receive(source)))
                except BaseException as exc:
                    source.done(exc)
                    raise
                source.done(None)
            case _:
                written = SHM_ROOT / f"flowrl-sampler-{os.getpid()}-v{version}.safetensors"
                await anyio.to_thread.run_sync(save_tensors, dict(source), written)
                try:
                    await self.loop.call(self._swap(version, self._load_file(str(written))))
                finally:
                    written.unlink(missing_ok=True)

    def _load_file(self, path: str) -> Callable[[], Awaitable[float]]:
        async def load() -> float:
            (seconds,) = await self.llm.collective_rpc("flowrl_load_weights", args=(path,))
            return seconds
        return load

    def _receive(self, transfer: WorkerTransfer) -> Callable[[], Awaitable[float]]:
        """vLLM's own weight-transfer round, while the learner sends (``receive.calls``):
        joining a new group first when the transfer brings one."""
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        async def receive() -> float:
            started = time.perf_counter()
            init, update = calls(transfer)
            if init is not None:
                await self.llm.init_weight_transfer_engine(
                    WeightTransferInitRequest(init_info=init))
            await self.llm.start_weight_update()
            await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update))
            await self.llm.finish_weight_update()
            await self.llm.collective_rpc("flowrl_redispatch_head")
            return time.perf_counter() - started
        return receive

    async def _swap(self, version: int, load: Callable[[], Awaitable[float]]) -> None:
        assert self.gate is not None and self.idle is not None
        in_flight = self.settings.weight_update == "in_flight" and self.running > 0
        if in_flight:
            started = time.perf_counter()
            await self.llm.pause_generation(mode="keep", clear_cache=self.settings.clear_cache)
        else:
            self.gate.clear()  # new requests wait for the new weights; running ones finish
            try:
                await self.idle.wait()
            except BaseException:
                self.gate.set()
                raise
            started = time.perf_counter()
        try:
            await self.sleep.wake(self.llm)  # the weights must be resident to be replaced
            seconds = await load()
            if seconds < 0:  # the learner's file was replaced by a newer one: keep the old
                return
            await self.llm.update_weight_version(str(version))
            self.version = version
            if not in_flight:  # the prefix cache holds keys computed with the old weights
                await self.llm.reset_prefix_cache()
        finally:
            if in_flight:
                await self.llm.resume_generation()
            self.gate.set()
        if self.running == 0:
            self.sleep.idle(asyncio.get_running_loop().time())
        self.weight_sync_s += time.perf_counter() - started
        self.load_s += seconds
        self.updates += 1
        self.updates_in_flight += in_flight

    async def watch(self) -> None:
        """Raise once vLLM's engine process has died (checked every second): requests waiting
        on it fail by themselves, but an idle sampler would otherwise wait for prompts
        forever with a dead engine."""
        while not self.llm.errored:  # noqa: ASYNC110 - vLLM sets a flag, it has no event
            await anyio.sleep(1.0)
        raise RuntimeError("vLLM's engine process died (EngineDeadError); the sampler stops so "
                           "the runner restarts it with a fresh engine")

    def statistics(self) -> dict[str, float | int | str]:
        return {"weight_updates": self.updates, "weight_updates_in_flight": self.updates_in_flight,
                "weight_sync_s": round(self.weight_sync_s, 3), "weight_load_s": round(self.load_s, 3),
                "in_engine": self.running, "sampler": self.sampler_kind,
                **self.sleep.clock.statistics().status(),
                "sleeps": self.sleep.clock.sleeps, "asleep": str(self.sleep.asleep).lower(),
                "clear_cache": str(self.settings.clear_cache).lower(),
                "adapters": len(self.slots.loaded) if self.slots else 0}

    async def aclose(self) -> None:
        if self.sleep.task is not None:
            self.loop.loop.call_soon_threadsafe(self.sleep.task.cancel)
        if self.llm is not None:
            llm, self.llm = self.llm, None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(
                    lambda: asyncio.run_coroutine_threadsafe(_shutdown(llm), self.loop.loop)
                    .result(timeout=30))
        self.loop.close()
        if self.slots is not None:
            self.slots.close()
        if self.sleep.lender is not None:
            self.sleep.lender.close()


async def start(options: VLLMOptions, spec: EngineSpec) -> VLLMEngine:
    """The engine of ``sampler.engine = "vllm"``, from its row's options and the sampler's
    keys; a weights transport whose transfers the workers receive (``receive.backend``) makes
    the worker build vLLM's engine for them."""
    cfg = spec.sampler
    gpu = torch.device(spec.device).type == "cuda"
    via = TRANSPORTS[spec.transport].load().receiver.worker_via if spec.transport else None
    for key, value in worker_env(via).items():
        os.environ.setdefault(key, value)  # read by the engine process vLLM starts
    settings = VLLMSettings(options.engine_args(gpu=gpu),
                            weight_update=cfg.weight_update, clear_cache=cfg.clear_cache,
                            threads=cfg.threads, label=spec.label,
                            sleep_idle_s=cfg.sleep_idle_s, adapters=spec.adapters,
                            memory=spec.memory,
                            weight_transfer=backend(via, torch.cuda.is_available()))
    return await VLLMEngine.start(spec.model, spec.dtype, spec.seed, settings)


async def _shutdown(llm: Any) -> None:
    llm.shutdown()

