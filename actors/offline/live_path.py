"""The live job's rollout path in one process, for the offline tools: the engine
``sampler.engine`` names (``actors/runtime/config/engines.py``), the rollout strategy
``[agent]`` names (``actors/sampler/strategies.py``: single-turn, tools or environment, or
the endpoint with the user's rollout function) and ``Rollout`` (templating, generation,
scoring one request per group), with the reward workers' own scorers (the rules' ``Scoring``
and the served models' ``ServedScoring``) standing where the router and reward workers stand in a
job. ``runner.py validate`` generates and scores through ``live_rollout``; ``rerun --rescore``
scores recorded groups through ``scoring_rollout`` (``Rollout.score_group``: the same request
per group, the same items, as live).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import torch

from actors.data.chat import ChatTokenizer
from actors.runtime.config import RULES_POOL, Topology, score_targets
from actors.runtime.devices import resolve_device, resolve_dtype
from actors.runtime.tensors import from_wire
from actors.sampler.endpoint.strategy import EndpointGeneration
from actors.sampler.engines.base import EngineSpec
from actors.sampler.rollout import Generated, Rollout
from actors.sampler.strategies import start_strategy
from actors.scoring.combine import combine
from actors.scoring.items import items_of
from actors.scoring.scorer import Scoring, job_rules
from actors.scoring.served import ServedScoring
from messages.reward import ScoreReply, ScoreRequest
from messages.rollout import SamplingParams, ScoredGroup


class LocalScoring:
    """The job's scorers in this process behind the face ``Rollout`` scores through
    (``ScoringClient.score``): one request per group, never unanswered. The pools that score
    are the job's (``score_targets``: the rules' ``Scoring``, and each served model's
    ``ServedScoring``, its model loaded here), added up as the sampler adds them."""

    attempts, timeout_s = 1, 0.0  # named in the error of an unanswered request: never here

    def __init__(self, topo: Topology) -> None:
        self.targets = score_targets(topo.reward)
        self.scorers: dict[str, Scoring | ServedScoring] = {
            name: Scoring(topo.reward, job_rules(topo)) if name == RULES_POOL else
            ServedScoring(next(m for m in topo.reward.models if m.name == name), topo)
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
    engine = await cfg.engine.start(EngineSpec(
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


@asynccontextmanager
async def scoring_rollout(topo: Topology, tokenizer: Path, max_tokens: int
                          ) -> AsyncIterator[Rollout]:
    """A ``Rollout`` that only scores (no engine, no strategy: the completions are recorded
    ones, ``recorded``), with ``topo.reward``'s scoring and ``max_tokens`` the responses'
    budget (the overlong penalty's L_max)."""
    scoring = LocalScoring(topo)
    try:
        tok = await anyio.to_thread.run_sync(ChatTokenizer, tokenizer)
        yield Rollout(None, tok, scoring,  # type: ignore[arg-type]  # score_group needs none
                      params=SamplingParams(max_tokens=max_tokens), n=0,
                      greedy_baseline=False, sampler="offline")
    finally:
        with anyio.CancelScope(shield=True):
            await scoring.aclose()


def recorded(group: ScoredGroup) -> Generated:
    """A recorded group's completions as the sampler held them before scoring (recordings made
    before tokens carried versions or a loss mask: the sample's version, all 1)."""
    gens = []
    for s in group.samples:
        ids = from_wire(s.response_ids)
        versions = from_wire(s.token_versions) if s.token_versions is not None else \
            torch.full_like(ids, s.policy_version)
        mask = from_wire(s.loss_mask) if s.loss_mask is not None else \
            torch.ones_like(ids, dtype=torch.int8)
        gens.append(EndpointGeneration(
            ids, from_wire(s.behaviour_logprobs), versions, mask, s.finish_reason,
            s.policy_version, s.seed, turns=list(s.turns),
            reward_of=None if s.reward_of < 0 else s.reward_of))
    prompt = from_wire(group.prompt_ids).tolist()
    return Generated(group.prompt, prompt, list(gens), None, group.generate_seconds)
