"""The endpoint rollout strategy in-process: the real ``openai`` client against the sampler's
endpoint on the tiny model with the HF engine (chat, tools, streaming, log-probs, completions
by token ids, bad requests), token-in/token-out merging, and whole episodes of a user's
rollout function in sandboxed children (rewards, None to the scorer, failures recorded)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import anyio
import httpx
import openai
import pytest
import torch
from anyio import wait_all_tasks_blocked

from actors.data.chat import ChatTokenizer
from actors.offline.inspection import transcript
from actors.runtime.config import AgentConfig, AgentRollout
from actors.sampler.agent.parsers import Hermes, Xml
from actors.sampler.endpoint.api import (
    BadRequest,
    ChatRequest,
    assistant_message,
    call_prefix,
    decode_body,
    forced_message,
)
from actors.sampler.endpoint.episodes import Episode
from actors.sampler.endpoint.strategy import Batcher, EndpointRollout
from actors.sampler.engines.base import GenerateRequest, full_generation
from actors.sampler.engines.hf import HFEngine
from actors.sandbox.protocol import TO_SCORER
from messages.rollout import ChatMessage, Prompt, SamplingParams
from tests.tiny_model import CHAT_TEMPLATE, build_tiny_model

TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\ntools{% for t in tools %} {{ t['function']['name'] }}"
                  "{% endfor %}<|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
TOOL = {"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                          "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "say abc"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = build_tiny_model(tmp_path_factory.mktemp("endpoint") / "model")
    tok = ChatTokenizer(path).tokenizer
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rollout_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "my_agent.py"
    path.write_text(textwrap.dedent('''
        import asyncio


        async def rollout(client, row):
            kind = row["extra_info"]["kind"]
            messages = list(row["prompt"])
            # greedy: the same tokens whatever the batch (its text has no special tokens mid-way)
            r = await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=4, temperature=0)
            if kind == "raise":
                raise RuntimeError("the agent broke")
            if kind == "hang":
                await asyncio.sleep(600)
            if kind == "many":
                for _ in range(5):
                    await client.chat.completions.create(model="policy", messages=messages)
            if kind in ("branch", "branch_none"):  # the history summarised: a new segment
                messages = [{"role": "user", "content": "summary: " + r.choices[0].message.content}]
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "again"}]
            r2 = await client.chat.completions.create(model="policy", messages=messages,
                                                      max_tokens=4, temperature=0)
            if kind in ("none", "branch_none"):
                return None
            if kind == "dict":
                return {"format": 0.5, "answer": 1.0}
            return float(len(r2.choices[0].token_ids))
    '''))
    return path


def make(model: Path, rollout_file: Path | str = "", **kw) -> EndpointRollout:
    cfg = AgentConfig(rollout=AgentRollout(path=str(rollout_file), **kw), processes=2)
    return EndpointRollout(HFEngine(model, "float32", seed=0), ChatTokenizer(model), cfg)


async def with_endpoint(r: EndpointRollout, body) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(r.serve)
        try:
            await body()
        finally:
            tg.cancel_scope.cancel()
            await r.aclose()


def open_episode(r: EndpointRollout, eid: str, budget: int = 32, max_calls: int = 8) -> Episode:
    params = SamplingParams(temperature=1.0, max_tokens=budget)
    ep = r.episodes[eid] = Episode(params, max_calls=max_calls)
    return ep


@pytest.mark.anyio
async def test_chat_logprobs_and_token_in_token_out(model):
    r = make(model)

    async def body():
        ep = open_episode(r, "a")
        client = openai.AsyncOpenAI(base_url=f"{r.base_url}/episodes/a/v1", api_key="x",
                                    max_retries=0)
        first = await client.chat.completions.create(model="policy", messages=USER, logprobs=True,
                                                     max_tokens=6)
        c = first.choices[0]
        ids = c.token_ids  # extra fields ride along on the pydantic models
        assert 1 <= len(ids) <= 6 and len(c.logprobs.content) == len(ids)
        assert first.policy_version == r.engine.version
        seg = ep.last[0]
        assert seg.t.ids == ids and seg.prompt == first.prompt_token_ids
        assert [x.logprob for x in c.logprobs.content] == pytest.approx(seg.t.logprobs)
        # the answer sent back unchanged and a new user turn: the same sample goes on
        messages = USER + [{"role": "assistant", "content": c.message.content},
                           {"role": "user", "content": "more"}]
        second = await client.chat.completions.create(model="policy", messages=messages,
                                                      max_tokens=6)
        seg2 = ep.last[0]
        assert ep.branches == 0 and seg2.prompt == seg.prompt
        assert seg2.t.ids[:len(ids)] == ids  # the model's tokens exactly, never re-tokenized
        new = second.choices[0].token_ids
        assert seg2.t.ids[len(seg2.t.ids) - len(new):] == new
        env = len(seg2.t.ids) - len(ids) - len(new)
        assert env > 0 and seg2.t.mask == [1] * len(ids) + [0] * env + [1] * len(new)
        assert second.prompt_token_ids == seg2.prompt + seg2.t.ids[:len(ids) + env]
        # each call's request and response bodies, kept on the model turn it produced
        calls = [t for t in seg2.t.turns if t.role == "assistant"]
        assert [json.loads(t.request)["messages"] for t in calls] == [USER, messages]
        assert [json.loads(t.response) for t in calls] == [first.model_dump(exclude_unset=True),
                                                           second.model_dump(exclude_unset=True)]
        lines = transcript(seg2.t.turns)
        assert lines[1].startswith("  [call] 1 messages, last user: 'say abc' max_tokens=6 -> 1 choices")
        assert "3 messages, last user: 'more' max_tokens=6 -> 1 choices" in lines[4]
        # an edited history does not extend: a new segment on its own prompt
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "other"}], max_tokens=4)
        assert ep.branches == 1 and ep.last[0].t.mask == [1] * len(ep.last[0].t.ids)

    await with_endpoint(r, body)


@pytest.mark.anyio
async def test_tools_streaming_n_and_models(model):
    r = make(model)

    async def body():
        ep = open_episode(r, "b")
        client = openai.AsyncOpenAI(base_url=f"{r.base_url}/episodes/b/v1", api_key="x",
                                    max_retries=0)
        out = await client.chat.completions.create(model="policy", messages=USER, tools=[TOOL],
                                                   n=3, max_tokens=5)
        assert len(out.choices) == 3 and len(ep.last) == 3
        tok = r.tok.tokenizer
        assert "tools lookup" in tok.decode(out.prompt_token_ids)  # rendered by the template
        stream = await client.chat.completions.create(model="policy", messages=USER, stream=True,
                                                      max_tokens=5, logprobs=True)
        text, ids, finish = "", [], None
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.delta.content or ""
                ids += getattr(ch, "token_ids", None) or []
                finish = ch.finish_reason or finish
        assert ids == ep.last[0].t.ids and text == r.tok.decode(ids) and finish in ("stop", "length")
        models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]

    await with_endpoint(r, body)


def test_tool_calls_read_back_with_the_configured_parser():
    text = 'let me see <tool_call>{"name": "lookup", "arguments": {"q": "x"}}</tool_call>'
    message, called = assistant_message(text, Hermes())
    assert called and message["content"] == "let me see"
    assert message["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"q": "x"}'}
    assert assistant_message(text, None) == ({"role": "assistant", "content": text}, False)
    schema = {"type": "function", "function": {"name": "search", "description": "",
              "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
    message, called = assistant_message("hm <search>cats</search>", Xml([schema]))
    assert called and message["content"] == "hm"
    assert message["tool_calls"][0]["function"] == {"name": "search",
                                                    "arguments": '{"query": "cats"}'}


def test_a_forced_call_is_read_back_whatever_the_model_wrote():
    prefix = call_prefix("hermes", "lookup")
    assert prefix == '<tool_call>\n{"name": "lookup", "arguments": '
    got = forced_message('{"q": "x"}}\n', Hermes(), "lookup", prefix)
    assert got["content"] is None
    assert got["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"q": "x"}'}
    # arguments that do not parse are the model's text as written (OpenAI: "may not be valid
    # JSON"), the call object's closing brace left out
    got = forced_message('{"q": x}}', Hermes(), "lookup", prefix)
    assert got["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"q": x}'}
    schema = {"type": "function", "function": {"name": "search", "description": "",
              "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
    got = forced_message("cats</search>", Xml([schema]), "search", call_prefix("xml", "search"))
    assert got["tool_calls"][0]["function"] == {"name": "search",
                                                "arguments": '{"query": "cats"}'}


@pytest.mark.anyio
async def test_tool_choice_named_or_required_opens_the_call_in_the_prompt(model):
    r = make(model)
    other = {"type": "function", "function": {**TOOL["function"], "name": "other"}}

    async def body():
        ep = open_episode(r, "t")
        client = openai.AsyncOpenAI(base_url=f"{r.base_url}/episodes/t/v1", api_key="x",
                                    max_retries=0)
        prefix = call_prefix("hermes", "lookup")
        for choice, tools in (({"type": "function", "function": {"name": "lookup"}},
                               [TOOL, other]), ("required", [TOOL])):
            out = await client.chat.completions.create(
                model="policy", messages=USER, tools=tools, tool_choice=choice, max_tokens=6)
            c = out.choices[0]
            assert c.message.content is None and c.finish_reason in ("stop", "length")
            (call,) = c.message.tool_calls
            assert call.function.name == "lookup" and isinstance(call.function.arguments, str)
            # the call's opening is the prompt's (mask 0), the arguments the model's own
            opening = r.tok.tokenizer.encode(prefix, add_special_tokens=False)
            assert out.prompt_token_ids[-len(opening):] == opening
            seg = ep.last[0]
            assert seg.context == out.prompt_token_ids + c.token_ids
            assert seg.t.mask == [1] * len(c.token_ids)
        with pytest.raises(openai.BadRequestError, match="constrained decoding"):
            await client.chat.completions.create(model="policy", messages=USER,
                                                 tools=[TOOL, other], tool_choice="required")
        with pytest.raises(openai.BadRequestError, match="names no tool"):
            await client.chat.completions.create(
                model="policy", messages=USER, tools=[TOOL],
                tool_choice={"type": "function", "function": {"name": "nope"}})

    await with_endpoint(r, body)


@pytest.mark.anyio
async def test_completions_by_token_ids_continue_the_sample(model):
    r = make(model)

    async def body():
        ep = open_episode(r, "c")
        client = openai.AsyncOpenAI(base_url=f"{r.base_url}/episodes/c/v1", api_key="x",
                                    max_retries=0)
        prompt = r.tok.prompt_ids([ChatMessage("user", "say abc")])
        one = await client.completions.create(model="policy", prompt=prompt, max_tokens=4,
                                              logprobs=1)
        got = one.choices[0].token_ids
        assert len(one.choices[0].logprobs.token_logprobs) == len(got)
        extra = r.tok.tokenizer.encode("\nok", add_special_tokens=False)
        two = await client.completions.create(model="policy", prompt=prompt + got + extra,
                                              max_tokens=4)
        seg = ep.last[0]
        assert seg.prompt == prompt and ep.branches == 0
        assert seg.t.ids == got + extra + two.choices[0].token_ids
        assert seg.t.mask == [1] * len(got) + [0] * len(extra) + [1] * len(two.choices[0].token_ids)

    await with_endpoint(r, body)


@pytest.mark.anyio
async def test_bad_requests_are_400s_and_the_endpoint_goes_on(model):
    r = make(model)

    async def body():
        open_episode(r, "d", max_calls=4)
        client = openai.AsyncOpenAI(base_url=f"{r.base_url}/episodes/d/v1", api_key="x",
                                    max_retries=0)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.chat.completions.create(model="policy", messages=USER, temperature="hot")
        async with httpx.AsyncClient() as raw:
            bad = await raw.post(f"{r.base_url}/episodes/d/v1/chat/completions", content=b"{not json")
            assert bad.status_code == 400 and "bad request body" in bad.json()["error"]["message"]
            gone = await raw.post(f"{r.base_url}/episodes/zz/v1/chat/completions", json={})
            assert gone.status_code == 404
        # a stop string the tiny tokenizer cannot spell ("<" and "_" are no tokens): transformers
        # refuses it, the caller hears a 400, not a 500
        with pytest.raises(openai.BadRequestError, match="engine refuses these settings"):
            await client.chat.completions.create(model="policy", messages=USER, max_tokens=2,
                                                 stop=["</tool_call>"])
        ok = await client.chat.completions.create(model="policy", messages=USER, max_tokens=2)
        assert ok.choices[0].token_ids
        with pytest.raises(openai.BadRequestError, match="max_calls = 4"):
            await client.chat.completions.create(model="policy", messages=USER, max_tokens=2)
        assert r.stats["bad_calls"] == 4  # the 404 is no call of an episode

    await with_endpoint(r, body)


@pytest.mark.anyio
@pytest.mark.parametrize("on_failure", ["zero", "drop"])
async def test_episodes_in_children_rewards_and_failures(model, rollout_file, on_failure):
    r = make(model, rollout_file, max_calls=4, episode_timeout_s=20, on_failure=on_failure)
    kinds = ["ok", "none", "dict", "raise", "many", "branch", "branch_none"]
    prompts = [Prompt(i, [ChatMessage("user", "say abc")], "t", "", extra_info={"kind": k})
               for i, k in enumerate(kinds)]
    params = SamplingParams(temperature=1.0, max_tokens=16)

    async def body():
        ids = [r.prompt_ids(p) for p in prompts]
        groups = await r.generate(prompts, ids, 2, params)
        by = dict(zip(kinds, groups, strict=True))
        # an episode that branched yields one more sample per branch, in the same group: the
        # two "branch" episodes 2 each (the first call's segment, then the summary's), the
        # "many" ones 1 + the calls made on the first prompt again before max_calls
        assert [len(by[k]) for k in ("ok", "none", "dict", "raise")] == [2] * 4
        assert len(by["branch"]) == len(by["branch_none"]) == 4
        assert len(by["many"]) == 2 * 4  # calls 2..4 branch each (the 5th is refused)
        for k, group in by.items():
            for g in group:
                assert len(g.token_ids) == len(g.logprobs) == len(g.loss_mask) == len(g.versions)
                assert g.prompt_ids == ids[0] or k.startswith("branch")
        for g in by["ok"]:  # two calls merged: model tokens, the user turn's, model tokens
            assert g.own.score == float(sum(1 for x in g.turns if x.role == "assistant") and
                                        g.turns[-1].end - g.turns[-1].start)
            assert [x.role for x in g.turns] == ["assistant", "user", "assistant"]
            assert 0 in g.loss_mask.tolist() and not g.own.error
        assert all(g.own is None for g in by["none"])
        assert all(g.own.score == 1.5 and g.own.extra == {"format": 0.5, "answer": 1.0}
                   for g in by["dict"])
        for k, failure in (("raise", "raised"), ("many", "max_calls")):
            for g in by[k]:  # every sample of a failed episode: its failure's reward
                assert g.own.score == 0.0 and bool(g.own.error) == (on_failure == "drop")
            assert [g.turns[-1].failure for g in by[k]] == ([""] * 3 + [failure]) * 2 \
                if k == "many" else [failure] * 2
        for k in ("branch", "branch_none"):
            # each sample on its own prompt: the first call's (the dataset prompt's tokens),
            # then the summary's conversation; each response is its segment's model turn
            first, second = by[k][0], by[k][1]
            assert first.prompt_ids == ids[0] and second.prompt_ids != ids[0]
            assert "summary" in r.tok.tokenizer.decode(second.prompt_ids)  # ":" is no token here
            for g in (first, second):
                assert [x.role for x in g.turns] == ["assistant"]
                assert g.loss_mask.tolist() == [1] * len(g.token_ids)
            # the earlier segment shares its episode's reward: its own, or the scorer's on
            # the episode's last sample (reward_of: that sample's index in the group)
            assert first.reward_of == 1 and second.reward_of is None
            assert by[k][2].reward_of == 3 and by[k][3].reward_of is None
            if k == "branch":
                assert first.own == second.own and first.own.score == float(
                    second.turns[-1].end - second.turns[-1].start)
            else:
                assert first.own is None and second.own is None
        assert r.stats["episodes"] == 14 and r.stats["episode_errors"] == 4
        assert r.stats["branches"] == 2 * 3 + 4

    await with_endpoint(r, body)
    assert TO_SCORER


@pytest.mark.anyio
async def test_an_episode_past_its_timeout_is_killed_and_recorded(model, rollout_file):
    r = make(model, rollout_file, episode_timeout_s=3)
    prompt = Prompt(0, [ChatMessage("user", "say abc")], "t", "", extra_info={"kind": "hang"})

    async def body():
        (group,) = await r.generate([prompt], [r.prompt_ids(prompt)], 1,
                                    SamplingParams(max_tokens=8))
        (g,) = group
        assert g.turns[-1].failure == "timeout" and "rollout.episode_timeout_s" in g.turns[-1].error
        assert g.turns[0].role == "assistant" and g.own.score == 0.0  # its one call is kept
        assert r.stats["episode_timeouts"] == 1

    await with_endpoint(r, body)


@pytest.mark.anyio
async def test_a_call_past_the_budget_is_cut_with_length(model):
    r = make(model)

    async def body():
        ep = open_episode(r, "e", budget=3)
        client = openai.AsyncOpenAI(base_url=f"{r.base_url}/episodes/e/v1", api_key="x",
                                    max_retries=0)
        with pytest.raises(openai.BadRequestError, match="max_tokens: must be at least 1"):
            await client.chat.completions.create(model="policy", messages=USER, max_tokens=0)
        # greedy, so the answer is the same whatever else runs: the budget cuts it
        first = await client.chat.completions.create(model="policy", messages=USER,
                                                     max_tokens=50, temperature=0)
        c = first.choices[0]
        assert len(c.token_ids) <= 3 and (c.finish_reason == "length") == (len(c.token_ids) == 3)
        messages = USER + [{"role": "assistant", "content": c.message.content},
                           {"role": "user", "content": "more"}]
        second = await client.chat.completions.create(model="policy", messages=messages)
        assert ep.branches == 0  # the segment goes on with nothing left of its budget
        assert second.choices[0].token_ids == [] and second.choices[0].finish_reason == "length"
        seg = ep.last[0]
        assert seg.t.mask[:len(c.token_ids)] == [1] * len(c.token_ids) and len(seg.t.ids) <= 3

    await with_endpoint(r, body)


class Gated:
    """A batch engine whose calls wait for ``gate``; it records each call's batch size."""

    continuous = False

    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.sizes: list[int] = []

    async def generate(self, requests):
        self.sizes.append(len(requests))
        await self.gate.wait()
        return [[full_generation(torch.tensor(r.prompt_ids[-1:]), torch.zeros(1), 0, "stop")]
                for r in requests]


