"""``PoolScoring``: what a model pool's replica scores with (the rule workers' is ``Scoring``).

It holds the pool's model (a reward model, or a judge's engine and tokenizer) on the device the
runner gave the replica, batches concurrent requests into shared forwards (``Batcher``), and,
with ``sleep_idle_s``, puts the model to sleep while no request comes and wakes it for the next
(``actors/scoring/sleep.py``; a vllm judge sleeps by its engine's own policy). A model that
fails on a batch gives every item of it a recorded error, and the replica goes on serving.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import msgspec

from actors.runtime.config import RewardFunction, Topology
from actors.runtime.config.pools import PoolConfig
from actors.sandbox.children import Children
from actors.sandbox.protocol import Call, FunctionSpec, Outcome
from actors.scoring.batching import Batcher
from actors.scoring.items import ScoreItem
from actors.scoring.scorer import ScoringStatistics
from actors.scoring.sleep import TorchSleep
from messages.reward import ScoreResult


class PoolScoring:
    """Scores items with ``pool``'s model."""

    def __init__(self, pool: PoolConfig, topology: Topology, label: str = "") -> None:
        self.pool, self.topology, self.label = pool, topology, label
        self.batcher: Batcher[ScoreItem] = Batcher(self._run, pool.batch_size)
        self.sleeper: TorchSleep | None = None  # a torch model's sleep (set by load)
        self.engine: Any = None  # a judge's engine
        self.model: Any = None  # RewardModel or Judge
        self.children: Children | None = None  # a judge's parser = function
        if pool.kind == "judge" and pool.parser == "function":
            R = topology.reward
            self.children = Children(
                [FunctionSpec(path=pool.function_path, name=pool.function_name)], size=1,
                timeout_s=R.timeout_s, memory_mb=R.memory_mb, cpu_s=R.cpu_s, limits_key="reward")
        self.last_request = time.monotonic()
        self._items = self._errors = 0
        self.device = "cpu"

    async def load(self) -> None:
        """Load the model on this replica's device (a broken one fails the replica at start)."""
        import torch

        from actors.runtime.devices import cap_memory, resolve_device, resolve_dtype

        torch.set_num_threads(self.pool.threads)  # the replica's share of the cores
        device = resolve_device(self.pool.device)
        self.device = str(device)
        if self.pool.kind == "reward_model":
            cap_memory(device)  # a GPU shared with others: the runner's split (hf does its own)
            from actors.scoring.reward_model import RewardModel

            p = self.pool
            self.model = RewardModel(RewardFunction(
                builtin="reward_model", path=p.path, batch_size=p.batch_size,
                max_length=p.max_length, reward_mean=p.reward_mean, reward_std=p.reward_std),
                threads=p.threads, device=device)
            await anyio.to_thread.run_sync(self.model.load)
            module = self.model.module
        else:
            from actors.sampler.engines.registry import EngineSpec, start_engine
            from actors.scoring.judge import Judge

            dtype = str(resolve_dtype("auto", device, self.topology.model.dtype))
            sampler = msgspec.structs.replace(
                self.topology.sampler, engine=self.pool.engine, threads=self.pool.threads,
                sleep_idle_s=self.pool.sleep_idle_s if self.pool.engine == "vllm" else 0.0)
            self.engine = await start_engine(self.pool.engine, EngineSpec(
                Path(self.pool.path), dtype.removeprefix("torch."), self.topology.run.seed,
                device, sampler, label=self.label))
            tokenizer = getattr(self.engine, "tokenizer", None)
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.pool.path)
            self.model = Judge(self.pool, self.engine, tokenizer,
                               self._user_parse if self.children is not None else None)
            module = getattr(self.engine, "model", None)  # hf: a torch model; vllm: its own
        if self.pool.sleep_idle_s > 0 and module is not None:
            self.sleeper = TorchSleep(module, Path(self.pool.path))

    async def _user_parse(self, arguments: list[dict[str, Any]]) -> list[Outcome]:
        assert self.children is not None
        return await self.children.call(Call(0, arguments, len(arguments)))

    async def _run(self, items: list[ScoreItem]) -> list[Outcome]:
        """One batch, under the batcher's lock: wake the model first if it sleeps."""
        if self.sleeper is not None and self.sleeper.asleep:
            await anyio.to_thread.run_sync(self.sleeper.wake)
        return await self.model.score(items)

    async def score(self, items: list[ScoreItem], max_response_length: int = 0) -> list[ScoreResult]:
        """One result per item, in order (``max_response_length``: the rule workers' concern)."""
        self.last_request = time.monotonic()
        outcomes = await self.batcher.score(items)
        self.last_request = time.monotonic()
        results = [ScoreResult(o.score if not o.error else 0.0, o.error, o.extra, trace=o.trace)
                   for o in outcomes]
        self._items += len(items)
        self._errors += sum(1 for r in results if r.error)
        return results

    async def keep_sleeping(self) -> None:
        """Put the model to sleep whenever it has been idle ``sleep_idle_s`` (runs beside the
        replica's work; never returns)."""
        if self.sleeper is None:
            await anyio.sleep_forever()
        assert self.sleeper is not None
        while True:
            due = self.last_request + self.pool.sleep_idle_s - time.monotonic()
            if due > 0:
                await anyio.sleep(due)
                continue
            async with self.batcher.lock:  # no batch runs while the weights go
                idle = time.monotonic() - self.last_request >= self.pool.sleep_idle_s
                if idle and not self.sleeper.asleep and not self.batcher.statistics().queued:
                    await anyio.to_thread.run_sync(self.sleeper.sleep)
            await anyio.sleep(self.pool.sleep_idle_s)

    def statistics(self) -> ScoringStatistics:
        pool = self.children.statistics() if self.children is not None else None
        return ScoringStatistics(self._items, self._errors, pool.timeouts if pool else 0,
                                 pool.crashes if pool else 0, pool.children if pool else 0,
                                 pool.started if pool else 0)

    def status(self) -> dict[str, Any]:
        """What the replica adds to its status: the pool, batching, and sleeping."""
        b = self.batcher.statistics()
        out: dict[str, Any] = {"pool": self.pool.name, "model": self.pool.kind,
                               "device": self.device, "batches": b.batches,
                               "batch_items_max": b.largest,
                               "batch_requests_max": b.requests_largest, "queued": b.queued}
        if self.pool.kind == "judge" and self.model is not None:
            out.update(judge_answers=self.model.answers, judge_unreadable=self.model.unreadable)
        if self.sleeper is not None:
            out.update(self.sleeper.clock.statistics().status())
        elif self.engine is not None and self.pool.sleep_idle_s > 0:  # vllm's own sleep
            out.update(self.engine.sleep_clock.statistics().status())
        return out

    async def aclose(self) -> None:
        if self.children is not None:
            await self.children.aclose()
        if self.engine is not None:
            await self.engine.aclose()

