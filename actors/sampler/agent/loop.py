"""The agent loop: prompts in, multi-turn completions out, token in and token out.

Each sample is an episode with one growing list of response token ids. A model turn appends
the engine's tokens exactly (loss mask 1, the engine's behaviour log-probs and versions); the
turn's text is decoded only to find tool calls (or to hand an environment its action); a tool's
or environment's answer is rendered into tokens once (``render.Renderer``) and appended with
loss mask 0. Nothing already in the list is ever re-tokenized or re-templated, so the tokens
the learner trains on are the tokens the log-probs were computed on.

A prompt with images (a vision-language model's) keeps them for the whole episode: every turn's
request carries them (their tokens are the prompt's, at its start), and the sample trains on
them as a single turn's does (the replay buffer hands the group's prompt images to the learner).
A model turn that writes the image token ends its episode: the next turn's context would hold
one image token more than its images fill, which no engine takes (``image_stops`` counts them).

The response budget (``max_tokens``) counts every token after the prompt, tool tokens
included: a model turn gets what is left of it, and an answer that does not fit is cut there;
either way the sample ends with ``finish_reason = "length"``. A sample also ends when the model
makes no call (``stop``), when it has had ``agent.max_turns`` turns (a call in the last one is
not run), or when its environment says done.

Samples proceed concurrently, each in its own task. A continuous engine gets each turn as its
own request the moment it is ready, so one sample's tool call never holds up another's
generation. A batch engine (the transformers one) gets rounds: once every unfinished sample has
its next turn ready, one engine call generates all of them, so the samples of a batch proceed
together and a slow tool holds up its round for at most ``agent.tool_timeout_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import torch
from msgspec.structs import replace

from actors.data.chat import ChatTokenizer
from actors.runtime.config import AgentConfig
from actors.sampler.agent.env import EnvHost, Episode
from actors.sampler.agent.parsers import Parser, ToolCall, make_parser
from actors.sampler.agent.render import Renderer, prompt_ids
from actors.sampler.agent.toolbox import ToolBox, ToolResult
from actors.sampler.engines.base import Engine, GenerateRequest, Generation
from messages.rollout import Prompt, SamplingParams, Turn


@dataclass
class AgentGeneration(Generation):
    """A multi-turn completion: the engine protocol's per-token tensors over the whole response
    (tool and environment tokens included, with loss mask 0) and its turns."""

    turns: list[Turn] = field(default_factory=list)
    env_reward: float | None = None  # the sum of the environment's step rewards (None: no env)


def cut(gen: Generation, budget: int) -> Generation:
    """``gen`` with at most ``budget`` tokens (``length`` when some were cut)."""
    if len(gen.token_ids) <= budget:
        return gen
    return Generation(gen.token_ids[:budget], gen.logprobs[:budget], gen.versions[:budget],
                      gen.loss_mask[:budget], "length", gen.version)


class _Slot:
    def __init__(self) -> None:
        self.done = anyio.Event()
        self.result: Generation | None = None


class Rounds:
    """A batch engine's turns, gathered into one call per round (see the module doc)."""

    def __init__(self, engine: Engine, params: SamplingParams, episodes: int) -> None:
        self.engine, self.params = engine, params
        self.active = episodes  # episodes not finished: a round waits for each of them
        self.pending: list[tuple[list[int], int, tuple[bytes, ...], _Slot]] = []

    async def generate(self, ids: list[int], budget: int,
                       images: tuple[bytes, ...] = ()) -> Generation:
        slot = _Slot()
        self.pending.append((ids, budget, images, slot))
        if len(self.pending) == self.active:
            await self._fire()
        await slot.done.wait()
        assert slot.result is not None
        return slot.result

    async def leave(self) -> None:
        """An episode finished: the round no longer waits for it."""
        self.active -= 1
        if self.pending and len(self.pending) == self.active:
            await self._fire()

    async def _fire(self) -> None:
        batch, self.pending = self.pending, []
        # one call has one setting: the largest budget, each completion then cut to its own
        params = replace(self.params, max_tokens=max(b for _, b, _, _ in batch))
        out = await self.engine.generate([GenerateRequest(ids, params, 1, images=images)
                                          for ids, _, images, _ in batch])
        for (_, budget, _, slot), (gen,) in zip(batch, out, strict=True):
            slot.result = cut(gen, budget)
            slot.done.set()


class Direct:
    """A continuous engine's turns: each its own request, at once."""

    def __init__(self, engine: Engine, params: SamplingParams) -> None:
        self.engine, self.params = engine, params

    async def generate(self, ids: list[int], budget: int,
                       images: tuple[bytes, ...] = ()) -> Generation:
        ((gen,),) = await self.engine.generate(
            [GenerateRequest(ids, replace(self.params, max_tokens=budget), 1, images=images)])
        return cut(gen, budget)

    async def leave(self) -> None:
        pass


