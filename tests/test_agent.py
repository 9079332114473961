"""The agent loop in-process: parsers, rendering, tools in the sandbox, and whole episodes on a
scripted engine (so every token is known) with real tool children.

The engine here writes a fixed text per turn, chosen from the context it is given, and the
tests check the loop's contract on the tokens: the response is exactly the engine's tokens and
the rendered answers in order (nothing re-tokenized), the context of each turn is the prompt
plus everything before it, the loss mask is 0 on exactly the answers, the budget counts every
token, and failures of every kind become answers the model reads.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec
import pytest
import torch

from actors.data.chat import ChatTokenizer
from actors.job.config.load import apply_overrides, decode_topology
from actors.learner.turns import agent_metrics
from actors.runtime.config import ConfigError
from actors.runtime.tensors import to_wire
from actors.sampler.agent.loop import AgentLoop
from actors.sampler.agent.parsers import Hermes, Xml
from actors.sampler.agent.render import Renderer, cut_middle
from actors.sampler.agent.toolbox import argument_problem
from actors.sampler.engines.base import full_generation
from actors.sandbox.tools import calculator, schema_of
from actors.scoring.items import items_of
from actors.scoring.rules import calculator_score
from messages.reward import Response, ScoreRequest
from messages.rollout import ChatMessage, Prompt, Sample, SamplingParams, ScoredGroup
from tests.tiny_model import build_tiny_model

WORDS = ("<tool_call>", "</tool_call>", "{", "}", '"', ":", ",", "*", "/", "_", "(", ")",
         "<lookup>", "</lookup>")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("agent") / "model", words=WORDS)


@pytest.fixture(scope="module")
def tok(model) -> ChatTokenizer:
    return ChatTokenizer(model)


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(textwrap.dedent('''
        import os
        import time


        def lookup(query: str, limit: int = 3) -> str:
            """Look a word up.

            Args:
                query: the word.
                limit: most results.
            """
            if query.startswith("hang"):
                time.sleep(600)
            if query.startswith("crash"):
                os._exit(3)
            if query.startswith("raise"):
                raise KeyError(query)
            return {"word": query, "limit": limit}


        class Counter:
            """An environment: counts to 2, rewarding each step by the number in the action."""

            def __init__(self, start: int = 0) -> None:
                self.n = start

            def reset(self, prompt):
                if prompt["ground_truth"] == "broken":
                    raise RuntimeError("no reset today")
                return "count with me" if prompt["ground_truth"] == "talk" else None

            def step(self, action):
                if "raise" in action:
                    raise ValueError("bad action")
                self.n += 1
                return f"n is {self.n}", float(action.count("1")), self.n >= 2
    '''))
    return str(path)


class ScriptedEngine:
    """Writes ``script(context text)`` for each request: EOS ends a turn, a closing tag is a
    stop string. Log-probs are -0.01 per position, so every token's origin is visible."""

    def __init__(self, tok: ChatTokenizer, script, continuous: bool = False) -> None:
        self.tok, self.script, self.continuous = tok, script, continuous
        self.version = 7
        self.calls: list[list[list[int]]] = []  # the prompt ids of every request, per call

    async def generate(self, requests):
        self.calls.append([list(r.prompt_ids) for r in requests])
        await anyio.lowlevel.checkpoint()
        out = []
        for r in requests:
            text = self.script(self.tok.tokenizer.decode(r.prompt_ids))
            ids = self.tok.tokenizer.encode(text, add_special_tokens=False)
            reason = "length" if len(ids) > r.params.max_tokens else "stop"
            ids = torch.tensor(ids[:r.params.max_tokens])
            lps = -0.01 * torch.arange(1, len(ids) + 1, dtype=torch.float32)
            out.append([full_generation(ids, lps, self.version, reason) for _ in range(r.n)])
        return out

    async def load_weights(self, version, tensors):
        self.version = version

    async def aclose(self):
        pass


def agent_config(*overrides: str):
    return decode_topology(apply_overrides({}, list(overrides))).agent


