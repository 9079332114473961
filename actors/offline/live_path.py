"""The live job's rollout path in one process, for the offline tools: the engine
``sampler.engine`` names (``actors/sampler/engines/registry.py``), the rollout strategy
``[agent]`` names (``actors/sampler/strategies.py``: single-turn, tools or environment, or
the endpoint with the user's rollout function) and ``Rollout`` (templating, generation,
scoring one request per group), with the reward worker's own ``Scoring`` standing where the
router and reward workers stand in a job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from actors.data.chat import ChatTokenizer
from actors.runtime.config import Topology
from actors.runtime.devices import resolve_device, resolve_dtype
from actors.sampler.engines import registry
from actors.sampler.rollout import Rollout
from actors.sampler.strategies import start_strategy
from actors.scoring.items import items_of
from actors.scoring.scorer import Scoring
from messages.reward import ScoreReply, ScoreRequest
from messages.rollout import SamplingParams


class LocalScoring:
    """``Scoring`` in this process behind the face ``Rollout`` scores through
    (``ScoringClient.score``): one request per group, never unanswered."""

    attempts, timeout_s = 1, 0.0  # named in the error of an unanswered request: never here

    def __init__(self, topo: Topology) -> None:
        self.scoring = Scoring(topo.reward)

    async def score(self, request: ScoreRequest) -> ScoreReply:
        return ScoreReply(await self.scoring.score(items_of(request),
                                                   request.max_response_length))

    async def aclose(self) -> None:
        await self.scoring.aclose()


@asynccontextmanager
async def live_rollout(topo: Topology, model: Path, params: SamplingParams,
                       n: int) -> AsyncIterator[Rollout]:
    """A ``Rollout`` of ``model`` (a checkpoint, or the run's base model) as the run's samplers
    made them, with its engine, strategy and scoring started, and closed after."""
    cfg = topo.sampler
    device = resolve_device(cfg.device, 0)
    dtype = str(resolve_dtype(cfg.dtype, device, topo.model.dtype)).removeprefix("torch.")
    engine = await registry.start_engine(cfg.engine, registry.EngineSpec(
        model, dtype, topo.run.seed * 1009 + 7919, device, cfg, label=f"offline {model}"))
    scoring = LocalScoring(topo)
    strategy = None
    try:
        tokenizer = await anyio.to_thread.run_sync(ChatTokenizer, model)
        strategy = await start_strategy(engine, tokenizer, topo.agent)
        async with anyio.create_task_group() as tg:
            if strategy is not None:
                await tg.start(strategy.serve)
            yield Rollout(engine, tokenizer, scoring, params=params, n=n,  # type: ignore[arg-type]
                          greedy_baseline=False, sampler="offline", agent=strategy)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            if strategy is not None:
                await strategy.aclose()
            await scoring.aclose()
            await engine.aclose()
