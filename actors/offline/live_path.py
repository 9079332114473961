"""The live job's rollout path in one process, for the offline tools: the engine
``sampler.engine`` names (``actors/sampler/engines/registry.py``), the rollout strategy
``[agent]`` names (``actors/sampler/strategies.py``: single-turn, tools or environment, or
the endpoint with the user's rollout function) and ``Rollout`` (templating, generation,
scoring one request per group), with the reward workers' own scorers (the rules' ``Scoring``
and the model pools' ``PoolScoring``) standing where the router and reward workers stand in a
job.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from actors.data.chat import ChatTokenizer
from actors.runtime.config import Topology
from actors.runtime.config.pools import RULES_POOL, score_targets
from actors.runtime.devices import resolve_device, resolve_dtype
from actors.sampler.engines import registry
from actors.sampler.rollout import Rollout
from actors.sampler.strategies import start_strategy
from actors.scoring.combine import combine
from actors.scoring.items import items_of
from actors.scoring.pool import PoolScoring
from actors.scoring.scorer import Scoring
from messages.reward import ScoreReply, ScoreRequest
from messages.rollout import SamplingParams


class LocalScoring:
    """The job's scorers in this process behind the face ``Rollout`` scores through
    (``ScoringClient.score``): one request per group, never unanswered. The pools that score
    are the job's (``score_targets``: the rules' ``Scoring``, and each model pool's
    ``PoolScoring``, its model loaded here), added up as the sampler adds them."""

    attempts, timeout_s = 1, 0.0  # named in the error of an unanswered request: never here

    def __init__(self, topo: Topology) -> None:
        self.targets = score_targets(topo.reward)
        self.scorers: dict[str, Scoring | PoolScoring] = {
            name: Scoring(topo.reward) if name == RULES_POOL else
            PoolScoring(next(p for p in topo.reward.pools if p.name == name), topo)
            for name, _ in self.targets}

    async def load(self) -> None:
        for scorer in self.scorers.values():
            await scorer.load()

    async def score(self, request: ScoreRequest) -> ScoreReply:
        items = items_of(request)
        return combine(self.targets, [
            ScoreReply(await self.scorers[name].score(items, request.max_response_length))
            for name, _ in self.targets])

    async def aclose(self) -> None:
        for scorer in self.scorers.values():
            await scorer.aclose()


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
        await scoring.load()
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