def prompt(text: str = "what is 12*34", truth: str = "408") -> Prompt:
    return Prompt(0, [ChatMessage("user", text)], "calculator", truth)


async def run_loop(tok, engine, cfg, prompts, n=2, max_tokens=200):
    loop = AgentLoop(engine, tok, cfg)
    await loop.start()
    try:
        ids = [loop.prompt_ids(p) for p in prompts]
        out = await loop.generate(prompts, ids, n, SamplingParams(max_tokens=max_tokens))
        return loop, ids, out
    finally:
        await loop.aclose()


def calls_then_answers(context: str) -> str:
    """One calculator call, then the answer read from the tool's output."""
    if "<|im_start|>tool" not in context:
        return CALL
    return "the answer is " + context.rsplit("tool\n", 1)[1].split("<")[0] + EOS


# -- parsers, schemas, the calculator -------------------------------------------------------------

def test_hermes_parses_calls_and_explains_bad_ones():
    calls = Hermes().parse('hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> and '
                           '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
                           "<tool_call>\n{\"name\": \"h\"}")  # unclosed at the end: read to it
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("f", {"x": 1}, ""), ("g", {"y": 2}, ""), ("h", {}, "")]
    bad = Hermes().parse("<tool_call>{name: f}</tool_call><tool_call>[1]</tool_call>"
                         '<tool_call>{"name": "f", "arguments": 3}</tool_call>')
    assert [c.error.split(" (")[0] for c in bad] == [
        "the tool call is not valid JSON", 'a tool call is a JSON object {"name": "TOOL", '
        '"arguments": {...}}', "the call's arguments must be a JSON object"]
    assert bad[0].arguments_text == "{name: f}" and calls[0].arguments_text == '{"x": 1}'
    assert Hermes().parse("no call here") == []


def test_xml_parser_takes_the_first_parameter():
    schemas = [schema_of(calculator, "calculator"), {"type": "function", "function": {
        "name": "lookup", "description": "d", "parameters": {"properties": {"query": {}}}}}]
    parser = Xml(schemas)
    calls = parser.parse("a<calculator> 1+2 </calculator>b<lookup>cats")
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "1+2"}),
                                                      ("lookup", {"query": "cats"})]
    assert parser.stop == ("</calculator>", "</lookup>")
    assert "<calculator>EXPRESSION</calculator>" in parser.instructions(schemas)


def test_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    assert calculator("(1234 + 5) * 678") == "840042"
    assert calculator("12,345 * 2") == "24690" and calculator("-7 // 2") == "-4"
    assert calculator("10 / 4") == "2.5" and calculator("2 ** -2") == "0.25"
    for bad, error in (("__import__('os')", ValueError), ("9 ** 9 ** 9", ValueError),
                       ("1 / 0", ZeroDivisionError), ("1 +", ValueError)):
        with pytest.raises(error):
            calculator(bad)


def test_schema_from_hints_and_docstring():
    def f(query: str, k: int = 3, tags: list[str] | None = None, mode: str = "a") -> str:
        """Find things.

        Args:
            query: what to look for.
            k (int): how many
                to return.

        Returns:
            text
        """

    fn = schema_of(f, "find")["function"]
    assert fn["name"] == "find" and fn["description"] == "Find things."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for."}
    assert props["k"] == {"type": "integer", "description": "how many to return."}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert fn["parameters"]["required"] == ["query"]
    schema = schema_of(f, "find")
    assert argument_problem({"query": "x"}, schema) == ""
    assert argument_problem({}, schema) == "missing argument(s) query"
    assert argument_problem({"query": "x", "z": 1}, schema).startswith("unknown argument(s) z")
    assert argument_problem({"query": 1}, schema) == "argument query must be a JSON string, not 1"
    assert argument_problem({"query": "x", "k": True}, schema).startswith("argument k must")


