"""A rollout: issued prompts in, scored groups out.

The prompt's chat template is applied once, here (``actors/data/chat.py``); the engine gets
token ids and returns token ids, which are decoded only for scoring and the recording. Each
group is scored by one request through the router (the prompt's fields once, its ``n``
responses); a group no reward worker answered in time is still handed on, marked with a
``score_error``, so the replay buffer records and drops it instead of anyone waiting on it.
With ``[agent]`` configured, completions are multi-turn (``actors/sampler/agent``): the
scorer gets the whole transcript as ``solution_str`` and the turns in ``extra_info``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import torch

from actors.data.chat import ChatTokenizer
from actors.runtime.tensors import to_wire
from actors.sampler.engines.base import Engine, GenerateRequest, Generation
from actors.sampler.scoring_client import ScoringClient
from actors.sampler.teacher_client import teacher_logprobs
from messages.reward import Response, ScoreReply, ScoreRequest, ScoreResult
from messages.rollout import Prompt, Sample, SamplingParams, ScoredGroup, Turn
from messages.tensor import Tensor

if TYPE_CHECKING:
    from actors.sampler.agent.loop import AgentLoop
    from actors.sampler.endpoint.strategy import EndpointRollout


def turns_of(c: Generation) -> list[Turn]:
    """A multi-turn completion's turns (``AgentGeneration``); none for a single turn."""
    return list(getattr(c, "turns", ()))


def with_env_reward(result: ScoreResult, c: Generation) -> float:
    """The sample's reward: the scorer's, plus the sum of its environment's step rewards when
    it has one (``agent.env.reward``: ``add``, or ``replace``, when the scorer's is 0 by fiat);
    a failed scoring stays 0.0."""
    env = getattr(c, "env_reward", None)
    return result.score if env is None or result.error else result.score + env


def own_result(c: Generation) -> ScoreResult | None:
    """The reward a sample brought with it (an endpoint episode's return value), or None: the
    scorer's."""
    return getattr(c, "own", None)


class Answer:
    """What one awaited request returned (None: never asked), and how long it took."""

    def __init__(self) -> None:
        self.value: Any = None
        self.seconds = 0.0

    async def fill(self, pending: Awaitable[Any]) -> None:
        started = time.monotonic()
        self.value = await pending
        self.seconds = time.monotonic() - started


def reward_of(c: Generation) -> int:
    """The index in its group of the sample whose reward ``c`` shares (an endpoint episode's
    earlier segment shares its last one's), or -1: its own."""
    k = getattr(c, "reward_of", None)
    return -1 if k is None else k


def own_prompt(c: Generation, group: list[int], images: list[bytes]
               ) -> tuple[Tensor | None, list[bytes]]:
    """A sample's own prompt and its images when they differ from its group's (an endpoint
    call that rendered another conversation, or sent other images), else (None, [])."""
    ids = getattr(c, "prompt_ids", None)
    own = list(getattr(c, "images", ()))
    if ids is None or (ids == group and own == list(images)):
        return None, []
    return to_wire(torch.tensor(ids, dtype=torch.int32)), own


