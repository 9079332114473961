"""Model pools' parts on their own: the config (every bad key named), the judge's parsers and
prompts, batching across concurrent requests, sleep and wake of a torch model on the CPU (the
same scores before and after, the memory freed reported), a judge through a scripted engine
(answers that parse) and through the real tiny model (answers that do not: recorded errors),
and the sampler's combination of the pools' replies."""

from __future__ import annotations

import anyio
import pytest

from actors.runtime.config import ConfigError, apply_overrides, decode_topology
from actors.runtime.config.pools import pool_replica, reward_processes, score_targets
from actors.sandbox.protocol import Outcome
from actors.scoring.batching import Batcher
from actors.scoring.combine import combine
from actors.scoring.items import ScoreItem
from actors.scoring.judge import (
    Judge,
    judge_fields,
    parse_boxed,
    parse_number,
    parse_score_tag,
    parse_yes_no,
)
from actors.scoring.pool import PoolScoring
from actors.scoring.sleep import TorchSleep
from messages.reward import ScoreReply, ScoreResult
from messages.rollout import ChatMessage
from tests.helpers import wait_for
from tests.test_agent import ScriptedEngine
from tests.tiny_model import build_tiny_reward_model


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model")


def topology(*overrides: str):
    return decode_topology(apply_overrides({}, ["sampler.engine=hf", *overrides]))


def pools(*entries: str) -> str:
    return "reward.pools=[" + ", ".join("{" + e + "}" for e in entries) + "]"


def items(n: int = 3) -> list[ScoreItem]:
    prompt = [ChatMessage("system", "be brief"), ChatMessage("user", "what is 2 + 3?")]
    return [ScoreItem("arithmetic", f"it is {i}", "5", prompt=prompt) for i in range(n)]


# ------------------------------------------------------------------------------ config


def test_pool_replicas_follow_the_rule_workers_and_targets_are_chosen_in_one_place(reward_model):
    topo = topology("reward.count=2", pools(f'name="rm", path="{reward_model}", replicas=2',
                                            f'name="judge", kind="judge", path="{reward_model}", '
                                            'replicas=1, weight=0.5'))
    R = topo.reward
    assert reward_processes(R) == 5
    assert [pool_replica(R, i) and (pool_replica(R, i)[0].name, pool_replica(R, i)[1])
            for i in range(-1, 5)] == [None, None, None, ("rm", 0), ("rm", 1), ("judge", 0)]
    assert score_targets(R) == (("reward", 1.0), ("rm", 1.0), ("judge", 0.5))
    only = topology("reward.rules=false", pools(f'name="rm", path="{reward_model}"'))
    assert score_targets(only.reward) == (("rm", 1.0),)
    assert score_targets(topology().reward) == (("reward", 1.0),)  # no pools: as before


@pytest.mark.parametrize(("entry", "key", "why"), [
    ('name="reward", path="{rm}"', "reward.pools[0].name", "rule workers' pool"),
    ('name="a b", path="{rm}"', "reward.pools[0].name", "letters, digits"),
    ('name="x", path="/nonexistent"', "reward.pools[0].path", "not a model directory"),
    ('name="x", path="{rm}", replicas=0', "reward.pools[0].replicas", ">= 1"),
    ('name="x", path="{rm}", device="gpu"', "reward.pools[0].device", "not cpu, cuda"),
    ('name="x", path="{rm}", capacity=0', "reward.pools[0].capacity", ">= 1"),
    ('name="x", path="{rm}", reward_std=0.0', "reward.pools[0].reward_std", "> 0"),
    ('name="x", path="{rm}", sleep_idle_s=-1.0', "reward.pools[0].sleep_idle_s", ">= 0"),
    ('name="x", kind="judge", path="{rm}", template="rate {answer}"',
     "reward.pools[0].template", "unknown field {answer}"),
    ('name="x", kind="judge", path="{rm}", template="rate {response"',
     "reward.pools[0].template", "braces"),
    ('name="x", kind="judge", path="{rm}", template="rate it"', "reward.pools[0].template",
     "names no field"),
    ('name="x", kind="judge", path="{rm}", parser="function"',
     "reward.pools[0].function_path", "no file"),
    ('name="x", kind="judge", path="{rm}", function_path="{rm}/config.json"',
     "reward.pools[0].function_path", "only with parser = function"),
    ('name="x", kind="judge", path="{rm}", engine="vllm", sleep_idle_s=5.0',
     "reward.pools[0].sleep_idle_s", "no sleep mode on a CPU"),
    ('name="x", path="{rm}", parser="regex"', "reward.pools[0].parser", "Invalid enum"),
    ('name="x", path="{rm}", replica=2', "reward.pools[0]", "replica"),
])
def test_every_bad_pool_key_is_named(reward_model, entry, key, why):
    with pytest.raises(ConfigError) as err:
        topology(pools(entry.replace("{rm}", str(reward_model))))
    assert key in str(err.value) and why in str(err.value), str(err.value)