def test_calculator_scorer_reads_the_last_turn():
    turns = [{"role": "assistant", "content": CALL},
             {"role": "tool", "content": "408", "name": "calculator", "error": ""},
             {"role": "assistant", "content": "so it is 408."}]
    assert calculator_score("c", "whole transcript 408", "408", {"turns": turns}) == 1.0
    assert calculator_score("c", "x", "408", {"turns": turns[:2]}) == 0.0  # the tool said it
    assert calculator_score("c", "x", "408", {"turns": turns[:2]}, call_score=0.25) == 0.25
    failed = [turns[0], {**turns[1], "error": "boom"}, turns[2]]
    assert calculator_score("c", "x", "408", {"turns": failed}, call_score=0.25) == 1.0
    assert calculator_score("c", "it is 1,408", "1408") == 1.0  # single turn: the reply


# -- rendering ------------------------------------------------------------------------------------

def test_cut_middle():
    assert cut_middle(list(range(5)), 5, [99]) == [0, 1, 2, 3, 4]
    assert cut_middle(list(range(10)), 5, [99]) == [0, 1, 99, 8, 9]
    assert cut_middle(list(range(10)), 1, [99, 98]) == [99]


def test_observations_follow_the_template_without_retemplating(tok):
    r = Renderer(tok, "tool", 8)
    assert (r.after_model, r.after_observation) == ("<|im_end|>\n<|im_start|>tool\n",
                                                   "<|im_end|>\n<|im_start|>assistant\n")
    text = tok.tokenizer.decode
    content, shown = r.content("408")
    eos = tok.eos_token_id
    (after_eos,) = r.observations([content], eos)
    assert text(after_eos) == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    (after_stop,) = r.observations([content], 5)  # the turn ended at a stop string
    assert text(after_stop) == "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    first, second = r.observations([content, r.content("7")[0]], eos)
    assert text(first) + text(second) == (
        "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
    long, shown = r.content("abcdefghijklmnop")
    assert len(long) == 8 and shown == "abc\n<pad>\nop"  # 3 + the marker (3 here) + 2


# -- whole episodes -------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_token_in_token_out(tok):
    cfg = agent_config("agent.tools=[{builtin='calculator'}]")
    engine = ScriptedEngine(tok, calls_then_answers)
    loop, (prompt_ids,), ((a, b),) = await run_loop(tok, engine, cfg, [prompt()])
    assert [len(c) for c in engine.calls] == [2, 2]  # a batch engine: both samples per round
    first, second = engine.calls
    assert first == [prompt_ids, prompt_ids]
    encode = tok.tokenizer.encode
    turn1 = encode(CALL, add_special_tokens=False)
    observation = loop.renderer.observations([loop.renderer.content("408")[0]], turn1[-1])[0]
    turn2 = encode("the answer is 408" + EOS, add_special_tokens=False)
    # the response is the engine's tokens and the rendered answer, exactly, in order
    assert a.token_ids.tolist() == turn1 + observation + turn2
    assert second[0] == prompt_ids + turn1 + observation  # each turn continues the same tokens
    assert a.loss_mask.tolist() == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    lps = a.logprobs.tolist()
    assert lps[len(turn1):len(turn1) + len(observation)] == [0.0] * len(observation)
    assert lps[:2] == pytest.approx([-0.01, -0.02])
    assert set(a.versions.tolist()) == {7} and a.version == 7 and a.finish_reason == "stop"
    spans = [(t.role, t.start, t.end) for t in a.turns]
    k, m = len(turn1), len(turn1) + len(observation)
    assert spans == [("assistant", 0, k), ("tool", k, m), ("assistant", m, m + len(turn2))]
    call = a.turns[1]
    assert (call.name, json.loads(call.arguments), call.content, call.error) == (
        "calculator", {"expression": "12*34"}, "408", "")
    assert call.latency_s > 0 and a.turns[2].content == "the answer is 408"
    assert b.token_ids.tolist() == a.token_ids.tolist()
    assert loop.statistics() == {"tool_calls": 2, "tool_errors": 0, "tool_timeouts": 0,
                                 "tool_crashes": 0}
    # the reward worker's view: the whole transcript, and the turns in extra_info
    text = tok.decode(a.token_ids.tolist())
    request = ScoreRequest("calculator", "408", [Response(text, len(a.token_ids), a.turns)])
    (item,) = items_of(request)
    assert item.extra_info["num_turns"] == 2 and item.extra_info["turns"][1] == {
        "role": "tool", "content": "408", "name": "calculator",
        "arguments": '{"expression": "12*34"}', "error": ""}
    assert calculator_score(item.data_source, item.solution_str, "408", item.extra_info) == 1.0


@pytest.mark.anyio
async def test_the_budget_counts_tool_tokens(tok):
    cfg = agent_config("agent.tools=[{builtin='calculator'}]")
    engine = ScriptedEngine(tok, calls_then_answers)
    turn1 = len(tok.tokenizer.encode(CALL, add_special_tokens=False))
    budget = turn1 + 5  # the answer does not fit
    _, _, ((a,),) = await run_loop(tok, engine, cfg, [prompt()], n=1, max_tokens=budget)
    assert len(a.token_ids) == budget and a.finish_reason == "length"
    assert a.loss_mask.tolist() == [1] * turn1 + [0] * 5  # it ends in tool tokens
    assert [t.role for t in a.turns] == ["assistant", "tool"] and len(engine.calls) == 1
    # a model turn that runs out of budget ends the sample; its call is not run
    _, _, ((b,),) = await run_loop(tok, ScriptedEngine(tok, calls_then_answers), cfg,
                                   [prompt()], n=1, max_tokens=turn1 - 1)
    assert b.finish_reason == "length" and len(b.turns) == 1 and b.loss_mask.all()


@pytest.mark.anyio
async def test_max_turns_leaves_the_last_call_unrun(tok):
    cfg = agent_config("agent.tools=[{builtin='calculator'}]", "agent.max_turns=1")
    engine = ScriptedEngine(tok, calls_then_answers)
    loop, _, ((a,),) = await run_loop(tok, engine, cfg, [prompt()], n=1)
    assert a.finish_reason == "stop" and [t.role for t in a.turns] == ["assistant"]
    assert loop.statistics()["tool_calls"] == 0


BAD_CALLS = {
    "json": ("<tool_call>{oops}</tool_call>", "parse", "the tool call is not valid JSON"),
    "unknown": ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "unknown_tool",
                "unknown tool 'nope'; the tools are calculator, lookup, python"),
    "program_fails": ('<tool_call>{"name": "python", "arguments": {"code": "print(x)"}}'
                      "</tool_call>", "raised",
                      "RuntimeError: exit status 1: NameError: name 'x' is not defined"),
    "arguments": ('<tool_call>{"name": "lookup", "arguments": {"q": "x"}}</tool_call>',
                  "arguments", "lookup: missing argument(s) query"),
    "raises": ('<tool_call>{"name": "lookup", "arguments": {"query": "raise"}}</tool_call>',
               "raised", "KeyError: 'raise'"),
    "divides_by_zero": ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}'
                        "</tool_call>", "raised", "ZeroDivisionError: division by zero"),
    "hangs": ('<tool_call>{"name": "lookup", "arguments": {"query": "hang"}}</tool_call>',
              "timeout", "timed out after 1 s (agent.tool_timeout_s); child killed and replaced"),
    "crashes": ('<tool_call>{"name": "lookup", "arguments": {"query": "crash"}}</tool_call>',
                "crash", "child process exited with status 3 while running; replaced"),
}