def without_images(prompt: Prompt) -> Prompt:
    """The prompt as a group names it: its images stay with the replay buffer, which issued
    them and hands them to the learner with the group (they travel to the sampler once)."""
    return msgspec.structs.replace(prompt, images=[]) if prompt.images else prompt


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
                 params: SamplingParams, n: int, greedy_baseline: bool, sampler: str,
                 agent: AgentLoop | EndpointRollout | None = None, teacher: bool = False) -> None:
        self.engine, self.tokenizer, self.scoring = engine, tokenizer, scoring
        self.teacher = teacher  # [teacher]: each group's teacher log-probs asked beside scoring
        self.params, self.n = params, n
        self.greedy_baseline = greedy_baseline  # remax: one greedy completion per prompt too
        self.sampler = sampler  # the sampler's name, recorded with each group
        self.agent = agent  # multi-turn rollouts: tools or an environment, or an endpoint

    async def _generate(self, prompts: list[Prompt], ids: list[list[int]],
                        params: SamplingParams, n: int,
                        seed: int | None = None) -> list[list[Generation]]:
        if self.agent is not None:  # each turn's request carries the prompt's images
            return await self.agent.generate(prompts, ids, n, params)  # type: ignore[return-value]
        return await self.engine.generate([
            GenerateRequest(i, params, n, images=tuple(p.images),
                            seed=None if seed is None else seed + k * n)
            for k, (i, p) in enumerate(zip(ids, prompts, strict=True))])

    async def generate_one(self, prompt: Prompt) -> Generated:
        """A continuous engine's unit: one prompt's completions (and its greedy one for remax),
        submitted alone; other prompts' requests share the engine's batches meanwhile."""
        return (await self.generate([prompt]))[0]

    def rejected(self, prompt: Prompt, reason: str) -> ScoredGroup:
        """The group of a prompt the engine refused for good: no samples, the reason recorded
        (the replay buffer drops it as ``rejected``)."""
        ids = self.tokenizer.prompt_ids(prompt.messages, images=prompt.images)
        return ScoredGroup(prompt=without_images(prompt), prompt_ids=to_wire(torch.tensor(ids, dtype=torch.int32)),
                           samples=[], sampler=self.sampler, sampling=self.params,
                           generate_error=reason[:500])

    async def generate(self, prompts: list[Prompt], seed: int | None = None) -> list[Generated]:
        """``n`` completions of each prompt (and its greedy one for remax), in one engine call
        per setting: a batch engine runs them as one batch (multi-turn: ``AgentLoop``).
        ``seed``: the batch's draws start from it (``PromptBatch.seed``); None: the engine's."""
        ids = [self.agent.prompt_ids(p) if self.agent is not None
               else self.tokenizer.prompt_ids(p.messages, images=p.images) for p in prompts]
        started = time.monotonic()
        groups = await self._generate(prompts, ids, self.params, self.n, seed)
        greedy: list[Generation | None] = [None] * len(prompts)
        if self.greedy_baseline:
            params = SamplingParams(temperature=0.0, max_tokens=self.params.max_tokens,
                                    stop=self.params.stop)
            greedy = [g[0] for g in await self._generate(prompts, ids, params, 1)]
        seconds = time.monotonic() - started
        if self.agent is not None:  # a strategy's samples may follow a prompt of their own
            ids = [self.agent.group_prompt(i, g) for i, g in zip(ids, groups, strict=True)]
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
        # multi-turn: the whole transcript (tool output included) is verl's solution_str
        texts = [self.tokenizer.decode(c.token_ids.tolist()) for c in g.completions]
        responses = [Response(t, len(c.token_ids), turns_of(c))
                     for t, c in zip(texts, g.completions, strict=True)]
        if g.greedy is not None:  # scored after the samples: its result is the last one
            responses.append(Response(self.tokenizer.decode(g.greedy.token_ids.tolist()),
                                      len(g.greedy.token_ids), turns_of(g.greedy)))
        p = g.prompt
        own = [own_result(c) for c in [*g.completions, *([g.greedy] if g.greedy else [])]]
        request = None if ((self.agent is not None and self.agent.env_reward_only)
                           or None not in own) else ScoreRequest(
            data_source=p.data_source, ground_truth=p.ground_truth, responses=responses,
            extra_info=p.extra_info, prompt=p.messages, max_response_length=self.params.max_tokens,
            images=p.images)
        scored, taught = Answer(), Answer()  # the scoring and teacher requests run side by side
        async with anyio.create_task_group() as tg:
            if request is not None:
                tg.start_soon(scored.fill, self.scoring.score(request))
            if self.teacher and g.completions:  # on-policy distillation: the teacher's log-probs
                tg.start_soon(taught.fill, teacher_logprobs(
                    self.scoring, g.prompt_ids, [c.token_ids for c in g.completions], p.images))
        reply = ScoreReply([ScoreResult(0.0)] * len(responses)) if request is None else scored.value
        teacher, teacher_error = taught.value or (None, "")  # (None, ""): not asked
        error = "" if reply is not None else (
            f"no reward worker answered after {self.scoring.attempts} sends "
            f"{self.scoring.timeout_s:g} s apart")
        error = error or teacher_error
        teacher = teacher if teacher is not None else [None] * len(g.completions)
        results = reply.results if reply is not None else [ScoreResult(0.0, error)] * len(responses)
        results = [r if o is None else o for r, o in zip(results, own, strict=True)]
        results = [results[k] if (k := reward_of(c)) >= 0 else r
                   for r, c in zip(results, [*g.completions, *([g.greedy] if g.greedy else [])],
                                   strict=True)]  # an endpoint episode's earlier segments
        rewards = [with_env_reward(r, c) for r, c in
                   zip(results, [*g.completions, *([g.greedy] if g.greedy else [])], strict=True)]
        samples = [Sample(response_ids=to_wire(c.token_ids), behaviour_logprobs=to_wire(c.logprobs),
                          policy_version=c.version, text=text, finish_reason=c.finish_reason,
                          reward=reward, reward_error=r.error, reward_trace=r.trace,
                          token_versions=to_wire(c.versions), loss_mask=to_wire(c.loss_mask),
                          reward_extra=r.extra, turns=turns_of(c), seed=c.seed,
                          answer=r.answer, teacher_logprobs=t, reward_of=reward_of(c),
                          prompt_ids=own[0], images=own[1])
                   for c, text, r, reward, t, own in zip(
                       g.completions, texts, results[:len(texts)], rewards[:len(texts)], teacher,
                       [own_prompt(c, g.prompt_ids, p.images) for c in g.completions],
                       strict=True)]
        return ScoredGroup(
            prompt=without_images(p), prompt_ids=to_wire(torch.tensor(g.prompt_ids, dtype=torch.int32)),
            samples=samples, sampler=self.sampler, generate_seconds=g.generate_seconds,
            score_seconds=time.monotonic() - started,
            baseline_reward=rewards[-1] if g.greedy is not None else None,
            sampling=self.params, score_error=error, teacher_seconds=taught.seconds)
