"""A live router and reward worker (in this process, on trio, over real ipc sockets) with a
user's scoring function that hangs on one item: the reply still comes, with that item's error
and the others scored, and the worker serves the next request."""

from __future__ import annotations

import anyio
import pytest
import zmq

from actors.reward import reward_actor
from actors.router import router_actor
from actors.runtime.actor import serve_actor
from actors.runtime.zmq_bridge import make_socket
from messages.codec import Codec, encode
from messages.reward import ScoreItem, ScoreReply, ScoreRequest, ToClient
from tests.helpers import actor_context, live_topology

USER_FUNCTION = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(3600)
    return {"score": float(solution_str == ground_truth), "chars": len(solution_str)}
'''


def router_and_worker(tmp_path, sockets: str, source: str, *overrides: str):
    """A topology on ``sockets`` whose reward function is ``source``, and both actors' contexts."""
    scorer = tmp_path / "scorer.py"
    scorer.write_text(source)
    topo = live_topology(sockets, f'reward.functions=[{{path="{scorer}"}}]', *overrides)
    zctx = zmq.Context()
    return (topo, zctx, actor_context("reward", topo, zctx, tmp_path),
            actor_context("router", topo, zctx, tmp_path))


@pytest.mark.anyio
async def test_a_hanging_user_function_costs_one_item_not_the_worker(tmp_path, sockets):
    topo, zctx, reward_ctx, router_ctx = router_and_worker(
        tmp_path, sockets, USER_FUNCTION, "reward.timeout_s=1.0", "reward.processes=2")
    codec = Codec(ToClient)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_actor, router_ctx, router_actor, None)
            tg.start_soon(serve_actor, reward_ctx, reward_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client:
                items = [ScoreItem("mine", "4", "4"), ScoreItem("mine", "hang", "4"),
                         ScoreItem("mine", "5", "4"), ScoreItem("mine", "4", "4")]
                await client.send_multipart([encode(ScoreRequest(request_id=1, items=items))])
                reply = codec.decode((await client.recv_multipart())[-1])
                assert isinstance(reply, ScoreReply) and reply.request_id == 1
                assert [r.score for r in reply.results] == [1.0, 0.0, 0.0, 1.0]
                assert "timed out after 1 s" in reply.results[1].error
                assert [r.error for r in reply.results[::2]] == ["", ""]
                assert reply.results[2].extra == {"chars": 1.0}

                await client.send_multipart([encode(ScoreRequest(
                    request_id=2, items=[ScoreItem("mine", "7", "7"), ScoreItem("mine", "x", "7")]))])
                reply = codec.decode((await client.recv_multipart())[-1])
                assert isinstance(reply, ScoreReply) and reply.request_id == 2
                assert [(r.score, r.error) for r in reply.results] == [(1.0, ""), (0.0, "")]
            status = reward_ctx.status
            assert (status["requests_done"], status["items_scored"]) == (2, 6)
            assert (status["score_errors"], status["score_timeouts"], status["score_crashes"]) == (1, 1, 0)
            assert router_ctx.status["workers"] == 1  # heartbeats kept it registered throughout
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


SLOW_FUNCTION = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(float(solution_str))
    return 1.0
'''


@pytest.mark.anyio
async def test_a_stopped_worker_says_bye_and_answers_what_it_has(tmp_path, sockets):
    topo, zctx, reward_ctx, router_ctx = router_and_worker(
        tmp_path, sockets, SLOW_FUNCTION, "reward.timeout_s=5.0", "reward.processes=1")
    codec = Codec(ToClient)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_actor, router_ctx, router_actor, None)
            async with anyio.create_task_group() as worker:
                worker.start_soon(serve_actor, reward_ctx, reward_actor, None)
                with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client:
                    await client.send_multipart([encode(ScoreRequest(
                        request_id=5, items=[ScoreItem("mine", "1.5", "x")]))])
                    while reward_ctx.status.get("requests_in_flight") != 1:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                    worker.cancel_scope.cancel()  # as SIGTERM: bye, then the reply, then gone
                    reply = codec.decode((await client.recv_multipart())[-1])
                    assert isinstance(reply, ScoreReply) and reply.request_id == 5
                    assert [r.score for r in reply.results] == [1.0]
            assert reward_ctx.status["requests_done"] == 1
            await anyio.sleep(0.3)  # the router's status follows on its next dispatch
            assert router_ctx.status["resent"] == 0 and router_ctx.status["workers"] == 0
            assert "reward-0" not in router_ctx.status
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)