@pytest.mark.anyio
async def test_every_kind_of_failure_is_an_answer_the_model_reads(tok, tools_file):
    cfg = agent_config("agent.tools=[{builtin='calculator'}, "
                       f"{{path='{tools_file}', name='lookup'}}, {{builtin='python'}}]",
                       "agent.tool_timeout_s=1", "agent.processes=2")
    bad = {p: call for p, (call, _, _) in BAD_CALLS.items()}

    def script(context: str) -> str:
        if "<|im_start|>tool" in context:
            return "sorry" + EOS
        return bad[context.split("<|im_start|>user\n")[1].split("<")[0]]

    prompts = [prompt(name) for name in BAD_CALLS]
    loop, _, out = await run_loop(tok, ScriptedEngine(tok, script), cfg, prompts, n=1)
    for name, ((g,),) in zip(BAD_CALLS, zip(out, strict=True), strict=True):
        _, failure, error = BAD_CALLS[name]
        assert [t.role for t in g.turns] == ["assistant", "tool", "assistant"], name
        call = g.turns[1]
        assert call.failure == failure and call.error.startswith(error), (name, call.error)
        assert call.content == f"Error: {call.error}"  # what the model reads, in its span:
        read = tok.tokenizer.encode(call.content, add_special_tokens=False)
        span = g.token_ids[call.start:call.end].tolist()
        assert any(span[k:k + len(read)] == read for k in range(len(span))), name
        assert g.turns[2].content == "sorry" and g.finish_reason == "stop"
    stats = loop.statistics()
    assert (stats["tool_calls"], stats["tool_errors"], stats["tool_timeouts"],
            stats["tool_crashes"]) == (8, 8, 1, 1)
    # a tool's value that is not a string comes back as JSON
    cfg = agent_config(f"agent.tools=[{{path='{tools_file}', name='lookup', kwargs={{limit=9}}}}]")
    call = '<tool_call>{"name": "lookup", "arguments": {"query": "cat"}}</tool_call>'
    _, _, ((g,),) = await run_loop(tok, ScriptedEngine(
        tok, lambda c: "ok" + EOS if "tool\n" in c else call), cfg, [prompt()], n=1)
    assert json.loads(g.turns[1].content) == {"word": "cat", "limit": 9}
    # a program that runs: what it printed (in its own interpreter, through the child)
    cfg = agent_config("agent.tools=[{builtin='python'}]")
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    _, _, ((g,),) = await run_loop(tok, ScriptedEngine(
        tok, lambda c: "ok" + EOS if "tool\n" in c else call), cfg, [prompt()], n=1)
    assert (g.turns[1].content, g.turns[1].error) == ("42\n", "")


