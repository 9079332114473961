"""A served model's replica scoring (``ServedScoring``): batching across concurrent requests,
sleep and wake of a torch model on the CPU (the same scores before and after, the memory freed
reported; also live, behind the real router), a judge through a scripted engine (answers that
parse) and through the real tiny model (answers that do not: recorded errors), a user's parser
in a sandboxed child, and the live panel's row."""

from __future__ import annotations

import anyio
import pytest
import torch

from actors.runtime.config import score_targets
from actors.sandbox.protocol import Outcome
from actors.scoring.batching import Batcher
from actors.scoring.items import items_of
from actors.scoring.judge import Judge
from actors.scoring.served import ServedScoring
from actors.scoring.sleep import TorchSleep
from messages.reward import ScoreResult
from messages.rollout import ChatMessage
from tests.helpers import wait_for
from tests.test_agent import ScriptedEngine
from tests.test_pools import items, models, topology
from tests.tiny_model import build_tiny_reward_model


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model")


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
    topo = topology(models(f'kind="reward_model", name="rm", path="{reward_model}", '
                           'sleep_idle_s=0.05'))
    scoring = ServedScoring(topo.reward.models[0], topo)
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

    topo = topology(models(", ".join(['name="j"', 'kind="judge"', f'path="{tiny_model}"',
                                      *fields])))
    judge = Judge(topo.reward.models[0], topo)
    judge.tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    judge.engine = ScriptedEngine(Tok(judge.tokenizer), script)
    return judge, judge.engine


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


def judge_logits(scoring: ServedScoring) -> torch.Tensor:
    """The judge model's logits on one fixed input (its weights, seen through a forward)."""
    with torch.no_grad():
        return scoring.model.module(input_ids=torch.tensor([[3, 4, 5, 6]])).logits


@pytest.mark.anyio
async def test_a_tiny_random_judge_batches_on_the_real_engine_and_records_what_it_cannot_read(
        tiny_model):
    """The real path: the hf engine generates every answer of a batch in one call; a random
    model writes no ``[[x]]``, so every item is a recorded error (and the result's score 0.0
    with it), never a made-up score."""
    topo = topology(models(f'name="j", kind="judge", path="{tiny_model}", parser="score_tag", '
                           'max_tokens=6, sleep_idle_s=30.0'))
    scoring = ServedScoring(topo.reward.models[0], topo)
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
        logits_before = judge_logits(scoring)
        sleeper.sleep()
        assert sleeper.resident_bytes() == 0
        again = await scoring.score(items(1))  # wakes it
        assert torch.equal(judge_logits(scoring), logits_before)  # the same weights back
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
    topo = topology(models(f'name="j", kind="judge", path="{tiny_model}", parser="function", '
                           f'function_path="{parser}", max_tokens=4'))
    scoring = ServedScoring(topo.reward.models[0], topo)
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


# ------------------------------------------------------------------------------ a live replica


@pytest.mark.anyio
async def test_a_live_replica_sleeps_while_idle_and_a_routed_request_wakes_it(reward_model,
                                                                              tmp_path, sockets):
    """A reward model's replica (a reward actor after the rule worker) behind the real router:
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

    topo = live_topology(sockets, "reward.rules=false", models(
        f'kind="reward_model", name="rm", path="{reward_model}", sleep_idle_s=0.3, capacity=2'))
    request = ScoreRequest("mine", "5", [Response(t) for t in ("5", "it is 5", "six")],
                           prompt=[ChatMessage("user", "what is 2 + 3?")])
    zctx = zmq.Context()
    replica = ActorContext(kind="reward", index=topo.reward.count, topology=topo,
                           run_dir=tmp_path, zmq=zctx)  # reward-1: the model's replica 0
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
    """Requests that come together are scored in shared forwards, each getting its own items'
    scores (as alone, to 1e-5)."""
    topo = topology(models(f'kind="reward_model", name="rm", path="{reward_model}", '
                           'batch_size=16'))
    scoring = ServedScoring(topo.reward.models[0], topo)
    await scoring.load()
    requests = [items(3)[:k] for k in (1, 2, 3)]
    try:
        alone = [[r.score for r in await scoring.score(rs)] for rs in requests]
        calls_before = scoring.batcher.statistics().batches
        together: list[list[float]] = [[], [], []]

        async def one(k: int) -> None:
            together[k] = [r.score for r in await scoring.score(requests[k])]

        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(one, k)
    finally:
        await scoring.aclose()
    stats = scoring.batcher.statistics()
    assert stats.batches - calls_before < 3 and stats.requests_largest >= 2  # shared
    for a, b in zip(alone, together, strict=True):
        assert b == pytest.approx(a, abs=1e-5)


@pytest.mark.anyio
async def test_offline_tools_score_with_the_jobs_models_as_the_sampler_adds_them(reward_model):
    """``runner.py validate`` and ``rerun --rescore``'s live path (``LocalScoring``): the rule
    workers' score plus each served model's, weighted, in this process."""
    from actors.offline.live_path import LocalScoring
    from messages.reward import Response, ScoreRequest

    topo = topology("task.name=arithmetic", models(f'kind="reward_model", name="rm", '
                                                   f'path="{reward_model}", weight=0.5'))
    request = ScoreRequest("arithmetic", "5", [Response("5"), Response("7")],
                           prompt=[ChatMessage("user", "what is 2 + 3?")])
    local = LocalScoring(topo)
    alone = ServedScoring(topo.reward.models[0], topo)
    await local.load()
    await alone.load()
    try:
        reply = await local.score(request)
        rm = [r.score for r in await alone.score(items_of(request))]
    finally:
        await local.aclose()
        await alone.aclose()
    assert [r.extra["reward"] for r in reply.results] == [1.0, 0.0]  # the arithmetic rule
    assert [r.extra["rm"] for r in reply.results] == pytest.approx(rm, abs=1e-6)
    assert [r.score for r in reply.results] == pytest.approx([1.0 + 0.5 * rm[0], 0.5 * rm[1]])