class Transcript:
    """One episode's growing response: token ids and their per-token facts, and its turns."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[int] = []
        self.turns: list[Turn] = []

    def model_turn(self, gen: Generation, text: str) -> None:
        start = len(self.ids)
        self.ids += gen.token_ids.tolist()
        self.logprobs += gen.logprobs.tolist()
        self.versions += gen.versions.tolist()
        self.mask += gen.loss_mask.tolist()
        self.turns.append(Turn("assistant", start, len(self.ids), content=text))

    def observation(self, ids: list[int], turn: Turn) -> None:
        """Tokens that are not the model's: loss mask 0, log-prob 0, and the version of the
        model turn they answer (a sample's oldest version stays that of its oldest own token)."""
        version = self.versions[-1] if self.versions else 0
        start = len(self.ids)
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.mask += [0] * len(ids)
        self.turns.append(replace(turn, start=start, end=len(self.ids)))

    def generation(self, finish: str, engine_version: int,
                   env_reward: float | None) -> AgentGeneration:
        own = [v for v, m in zip(self.versions, self.mask, strict=True) if m]
        return AgentGeneration(
            torch.tensor(self.ids, dtype=torch.int32),
            torch.tensor(self.logprobs, dtype=torch.float32),
            torch.tensor(self.versions, dtype=torch.int32),
            torch.tensor(self.mask, dtype=torch.int8), finish,
            min(own) if own else engine_version, turns=self.turns, env_reward=env_reward)


class AgentLoop:
    """Multi-turn rollouts with ``cfg``'s tools or environment over ``engine``."""

    def __init__(self, engine: Engine, tokenizer: ChatTokenizer, cfg: AgentConfig) -> None:
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.tools = ToolBox(cfg) if cfg.tools else None
        self.env = EnvHost(cfg) if cfg.env.enabled else None
        self.renderer = Renderer(tokenizer, "tool" if self.tools else "user",
                                 cfg.max_tool_response_tokens)
        self.parser: Parser | None = None
        self.stop: tuple[str, ...] = ()  # stop strings added to the sampling parameters
        processor = tokenizer.processor
        self.image_token = processor.image_token_id if processor is not None else -1
        self.image_stops = 0  # episodes ended because a model turn wrote the image token

    @property
    def broken(self) -> str:
        """Why the job must stop (a tool failing every call), or ""."""
        return self.tools.broken if self.tools is not None else ""

    @property
    def env_reward_only(self) -> bool:
        """The environment's rewards are the samples' rewards: no scoring request is sent."""
        return self.env is not None and self.cfg.env.reward == "replace"

    def statistics(self) -> dict[str, int | str]:
        """Counters since start, for the sampler's status (a vision-language policy's
        ``image_stops`` too)."""
        images = {"image_stops": self.image_stops} if self.image_token >= 0 else {}
        if self.tools is not None:
            s = self.tools.statistics()
            broken = {"tool_broken": self.tools.broken} if self.tools.broken else {}
            return {"tool_calls": s.calls, "tool_errors": s.errors, "tool_timeouts": s.timeouts,
                    "tool_crashes": s.crashes, **images, **broken}
        assert self.env is not None
        server = ({"env_server_restarts": self.env.server.restarts,
                   "env_episodes_retried": self.env.retried}
                  if self.env.server is not None else {})
        return {"env_steps": self.env.steps, "env_errors": self.env.errors, **server, **images}

    async def start(self) -> None:
        """Build the tools' schemas (in a child); raises when a tool does not load."""
        if self.tools is not None:
            try:
                await self.tools.start()
            except BaseException:
                await self.aclose()
                raise
            self.parser = make_parser(self.cfg.parser, self.tools.schemas)
            if self.cfg.stop_at_call:
                self.stop = self.parser.stop

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Nothing to serve beside the sampler's work (the endpoint strategy serves HTTP)."""
        task_status.started()

    def group_prompt(self, ids: list[int], completions: list[Generation]) -> list[int]:
        """Every sample follows the prompt's own tokens."""
        return ids

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's tokens, with the tools described (``render.prompt_ids``)."""
        schemas = self.tools.schemas if self.tools is not None else []
        return prompt_ids(self.tok, prompt.messages, schemas, self.parser,
                          hermes=self.cfg.parser == "hermes", images=prompt.images)

    async def generate(self, prompts: list[Prompt], ids: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[AgentGeneration]]:
        """``n`` episodes of each prompt, all at once; completions in prompt order."""
        turn_params = replace(params, stop=tuple(params.stop) + tuple(
            s for s in self.stop if s not in params.stop))
        gen: Rounds | Direct = (Direct(self.engine, turn_params) if self.engine.continuous
                                else Rounds(self.engine, turn_params, len(prompts) * n))
        out: list[list[AgentGeneration | None]] = [[None] * n for _ in prompts]

        async def one(i: int, j: int) -> None:
            out[i][j] = await self.episode(prompts[i], ids[i], gen, params.max_tokens)
            await gen.leave()

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                for j in range(n):
                    tg.start_soon(one, i, j)
        return [[g for g in row if g is not None] for row in out]

    async def episode(self, prompt: Prompt, prompt_ids: list[int], gen: Rounds | Direct,
                      budget: int) -> AgentGeneration:
        """One sample's episode; played once more, from its start, when the environment server
        the sampler serves died under it (the new server knows nothing of its session)."""
        played, lost = await self._episode(prompt, prompt_ids, gen, budget)
        if lost:
            assert self.env is not None
            self.env.retried += 1
            played, _ = await self._episode(prompt, prompt_ids, gen, budget)
        return played

    async def _episode(self, prompt: Prompt, prompt_ids: list[int], gen: Rounds | Direct,
                       budget: int) -> tuple[AgentGeneration, bool]:
        """The episode, and whether its environment's server died under it."""
        t = Transcript()
        images = tuple(prompt.images)  # every turn's request carries the prompt's images
        env = self.env.episode() if self.env is not None else None
        finish = "stop"
        alone = False  # the environment failed to reset: the model answers without it
        try:
            if env is not None:
                first = await env.reset(prompt)
                if first.error:  # recorded with no tokens; the model gets one turn
                    alone = True
                    t.turns.append(Turn("user", 0, 0, content=first.text, error=first.error,
                                        failure=first.failure, latency_s=first.latency_s))
                elif first.text:  # after an empty model turn (see the package doc)
                    finish = self._observe(t, [(first.text, Turn(
                        "user", 0, 0, latency_s=first.latency_s))], last_token=-1, budget=budget)
            for turn in range(self.cfg.max_turns):
                if finish == "length" or len(t.ids) >= budget:
                    finish = "length"
                    break
                g = await gen.generate(prompt_ids + t.ids, budget - len(t.ids), images)
                text = self.tok.decode(g.token_ids.tolist())
                t.model_turn(g, text)
                if g.finish_reason == "length":  # the budget ran out inside the turn
                    finish = "length"
                    break
                if alone:
                    break
                if images and self.image_token in g.token_ids.tolist():
                    self.image_stops += 1  # the next context would hold an image token with
                    break  # no image: no engine takes it (the learner reads it as text)
                last = turn == self.cfg.max_turns - 1
                if env is None:
                    if last:  # a call made in the last turn is not run
                        break
                    answers = await self._tools(text)
                else:  # the last action is still stepped: its reward counts
                    answers = await self._step(env, t, text)
                if not answers or last:
                    break
                ended = int(g.token_ids[-1]) if len(g.token_ids) else -1
                finish = self._observe(t, answers, ended, budget)
        finally:
            if env is not None:
                with anyio.CancelScope(shield=True):
                    await env.close()
        env_reward = None if env is None else sum(
            x.reward or 0.0 for x in t.turns if x.role == "assistant")
        return (t.generation(finish, self.engine.version, env_reward),
                env is not None and env.server_lost)

    def _observe(self, t: Transcript, answers: list[tuple[str, Turn]], last_token: int,
                 budget: int) -> str:
        """Append the rendered answers within the budget; ``length`` when one was cut."""
        contents = [self.renderer.content(text) for text, _ in answers]
        pieces = self.renderer.observations([ids for ids, _ in contents], last_token)
        for piece, (_, shown), (_, turn) in zip(pieces, contents, answers, strict=True):
            room = budget - len(t.ids)
            t.observation(piece[:room], replace(turn, content=shown))
            if len(piece) > room:
                return "length"
        return "stop"

    async def _tools(self, text: str) -> list[tuple[str, Turn]]:
        """Run the turn's calls (the first only with ``stop_at_call``), all at once."""
        assert self.tools is not None and self.parser is not None
        calls = self.parser.parse(text)
        if self.cfg.stop_at_call:
            calls = calls[:1]
        results: list[ToolResult | None] = [None] * len(calls)

        async def run(k: int) -> None:
            assert self.tools is not None
            results[k] = await self.tools.call(calls[k])

        async with anyio.create_task_group() as tg:
            for k in range(len(calls)):
                tg.start_soon(run, k)
        return [(r.text, _tool_turn(c, r)) for c, r in zip(calls, results, strict=True)
                if r is not None]

    async def _step(self, env: Episode, t: Transcript, text: str) -> list[tuple[str, Turn]]:
        """The environment's answer to the turn (none when the episode is done)."""
        step = await env.step(text)
        t.turns[-1] = replace(t.turns[-1], reward=step.reward)
        answer = Turn("user", len(t.ids), len(t.ids), content=step.text, error=step.error,
                      failure=step.failure, latency_s=step.latency_s)
        if step.done:  # recorded with no tokens: the model never reads the last observation
            t.turns.append(answer)
            return []
        return [(step.text, answer)]

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.tools is not None:
                await self.tools.aclose()
            if self.env is not None:
                await self.env.aclose()


def _tool_turn(call: ToolCall, result: ToolResult) -> Turn:
    return Turn("tool", 0, 0, name=call.name, arguments=call.arguments_text, error=result.error,
                failure=result.failure, latency_s=result.latency_s)