@pytest.mark.anyio
async def test_a_continuous_engine_never_waits_for_another_samples_tool(tok, tools_file):
    cfg = agent_config(f"agent.tools=[{{path='{tools_file}', name='lookup'}}]",
                       "agent.tool_timeout_s=2", "agent.processes=3")

    def script(context: str) -> str:
        if "<|im_start|>tool" in context:
            return "done" + EOS
        word = context.split("<|im_start|>user\n")[1].split("<")[0]
        return f'<tool_call>{{"name": "lookup", "arguments": {{"query": "{word}"}}}}</tool_call>'

    prompts = [prompt("hang"), prompt("cat"), prompt("dog")]
    for continuous in (True, False):
        engine = ScriptedEngine(tok, script, continuous=continuous)
        _, _, out = await run_loop(tok, engine, cfg, prompts, n=1)
        assert [len(g[0].turns) for g in out] == [3, 3, 3]
        assert out[0][0].turns[1].failure == "timeout"
        texts = [[tok.tokenizer.decode(ids) for ids in call] for call in engine.calls]
        second = [i for i, call in enumerate(texts) for t in call if "<|im_start|>tool" in t]
        if continuous:  # every request alone; the hanging sample's second turn comes last
            assert [len(c) for c in texts] == [1] * 6 and second == [3, 4, 5]
            assert "user\nhang" in texts[5][0]
        else:  # rounds: the batch waits for the slow tool, then goes on together
            assert [len(c) for c in engine.calls] == [3, 3]


