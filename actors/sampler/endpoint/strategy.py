"""The endpoint rollout strategy: each episode is the user's ``rollout(client, row)`` in a
sandboxed child, its model calls served by this sampler's engine (``server.py``) and merged
into one sample token in and token out (``episodes.py``).

Every episode has its own address, ``http://HOST:PORT/episodes/ID/v1``; ``n`` episodes of a
prompt make its group (more samples when episodes branched, each on its own prompt:
``episodes.py``). All calls of an episode go to this sampler's one engine (sticky: its prefix
cache serves the episode), inside the sampler's admission. A batch engine (hf) gets the
calls that arrive while it is busy as one batch when it is free (one batch per sampling
setting); a continuous engine (vllm) gets each call at once.

The reward is the function's return value, or, when it returns None, the configured scorer's
on the transcript (``Rollout.score_group``). An episode that raises, times out
(``agent.rollout.episode_timeout_s``: its child is killed) or makes more than
``agent.rollout.max_calls`` calls is a failure, recorded in its last sample's turns and
counted; ``on_failure`` says whether its samples train with reward 0 or are dropped with
their group. Every sample of an episode has the episode's reward.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from actors.data.chat import ChatTokenizer
from actors.runtime.config import AgentConfig
from actors.sampler.agent.loop import AgentGeneration, Transcript
from actors.sampler.endpoint.episodes import Episode, Segment
from actors.sampler.endpoint.images import openai_messages
from actors.sampler.engines.base import Engine, GenerateRequest, Generation
from actors.sandbox.children import Children
from actors.sandbox.protocol import TO_SCORER, Call, FunctionSpec, Outcome
from messages.reward import ScoreResult
from messages.rollout import Prompt, SamplingParams, Turn


@dataclass
class EndpointGeneration(AgentGeneration):
    """An episode's sample: its per-token tensors after the group's prompt, its turns, and the
    reward its function returned (None: the scorer's)."""

    own: ScoreResult | None = None
    prompt_ids: list[int] | None = None  # its own prompt: its segment's first call's tokens
    # (None: the episode made no call; the group's prompt)
    reward_of: int | None = None  # a segment its episode left behind: the index in the group
    # of the episode's last sample, whose reward (the scorer's on it) it shares
    images: tuple[bytes, ...] = ()  # its own prompt's images (their tokens are in prompt_ids)


class _Slot:
    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.result: list[Generation] | Exception | None = None


class Batcher:
    """A batch engine's calls: those that arrive while it generates go as one batch next (one
    batch per sampling setting). The caller whose call finds the engine idle runs batches
    until its own is done; the others wait for it to stop and then take over, so a caller
    cancelled mid-batch (its batch goes back to the queue) never strands the rest."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pending: list[_Slot] = []
        self.firing = False  # a caller is running batches now
        self.idle = anyio.Event()  # set when that caller stops

    async def generate(self, request: GenerateRequest) -> list[Generation]:
        slot = _Slot(request)
        self.pending.append(slot)
        try:
            while slot.result is None:
                if self.firing:
                    await self.idle.wait()
                    continue
                self.firing, self.idle = True, anyio.Event()
                try:
                    while slot.result is None:
                        await self._fire()
                finally:
                    self.firing = False
                    self.idle.set()
        except BaseException:  # this caller is gone: its request is nobody's to run
            if slot in self.pending:
                self.pending.remove(slot)
            raise
        if isinstance(slot.result, Exception):
            raise slot.result
        return slot.result

    async def _fire(self) -> None:
        like = self.pending[0].request
        batch = [s for s in self.pending if (s.request.params, s.request.n) == (like.params, like.n)]
        self.pending = [s for s in self.pending if s not in batch]
        try:
            results: Sequence[list[Generation] | Exception] = \
                await self.engine.generate([s.request for s in batch])
        except Exception as exc:  # Rejected, or a bad setting: every caller of the batch hears it
            results = [exc] * len(batch)
        except BaseException:  # cancelled: the batch waits for the next caller to run it
            self.pending = batch + self.pending
            raise
        for s, result in zip(batch, results, strict=True):
            s.result = result


class EndpointRollout:
    """``[agent.rollout]``: user agents against an OpenAI-compatible endpoint per episode."""

    def __init__(self, engine: Engine, tokenizer: ChatTokenizer, cfg: AgentConfig) -> None:
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        R = cfg.rollout
        self.children = Children(
            [FunctionSpec(module="actors.sandbox.episode", name="run_episode", returns="episode",
                          preload=("openai",),
                          kwargs={"rollout_path": R.path, "rollout_name": R.name,
                                  "call_timeout_s": R.episode_timeout_s})],
            size=cfg.processes, timeout_s=R.episode_timeout_s, memory_mb=cfg.memory_mb,
            cpu_s=cfg.cpu_s, limits_key="agent", timeout_key="rollout.episode_timeout_s")
        self.batcher = Batcher(engine)
        self.episodes: dict[str, Episode] = {}  # open episodes by id
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}{time.time_ns() % 10**6:x}"
        self.base_url = ""  # http://HOST:PORT, once serving
        self.serving = anyio.Event()
        self.stats = dict.fromkeys(("episodes", "episode_errors", "episode_timeouts", "calls",
                                    "bad_calls", "branches", "call_tokens"), 0)
        self.call_seconds = 0.0  # engine time of the calls, all together

    broken = ""  # nothing here stops the job: every failure is one episode's
    env_reward_only = False

    def statistics(self) -> dict[str, int | str]:
        return {f"endpoint_{k}": v for k, v in self.stats.items()}

    async def start(self) -> None:
        pass

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Serve the endpoint until cancelled (``server.serve``)."""
        from actors.sampler.endpoint.server import serve

        await serve(self, task_status=task_status)

    async def aclose(self) -> None:
        await self.children.aclose()

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return self.tok.prompt_ids(prompt.messages, images=prompt.images)

    def group_prompt(self, ids: list[int], completions: list[Generation]) -> list[int]:
        """The group's prompt: the dataset prompt's tokens (a sample whose calls rendered
        another conversation carries its own, ``EndpointGeneration.prompt_ids``)."""
        return ids

    async def call_engine(self, ids: list[int], params: SamplingParams, n: int,
                          stream=None, seed: int | None = None,
                          images: tuple[bytes, ...] = ()) -> list[Generation]:
        """``n`` completions of ``ids`` (with ``images``, whose tokens ``ids`` holds expanded);
        ``stream`` (``GenerateRequest.stream``) hears a continuous engine's tokens as they come;
        ``seed`` (the request's) seeds an engine with per-sample seeds (vllm),
        ``GenerateRequest.seed``."""
        started = time.monotonic()
        request = GenerateRequest(ids, params, n, seed=seed, images=images, stream=stream)
        if self.engine.continuous:
            (gens,) = await self.engine.generate([request])
        else:
            gens = await self.batcher.generate(request)
        self.call_seconds += time.monotonic() - started
        self.stats["call_tokens"] += sum(len(g.token_ids) for g in gens)
        return gens

    async def generate(self, prompts: list[Prompt], ids: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[EndpointGeneration]]:
        """``n`` episodes of each prompt, all at once; samples in prompt order."""
        await self.serving.wait()
        out: list[list[tuple[Episode, Outcome]]] = [[] for _ in prompts]

        async def one(i: int) -> None:
            out[i].append(await self.episode(prompts[i], params))

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                for _ in range(n):
                    tg.start_soon(one, i)
        return [self.group(ids[i], out[i]) for i in range(len(prompts))]

    async def episode(self, prompt: Prompt, params: SamplingParams) -> tuple[Episode, Outcome]:
        eid = f"{self._prefix}-{next(self._ids)}"
        ep = Episode(params, max_calls=self.cfg.rollout.max_calls)
        self.episodes[eid] = ep
        row = {"prompt": openai_messages(prompt.messages, prompt.images),
               "data_source": prompt.data_source,
               "reward_model": {"ground_truth": prompt.ground_truth, "style": "rule"},
               "extra_info": dict(prompt.extra_info)}
        try:
            (o,) = await self.children.call(Call(0, [{
                "base_url": f"{self.base_url}/episodes/{eid}/v1", "row": row}], 1))
        finally:
            del self.episodes[eid]
        self.stats["episodes"] += 1
        self.stats["branches"] += ep.branches
        if ep.calls > ep.max_calls:  # whatever the function did with the refusal
            o = Outcome(error=f"made more than agent.rollout.max_calls = {ep.max_calls} calls",
                        failure="max_calls", trace=o.trace)
        if o.error:
            self.stats["episode_errors"] += 1
            self.stats["episode_timeouts"] += o.failure == "timeout"
        return ep, o

    def group(self, ids: list[int], episodes: list[tuple[Episode, Outcome]]
              ) -> list[EndpointGeneration]:
        """The group's samples, episode by episode, each on its own prompt (its segment's
        first call's tokens); every sample of an episode gets the episode's reward."""
        segs = [ep.samples(self.cfg.rollout.branches) for ep, _ in episodes]
        out: list[EndpointGeneration] = []
        for (ep, o), ss in zip(episodes, segs, strict=True):
            last = len(out) + len(ss) - 1
            out += [self.sample(ep, seg, o, None if j == last else last)
                    for j, seg in enumerate(ss, len(out))]
        return out

    def sample(self, ep: Episode, seg: Segment | None, o: Outcome,
               reward_of: int | None) -> EndpointGeneration:
        t = Transcript()
        if seg is not None:
            t.ids, t.logprobs = list(seg.t.ids), list(seg.t.logprobs)
            t.versions, t.mask, t.turns = list(seg.t.versions), list(seg.t.mask), list(seg.t.turns)
        if o.error and reward_of is None:
            t.turns.append(Turn("user", len(t.ids), len(t.ids), content="episode failed",
                                error=o.error, failure=o.failure or "raised"))
        finish = "stop"
        if seg is not None and seg.t.turns and ep.room(seg) == 0:
            finish = "length"
        if o.error:
            own: ScoreResult | None = ScoreResult(
                0.0, error=f"episode {o.failure or 'raised'}: {o.error}"
                if self.cfg.rollout.on_failure == "drop" else "", trace=o.trace)
        elif o.text == TO_SCORER:
            own = None
        else:
            own = ScoreResult(o.score, extra=dict(o.extra), answer=o.answer)
        g = t.generation(finish, self.engine.version, None)
        return EndpointGeneration(g.token_ids, g.logprobs, g.versions, g.loss_mask,
                                  g.finish_reason, g.version, turns=g.turns, own=own,
                                  prompt_ids=seg.prompt if seg is not None else None,
                                  reward_of=reward_of,
                                  images=seg.images if seg is not None else ())