def test_two_pools_of_one_name_and_rules_off_without_pools_are_refused(reward_model):
    with pytest.raises(ConfigError, match=r"reward.pools\[1\].name: 'x' names two pools"):
        topology(pools(f'name="x", path="{reward_model}"', f'name="x", path="{reward_model}"'))
    with pytest.raises(ConfigError, match="reward.rules: false needs at least one"):
        topology("reward.rules=false")


def test_a_bad_pool_key_stops_the_runner_with_exit_2(reward_model, tmp_path):
    import subprocess
    import sys

    from tests.jobs import ROOT

    done = subprocess.run([sys.executable, "runner.py", "check", "topology.toml",
                           pools(f'name="rm", path="{reward_model}", replicas=0')],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "error: bad topology: reward.pools[0].replicas: must be >= 1" in done.stderr


# ------------------------------------------------------------------------------ parsers


def test_parsers_read_the_judges_conventions_and_nothing_else():
    assert parse_number("I would say 7.5 out of 10") == 10.0  # the last number
    assert parse_number("Score:\n\n8") == 8.0 and parse_number("no score") is None
    assert parse_score_tag("Rating: [[6]] (was [[3]])") == 3.0
    assert parse_score_tag("Rating: [[ 6 ]]") == 6.0 and parse_score_tag("Rating: [6]") is None
    assert parse_boxed(r"so \boxed{4} or \boxed{-1.5}") == -1.5 and parse_boxed(r"\boxed{x}") is None
    assert parse_yes_no("Is it right? Yes.") == 1.0 and parse_yes_no("no, not really") == 0.0
    assert parse_yes_no("Nobody knows, yesterday") is None  # whole words only


def test_template_fields_come_from_the_item():
    (item,) = items(1)
    fields = judge_fields(item)
    assert fields["prompt"] == fields["problem"] == "what is 2 + 3?"  # system text left out
    assert fields["response"] == fields["solution"] == "it is 0"
    assert fields["ground_truth"] == "5" and fields["data_source"] == "arithmetic"


# ------------------------------------------------------------------------------ batching


@pytest.mark.anyio
async def test_requests_that_queue_while_a_batch_runs_share_the_next_one():
    calls: list[list[int]] = []
    release = anyio.Event()

    async def run(xs: list[int]) -> list[Outcome]:
        calls.append(list(xs))
        if len(calls) == 1:
            await release.wait()  # the first batch holds the model while others queue
        return [Outcome(score=float(x)) for x in xs]

    batcher = Batcher(run, max_items=5)
    got: dict[int, list[float]] = {}

    async def request(k: int, xs: list[int]) -> None:
        got[k] = [o.score for o in await batcher.score(xs)]

    async with anyio.create_task_group() as tg:
        tg.start_soon(request, 0, [1])
        await wait_for("the first batch running", lambda: bool(calls))
        for k, xs in enumerate(([2, 3], [4, 5], [6], [7, 8]), start=1):
            tg.start_soon(request, k, xs)
            await wait_for(f"request {k} queued", lambda k=k: batcher.statistics().queued == k)
        release.set()
    # the four queued requests went in two batches: whole requests, at most 5 items each
    assert calls == [[1], [2, 3, 4, 5, 6], [7, 8]]
    assert got == {0: [1.0], 1: [2.0, 3.0], 2: [4.0, 5.0], 3: [6.0], 4: [7.0, 8.0]}
    s = batcher.statistics()
    assert (s.batches, s.items, s.largest, s.requests_largest, s.queued) == (3, 8, 5, 3, 0)


# ------------------------------------------------------------------------------ sleep and wake


@pytest.mark.anyio
async def test_a_sleeping_reward_model_frees_its_weights_and_wakes_with_the_same_scores(
        reward_model):
    topo = topology(pools(f'name="rm", path="{reward_model}", sleep_idle_s=0.05'))
    scoring = PoolScoring(topo.reward.pools[0], topo)
    await scoring.load()
    try:
        before = [r.score for r in await scoring.score(items())]
        sleeper = scoring.sleeper
        assert isinstance(sleeper, TorchSleep)
        resident = sleeper.resident_bytes()
        assert resident > 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(scoring.keep_sleeping)
            await wait_for("asleep", lambda: sleeper.asleep, limit_s=10)
            asleep = scoring.status()
            assert sleeper.resident_bytes() == 0  # every parameter's memory given back
            assert all(p.numel() == 0 for p in sleeper.params.values())
            after = [r.score for r in await scoring.score(items())]  # wakes it first
            awake = scoring.status()
            tg.cancel_scope.cancel()
    finally:
        await scoring.aclose()
    assert after == before  # the same weights, read back from the checkpoint
    assert sleeper.resident_bytes() == resident
    assert asleep["asleep"] is True and asleep["sleeps"] == 1
    assert asleep["freed_mb"] == round(resident / 2**20, 2)
    assert awake["asleep"] is False and awake["sleeps"] == 1
    assert awake["wake_ms"] >= 0 and awake["asleep_s"] >= 0  # reported (times: not asserted)
    print(f"freed {asleep['freed_mb']} MiB, woke in {awake['wake_ms']} ms")


def test_waking_from_a_checkpoint_that_lacks_a_weight_is_an_error(reward_model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_model)
    sleeper = TorchSleep(model, tmp_path)  # no safetensors there
    sleeper.sleep()
    with pytest.raises(FileNotFoundError, match="no safetensors files"):
        sleeper.wake()


# ------------------------------------------------------------------------------ judges


class Tok:
    """The scripted engine's tokenizer side (ChatTokenizer's ``tokenizer``)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer


def judge_with(script, tiny_model, *fields: str) -> tuple[Judge, ScriptedEngine]:
    from transformers import AutoTokenizer

    topo = topology(pools(", ".join(['name="j"', 'kind="judge"', f'path="{tiny_model}"',
                                     *fields])))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    engine = ScriptedEngine(Tok(tokenizer), script)
    return Judge(topo.reward.pools[0], engine, tokenizer), engine


@pytest.mark.anyio
async def test_a_judge_reads_the_template_and_its_parsed_answers_are_scores(tiny_model):
    seen: list[str] = []

    def script(context: str) -> str:
        seen.append(context)
        return "rating 8" if "it is 0" in context else "bad 2"  # the tiny vocabulary has no [

    judge, engine = judge_with(script, tiny_model, 'parser="number"', "scale=0.1",
                               'template="q {prompt} a {response} t {ground_truth}"')
    outcomes = await judge.score(items(2))
    assert [round(o.score, 6) for o in outcomes] == [0.8, 0.2] and not any(o.error for o in outcomes)
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 2  # one engine call for the batch
    assert "q what is 2 + 3? a it is 0 t 5" in seen[0]


@pytest.mark.anyio
async def test_an_answer_the_parser_cannot_read_is_a_recorded_error_not_a_zero(tiny_model):
    judge, _ = judge_with(lambda context: "i cannot decide", tiny_model, 'parser="yes_no"')
    outcomes = await judge.score(items(2))
    assert all("parser yes_no read no score in its answer 'i cannot decide'" in o.error
               for o in outcomes)
    assert judge.unreadable == 2 and judge.answers == 2


@pytest.mark.anyio
async def test_a_tiny_random_judge_batches_on_the_real_engine_and_records_what_it_cannot_read(
        tiny_model):
    """The real path: the hf engine generates every answer of a batch in one call; a random
    model writes no ``[[x]]``, so every item is a recorded error (and the result's score 0.0
    with it), never a made-up score."""
    topo = topology(pools(f'name="j", kind="judge", path="{tiny_model}", parser="score_tag", '
                          'max_tokens=6, sleep_idle_s=30.0'))
    scoring = PoolScoring(topo.reward.pools[0], topo)
    await scoring.load()
    try:
        async with anyio.create_task_group() as tg:  # two requests at once: one batch or two
            results: list[list[ScoreResult]] = [[], []]

            async def one(k: int) -> None:
                results[k] = await scoring.score(items(3))

            tg.start_soon(one, 0)
            tg.start_soon(one, 1)
        status = scoring.status()
        stats = scoring.statistics()
        sleeper = scoring.sleeper
        assert sleeper is not None  # an hf judge sleeps as a torch model
        sleeper.sleep()
        assert sleeper.resident_bytes() == 0
        again = await scoring.score(items(1))
    finally:
        await scoring.aclose()
    flat = results[0] + results[1]
    assert all(r.error.startswith("judge j: parser score_tag read no score") and r.score == 0.0
               for r in flat + again)
    assert status["judge_answers"] == 6 and status["judge_unreadable"] == 6
    assert status["batches"] >= 1 and status["batch_items_max"] >= 3
    assert stats.items == 6 and stats.errors == 6
    assert scoring.status()["sleeps"] == 1 and scoring.status()["asleep"] is False


@pytest.mark.anyio
async def test_a_users_parser_runs_in_a_sandboxed_child(tiny_model, tmp_path):
    parser = tmp_path / "parse.py"
    parser.write_text(
        "def parse_score(judge_answer, data_source, solution_str, ground_truth, extra_info):\n"
        "    if 'odd' in judge_answer:\n"
        "        raise ValueError('cannot read ' + judge_answer)\n"
        "    return len(judge_answer) + (ground_truth == '5')\n")
    topo = topology(pools(f'name="j", kind="judge", path="{tiny_model}", parser="function", '
                          f'function_path="{parser}", max_tokens=4'))
    scoring = PoolScoring(topo.reward.pools[0], topo)
    await scoring.load()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        scoring.model.engine = ScriptedEngine(
            Tok(tokenizer), lambda c: "odd one" if "it is 1" in c else "abc")
        results = await scoring.score(items(2))
    finally:
        await scoring.aclose()
    assert results[0].score == 4.0 and not results[0].error  # len("abc") + 1
    assert results[1].error == "judge j: parser function: ValueError: cannot read odd  (answer 'odd ')"  # max_tokens=4 cut it


# ------------------------------------------------------------------------------ combining


def test_the_pools_replies_add_up_by_weight_and_any_failure_fails_the_response():
    rules = ScoreReply([ScoreResult(1.0, answer="5", extra={"acc": 1.0}), ScoreResult(0.0)])
    judge = ScoreReply([ScoreResult(0.8, extra={"judge_raw": 8.0}),
                        ScoreResult(0.0, error="judge j: parser number read no score")])
    both = combine((("reward", 1.0), ("j", 0.5)), [rules, judge])
    assert both.results[0].score == pytest.approx(1.4)
    assert both.results[0].extra == {"reward": 1.0, "reward/acc": 1.0, "j": 0.8,
                                     "j/judge_raw": 8.0}
    assert both.results[0].answer == "5"
    assert both.results[1].score == 0.0
    assert both.results[1].error == "j: judge j: parser number read no score"
    assert combine((("reward", 1.0),), [rules]) is rules  # no pools: the reply as it came


# ------------------------------------------------------------------------------ placement


def test_pool_replicas_are_reward_processes_placed_on_their_gpu(reward_model, tmp_path, sockets):
    """A pool on cuda:1 shares that GPU with the sampler placed there (each gets a memory
    share); a cpu pool and the rule worker see no GPU; a GPU the runner lacks names the key."""
    from tests.test_placement import envs
    from tests.test_placement import topology as placed_topology

    topo = placed_topology(sockets, "sampler.count=2", "sampler.engine=hf", pools(
        f'name="rm", path="{reward_model}", replicas=2, device="cuda:1"',
        f'name="cpu_rm", path="{reward_model}"'))
    got = envs(topo, tmp_path, ["0", "1"])
    for name in ("reward-1", "reward-2"):
        assert got[name] == {"CUDA_VISIBLE_DEVICES": "1", "FLOWRL_DEVICE": "cuda:0",
                             "FLOWRL_GPU_MEMORY_SHARE": "0.30"}  # with sampler-0: 0.9 / 3
    assert got["reward-3"] == got["reward-0"] == {"CUDA_VISIBLE_DEVICES": "", "FLOWRL_DEVICE": "cpu"}
    with pytest.raises(ConfigError, match=r"reward.pools\[0\].device: cuda:1 asked for, but the "
                                          r"runner sees 1 GPU"):
        envs(topo, tmp_path, ["0"])


def test_a_reward_model_pool_needs_a_one_label_classifier(tiny_model):
    with pytest.raises(ConfigError, match=r"reward.pools\[0\].path: .*not a "
                                          r"\.\.\.ForSequenceClassification reward model"):
        topology(pools(f'name="rm", path="{tiny_model}"'))  # a causal LM


# ------------------------------------------------------------------------------ a live replica


@pytest.mark.anyio
async def test_a_live_replica_sleeps_while_idle_and_a_routed_request_wakes_it(reward_model,
                                                                              tmp_path, sockets):
    """A reward-model pool replica (a reward actor after the rule worker) behind the real router:
    idle, it sleeps (its status says so, with the memory freed); the next request through the
    sampler's client wakes it and gets the same scores as before."""
    import msgspec
    import zmq

    from actors.reward import reward_actor
    from actors.router.actor import router_actor
    from actors.runtime.actor import ActorContext, serve_actor
    from actors.runtime.zmq_bridge import make_socket
    from actors.sampler.scoring_client import ScoringClient
    from messages.reward import Response, ScoreRequest
    from tests.helpers import actor_context, live_topology

    topo = live_topology(sockets, "reward.rules=false", pools(
        f'name="rm", path="{reward_model}", sleep_idle_s=0.3, capacity=2'))
    request = ScoreRequest("mine", "5", [Response(t) for t in ("5", "it is 5", "six")],
                           prompt=[ChatMessage("user", "what is 2 + 3?")])
    zctx = zmq.Context()
    replica = ActorContext(kind="reward", index=topo.reward.count, topology=topo,
                           run_dir=tmp_path, zmq=zctx)  # reward-1: the pool's replica 0
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(serve_actor, actor_context("router", topo, zctx, tmp_path),
                           router_actor, None)
            await tg.start(serve_actor, replica, reward_actor, None)
            sock = make_socket(zctx, zmq.DEALER, connect=topo.router.address)
            client = ScoringClient(sock, timeout_s=30, attempts=1, targets=score_targets(topo.reward))
            tg.start_soon(client.serve)
            with anyio.fail_after(30):
                first = await client.score(request)
            await wait_for("the replica asleep", lambda: replica.status.get("asleep") is True,
                           limit_s=20)
            asleep = dict(replica.status)
            with anyio.fail_after(30):
                second = await client.score(request)
            awake = dict(replica.status)
            sock.close(linger=0)
            tg.cancel_scope.cancel()
    finally:
        zctx.destroy(linger=0)
    assert first is not None and second is not None
    assert msgspec.to_builtins(second) == msgspec.to_builtins(first)  # same weights back
    assert [r.error for r in first.results] == ["", "", ""]
    assert asleep["pool"] == "rm" and asleep["sleeps"] >= 1 and asleep["freed_mb"] > 0
    assert awake["asleep"] is False or awake["sleeps"] > asleep["sleeps"]  # woke for it
    assert awake["requests_done"] == 2


def test_the_live_panel_names_a_replicas_pool_and_says_when_it_sleeps():
    from tests.test_liveview import rows, text_of, view_at_step_12

    view = view_at_step_12()
    view.actors = rows(reward_0={"pool": "judge", "asleep": True, "freed_mb": 512.4})
    text, _ = text_of(view, now=253.0)
    line = next(line for line in text.splitlines() if line.split()[:1] == ["reward-0"])
    assert "pool judge  done 96" in line and "asleep (512 MiB freed)" in line


@pytest.mark.anyio
async def test_a_reward_models_concurrent_requests_share_forwards_and_keep_their_scores(
        reward_model):
    """The rule workers' ``reward_model`` function too: requests that come together are
    scored in shared forwards, each getting its own items' scores (as alone, to 1e-5)."""
    from actors.runtime.config import RewardFunction
    from actors.scoring.reward_model import RewardModel

    model = RewardModel(RewardFunction(builtin="reward_model", path=str(reward_model),
                                       batch_size=16))
    model.load()
    requests = [items(3)[:k] for k in (1, 2, 3)]
    alone = [[o.score for o in await model.score(r)] for r in requests]
    calls_before = model._batcher.statistics().batches
    together: list[list[float]] = [[], [], []]

    async def one(k: int) -> None:
        together[k] = [o.score for o in await model.score(requests[k])]

    async with anyio.create_task_group() as tg:
        for k in range(3):
            tg.start_soon(one, k)
    stats = model._batcher.statistics()
    assert stats.batches - calls_before < 3 and stats.requests_largest >= 2  # shared
    for a, b in zip(alone, together, strict=True):
        assert b == pytest.approx(a, abs=1e-5)