@pytest.mark.anyio
async def test_environment_episodes(tok, tools_file):
    def script(context: str) -> str:
        if "user\nraise" in context and "bad action" not in context:  # raise once
            return "raise" + EOS
        return "1 1" + EOS

    base = [f"agent.env.path={tools_file}", "agent.env.name=Counter", "agent.processes=2"]
    cfg = agent_config(*base, "agent.env.kwargs={start=0}")
    prompts = [prompt("go", "x"), prompt("talk", "talk"), prompt("broken", "broken"),
               prompt("raise", "x")]
    loop, _, out = await run_loop(tok, ScriptedEngine(tok, script), cfg, prompts, n=1)
    (plain,), (talk,), (broken,), (raising,) = out
    assert [t.role for t in plain.turns] == ["assistant", "user", "assistant", "user"]
    assert [t.reward for t in plain.turns] == [2.0, None, 2.0, None] and plain.env_reward == 4.0
    assert plain.turns[1].content == "n is 1" and plain.turns[3].content == "n is 2"
    assert plain.turns[3].start == plain.turns[3].end == len(plain.token_ids)  # never read
    # a first observation comes after an empty model turn, as tokens the model did not write
    assert [t.role for t in talk.turns] == ["user"] + ["assistant", "user"] * 2
    assert talk.turns[0].start == 0 and talk.turns[0].content == "count with me"
    assert talk.loss_mask[:talk.turns[0].end].tolist() == [0] * talk.turns[0].end
    # a reset that fails: recorded, and the model answers once without its environment
    assert [t.role for t in broken.turns] == ["user", "assistant"]
    assert broken.turns[0].error == "RuntimeError: no reset today" and broken.env_reward == 0.0
    # a step that raises is an answer; the episode goes on
    assert raising.turns[1].error == "ValueError: bad action" and raising.turns[1].failure == "raised"
    assert [t.role for t in raising.turns] == ["assistant", "user"] * 3
    assert raising.env_reward == 4.0  # two steps of "1 1" after the failed one
    assert loop.statistics() == {"env_steps": 7, "env_errors": 1}
    # the learner's metrics count every step (the last one too) and no reset
    samples = [Sample(to_wire(g.token_ids), to_wire(g.logprobs), g.version, "", g.finish_reason,
                      turns=g.turns) for (g,) in out]
    m = agent_metrics([ScoredGroup(prompts[0], to_wire(torch.tensor([1], dtype=torch.int32)),
                                   samples, "s")])
    assert (m["agent/tool_calls"], m["agent/tool_errors"]) == (7.0, 1.0)
    assert m["agent/num_turns/max"] == 3.0 and m["agent/tool_call_share"] == 0.75
    assert not loop.env_reward_only
    assert agent_config(*base, "agent.env.reward=replace").env.reward == "replace"


def test_agent_config_errors_name_the_key(tools_file):
    cases = [
        ("agent.max_turns=0", "agent.max_turns: must be >= 1"),
        ("agent.tools=[{}]", "agent.tools[0]: set either builtin or path"),
        ("agent.tools=[{builtin='abacus'}]", "agent.tools[0].builtin: 'abacus' is not one of"),
        ("agent.tools=[{path='/no/such.py', name='f'}]", "agent.tools[0].path: no file"),
        (f"agent.tools=[{{path='{tools_file}'}}]", "agent.tools[0].name: must name"),
        ("agent.tools=[{builtin='python'}, {builtin='python'}]",
         "agent.tools[1].name: 'python' is already the name of agent.tools[0]"),
        ("agent.parser=json", "agent.parser: Invalid enum value 'json'"),
        ("agent.tool_timeout_s=0", "agent.tool_timeout_s: must be > 0"),
        ("agent.toools=[]", "agent.toools: unknown key"),
        (f"agent.env.path={tools_file}", "agent.env.name: must name the environment's class"),
    ]
    for override, message in cases:
        with pytest.raises(ConfigError) as info:
            decode_topology(apply_overrides({}, [override]))
        assert message in str(info.value), (override, str(info.value))
    both = ["agent.tools=[{builtin='python'}]", f"agent.env.path={tools_file}",
            "agent.env.name=Counter"]
    with pytest.raises(ConfigError, match="agent.env.path: an environment replaces tools"):
        decode_topology(apply_overrides({}, both))