@pytest.mark.anyio
async def test_batch_engine_calls_are_gathered_and_a_cancelled_caller_strands_nobody():
    engine = Gated()
    batcher = Batcher(engine)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=4)
    got: dict[int, list[int]] = {}
    first = anyio.CancelScope()

    async def call(k: int) -> None:
        with first if k == 0 else anyio.CancelScope():
            (g,) = await batcher.generate(GenerateRequest([k], params))
            got[k] = g.token_ids.tolist()

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 0)
        await wait_all_tasks_blocked()  # call 0's batch is in the engine
        for k in range(1, 5):  # these arrive while it runs: they wait for the engine
            tg.start_soon(call, k)
        await wait_all_tasks_blocked()
        first.cancel()  # call 0's caller goes; one of the others runs the next batch
        await wait_all_tasks_blocked()
        engine.gate.set()
    assert got == {k: [k] for k in range(1, 5)}
    assert engine.sizes == [1, 4] and not batcher.pending


@pytest.mark.anyio
async def test_a_port_in_use_is_an_error_naming_the_key(model):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = make(model, port=taken.getsockname()[1])
        with pytest.raises(BaseException) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(r.serve)
    leaves, todo = [], [info.value]
    while todo:
        e = todo.pop()
        todo += list(e.exceptions) if isinstance(e, BaseExceptionGroup) else []
        leaves.append(e)
    assert any(isinstance(e, OSError) and "agent.rollout.host / port" in str(e) for e in leaves)


def test_a_body_whose_strings_are_not_utf8_is_a_bad_request():
    """msgspec before 0.23 raises UnicodeDecodeError for such a string, not one of its own
    errors (0.23 raises its DecodeError): either way the agent gets a 400 naming the body, as
    for any other bad body."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    with pytest.raises(BadRequest, match="bad request body: ('utf-8' codec|Invalid UTF-8)"):
        decode_body(body, ChatRequest)
