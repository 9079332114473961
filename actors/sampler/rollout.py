"""A rollout: issued prompts in, scored groups out.

The prompt's chat template is applied once, here (``actors/data/chat.py``); the engine gets
token ids and returns token ids, which are decoded only for scoring and the recording. Each
group is scored by one request through the router (the prompt's fields once, its ``n``
responses); a group no reward worker answered in time is still handed on, marked with a
``score_error``, so the replay buffer records and drops it instead of anyone waiting on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import torch

from actors.data.chat import ChatTokenizer
from actors.runtime.tensors import to_wire
from actors.sampler.engines.base import Engine, GenerateRequest, Generation
from actors.sampler.scoring_client import ScoringClient
from messages.reward import Response, ScoreRequest, ScoreResult
from messages.rollout import Prompt, Sample, SamplingParams, ScoredGroup


@dataclass
class Generated:
    """One prompt's completions, not scored yet."""

    prompt: Prompt
    prompt_ids: list[int]
    completions: list[Generation]
    greedy: Generation | None  # remax: the greedy completion whose reward is the baseline
    generate_seconds: float


class Rollout:
    """Generates and scores groups of ``n`` completions with ``params``."""

    def __init__(self, engine: Engine, tokenizer: ChatTokenizer, scoring: ScoringClient, *,
                 params: SamplingParams, n: int, greedy_baseline: bool, sampler: str) -> None:
        self.engine, self.tokenizer, self.scoring = engine, tokenizer, scoring
        self.params, self.n = params, n
        self.greedy_baseline = greedy_baseline  # remax: one greedy completion per prompt too
        self.sampler = sampler  # the sampler's name, recorded with each group

    async def generate(self, prompts: list[Prompt]) -> list[Generated]:
        """``n`` completions of each prompt (and its greedy one for remax), in one engine call
        per setting: a batch engine runs them as one batch."""
        ids = [self.tokenizer.prompt_ids(p.messages) for p in prompts]
        started = time.monotonic()
        groups = await self.engine.generate([GenerateRequest(i, self.params, self.n) for i in ids])
        greedy: list[Generation | None] = [None] * len(prompts)
        if self.greedy_baseline:
            params = SamplingParams(temperature=0.0, max_tokens=self.params.max_tokens,
                                    stop=self.params.stop)
            greedy = [g[0] for g in await self.engine.generate(
                [GenerateRequest(i, params, 1) for i in ids])]
        seconds = time.monotonic() - started
        return [Generated(p, i, g, b, seconds)
                for p, i, g, b in zip(prompts, ids, groups, greedy, strict=True)]

    async def score(self, generated: list[Generated]) -> list[ScoredGroup]:
        """Every group scored, each by its own request, all at once."""
        out: list[ScoredGroup | None] = [None] * len(generated)

        async def one(k: int) -> None:
            out[k] = await self.score_group(generated[k])

        async with anyio.create_task_group() as tg:
            for k in range(len(generated)):
                tg.start_soon(one, k)
        return [g for g in out if g is not None]

    async def score_group(self, g: Generated) -> ScoredGroup:
        started = time.monotonic()
        texts = [self.tokenizer.decode(c.token_ids.tolist()) for c in g.completions]
        responses = [Response(t, len(c.token_ids)) for t, c in zip(texts, g.completions, strict=True)]
        if g.greedy is not None:  # scored after the samples: its result is the last one
            responses.append(Response(self.tokenizer.decode(g.greedy.token_ids.tolist()),
                                      len(g.greedy.token_ids)))
        p = g.prompt
        reply = await self.scoring.score(ScoreRequest(
            data_source=p.data_source, ground_truth=p.ground_truth, responses=responses,
            extra_info=p.extra_info, prompt=p.messages, max_response_length=self.params.max_tokens))
        error = "" if reply is not None else (
            f"no reward worker answered after {self.scoring.attempts} sends "
            f"{self.scoring.timeout_s:g} s apart")
        results = reply.results if reply is not None else [ScoreResult(0.0, error)] * len(responses)
        samples = [Sample(response_ids=to_wire(c.token_ids), behaviour_logprobs=to_wire(c.logprobs),
                          policy_version=c.version, text=text, finish_reason=c.finish_reason,
                          reward=r.score, reward_error=r.error,
                          token_versions=to_wire(c.versions), loss_mask=to_wire(c.loss_mask),
                          answer=r.answer, reward_extra=r.extra)
                   for c, text, r in zip(g.completions, texts, results[:len(texts)], strict=True)]
        return ScoredGroup(
            prompt=p, prompt_ids=to_wire(torch.tensor(g.prompt_ids, dtype=torch.int32)),
            samples=samples, sampler=self.sampler, generate_seconds=g.generate_seconds,
            score_seconds=time.monotonic() - started,
            baseline_reward=results[-1].score if g.greedy is not None else None,
            sampling=self.params, score_error=error)