@pytest.mark.anyio
async def test_a_tool_that_does_not_load_stops_the_sampler_at_start(tok, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module\n")
    cfg = agent_config(f"agent.tools=[{{path='{broken}', name='f'}}]")
    loop = AgentLoop(ScriptedEngine(tok, lambda c: EOS), tok, cfg)
    with pytest.raises(RuntimeError, match=r"agent.tools\[0\] \(f\): .*No module named"):
        await loop.start()
    assert loop.tools is not None and not loop.tools.children.statistics().children  # all gone


def test_old_samples_decode_without_turns():
    from tests.helpers import multi_turn_group, sample_tensor

    old = msgspec.msgpack.encode([sample_tensor(), sample_tensor("float32", (0.0, 0.0, 0.0)), 1,
                                  "t", "stop"])  # an array_like Sample from before turns
    assert msgspec.msgpack.decode(old, type=Sample).turns == []
    group = multi_turn_group()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(group), type=type(group)) == group


def test_the_hf_engine_ends_at_a_stop_string_when_padding_is_eos(model):
    from actors.sampler.engines.hf import HFEngine

    engine = HFEngine(model, "float32", seed=0)
    tok = engine.tokenizer
    tok.pad_token = tok.eos_token  # as in SmolLM2: what follows a stopped row is EOS padding
    ids = tok.encode("ab</lookup>", add_special_tokens=False)
    eos = tok.eos_token_id
    assert engine._length(torch.tensor(ids + [eos, eos]), ("</lookup>",)) == (len(ids), "stop")
    assert engine._length(torch.tensor(ids + [eos, eos]), ()) == (len(ids) + 1, "stop")
    assert engine._length(torch.tensor(ids), ("zz",)) == (len(ids), "length")


def test_python_tool_runs_a_new_interpreter_each_call():
    from actors.sandbox.tools import python

    assert python("x = 3\nprint(x * 2)") == "6\n"
    with pytest.raises(RuntimeError, match="^exit status 1: NameError: name 'x' is not defined$"):
        python("print(x)")
    with pytest.raises(TimeoutError, match="more than 0.5 s"):
        python("while True: pass", timeout_s=0.5)


@pytest.mark.anyio
async def test_environment_rewards_replace_or_add_to_the_scorers(tok):
    from types import SimpleNamespace

    from actors.sampler.agent.loop import AgentGeneration
    from actors.sampler.rollout import Generated, Rollout
    from messages.reward import ScoreReply, ScoreResult
    from messages.rollout import Turn

    ids = torch.tensor([5, 6, 7], dtype=torch.int32)
    gen = AgentGeneration(ids, torch.zeros(3), torch.zeros(3, dtype=torch.int32),
                          torch.tensor([1, 0, 1], dtype=torch.int8), "stop", 0,
                          turns=[Turn("assistant", 0, 1, reward=2.5), Turn("user", 1, 2),
                                 Turn("assistant", 2, 3)], env_reward=2.5)
    done = Generated(prompt(), [1, 2], [gen, gen], None, 0.1)

    class Scoring:
        attempts, timeout_s = 1, 1.0

        def __init__(self, results):
            self.results, self.requests = results, []

        async def score(self, request):
            self.requests.append(request)
            return ScoreReply(self.results)

    def rollout(scoring, replace_only: bool) -> Rollout:
        agent = SimpleNamespace(env_reward_only=replace_only)
        return Rollout(None, tok, scoring, params=SamplingParams(), n=2, greedy_baseline=False,
                       sampler="s", agent=agent)

    unused = Scoring([])
    group = await rollout(unused, True).score_group(done)  # replace: no scoring request at all
    assert [s.reward for s in group.samples] == [2.5, 2.5] and not unused.requests
    assert group.samples[0].turns == gen.turns and group.samples[0].loss_mask is not None
    scoring = Scoring([ScoreResult(1.0), ScoreResult(0.0, error="boom")])
    group = await rollout(scoring, False).score_group(done)  # add: the scorer's plus the env's
    assert [s.reward for s in group.samples] == [3.5, 0.0]  # a failed scoring stays 0
    assert scoring.requests[0].responses[0].turns == gen.turns
