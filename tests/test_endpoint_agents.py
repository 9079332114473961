"""A real agent framework from PyPI, unchanged, against the endpoint: the OpenAI Agents SDK
(``openai-agents``), the framework the ``openai`` client's own users reach for first, with a
function tool, through ``OpenAIChatCompletionsModel`` on the client the episode is given.

The engine is scripted (the agent loop's own test engine, ``tests/test_agent.py``): it writes a
hermes tool call until it sees the tool's answer in its context, then the answer, so the
framework's whole loop runs: it reads the call from the endpoint's ``tool_calls``, runs its
tool, and sends the result back as a ``tool`` message.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import anyio
import pytest

from actors.data.chat import ChatTokenizer
from actors.runtime.config import AgentConfig, AgentRollout
from actors.sampler.endpoint.strategy import EndpointRollout
from messages.rollout import ChatMessage, Prompt, SamplingParams
from tests.test_agent import CALL, EOS, WORDS, ScriptedEngine
from tests.tiny_model import build_tiny_model

pytest.importorskip("agents")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("agents") / "model", words=WORDS)


def test_an_agents_sdk_agent_runs_unchanged_and_its_episodes_are_samples(model, tmp_path):
    user = tmp_path / "sdk_agent.py"
    user.write_text(textwrap.dedent('''
        from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
        from agents import set_tracing_disabled

        set_tracing_disabled(True)  # no traces sent to OpenAI


        @function_tool
        def calculator(expression: str) -> str:
            """Multiply two whole numbers written as A*B."""
            a, b = expression.split("*")
            return str(int(a) * int(b))


        async def rollout(client, row):
            agent = Agent(name="solver", instructions="use the calculator", tools=[calculator],
                          model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
            result = await Runner.run(agent, row["prompt"][-1]["content"], max_turns=4)
            return 1.0 if row["reward_model"]["ground_truth"] in result.final_output else 0.0
    '''))
    tok = ChatTokenizer(model)

    def script(context: str) -> str:
        return "the answer is 408" + EOS if "408" in context else CALL + EOS

    engine = ScriptedEngine(tok, script)
    r = EndpointRollout(engine, tok, AgentConfig(rollout=AgentRollout(path=str(user)),
                                                 processes=2))
    prompt = Prompt(0, [ChatMessage("user", "what is 12*34")], "t", "408")

    async def main():
        async with anyio.create_task_group() as tg:
            await tg.start(r.serve)
            try:
                (group,) = await r.generate([prompt], [r.prompt_ids(prompt)], 2,
                                            SamplingParams(max_tokens=64))
            finally:
                tg.cancel_scope.cancel()
                await r.aclose()
        return group

    group = anyio.run(main, backend="trio")
    assert r.stats["episodes"] == 2 and r.stats["episode_errors"] == 0
    assert r.stats["calls"] == 4  # per episode: the tool call, then the answer
    # the framework sent the call back as a tool_calls message with no content, which this
    # template renders without the call: the answer's prompt does not extend the first call's
    # tokens, so each episode yields two samples (agent.rollout.branches = "train"): the tool
    # call's segment, then the answer's, both with the episode's reward
    assert len(group) == 4
    for k in (0, 2):
        call, answer = group[k], group[k + 1]
        assert call.reward_of == k + 1 and answer.reward_of is None
        for g in (call, answer):
            assert g.own is not None and g.own.score == 1.0, g.turns
        assert tok.decode(call.token_ids.tolist()).endswith("</tool_call>")
        assert tok.decode(answer.token_ids.tolist()).endswith("the answer is 408")
        n = len(tok.tokenizer.encode("the answer is 408" + EOS))
        assert answer.loss_mask.tolist()[-n:] == [1] * n
    assert r.stats["branches"] == 2
