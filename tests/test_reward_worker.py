"""A live router and reward worker (in this process, on trio, over real ipc sockets) with a
user's scoring function that hangs on one response: the reply still comes, with that response's
error and the others scored, and the worker serves the next request; a stopped worker says bye,
answers what it has and leaves the router's status."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest
import zmq

from actors.reward import reward_actor
from actors.router.actor import router_actor
from actors.runtime.actor import ActorContext, serve_actor
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from messages.codec import Codec
from messages.reward import ScoreReply, ToScoringClient
from messages.routing import Envelope, ToClient
from tests.helpers import actor_context, live_topology, routed, score_request, wait_for

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


async def reply_to(client: AsyncSocket, request_id: int) -> ScoreReply:
    """The next reply on ``client``: an envelope with ``request_id``, then a ``ScoreReply`` body."""
    envelope_frame, body = await client.recv_multipart()
    envelope = Codec(ToClient).decode(envelope_frame)
    assert envelope == Envelope(request_id)
    reply = Codec(ToScoringClient).decode(body)
    assert isinstance(reply, ScoreReply)
    return reply


def worker_entry(router_ctx: ActorContext, name: str = "reward-0") -> dict:
    return router_ctx.status.get(f"worker/{name}", {})


@pytest.mark.anyio
async def test_a_hanging_user_function_costs_one_response_not_the_worker(tmp_path, sockets):
    topo, zctx, reward_ctx, router_ctx = router_and_worker(
        tmp_path, sockets, USER_FUNCTION, "reward.timeout_s=1.0", "reward.processes=2")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(serve_actor, router_ctx, router_actor, None)
            await tg.start(serve_actor, reward_ctx, reward_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client:
                await client.send_multipart(routed(1, score_request(
                    "4", "hang", "5", "4", data_source="mine", ground_truth="4")))
                reply = await reply_to(client, 1)
                assert [r.score for r in reply.results] == [1.0, 0.0, 0.0, 1.0]
                assert "timed out after 1 s" in reply.results[1].error
                assert [r.error for r in reply.results[::2]] == ["", ""]
                assert reply.results[2].extra == {"chars": 1.0}

                await client.send_multipart(routed(2, score_request(
                    "7", "x", data_source="mine", ground_truth="7")))
                reply = await reply_to(client, 2)
                assert [(r.score, r.error) for r in reply.results] == [(1.0, ""), (0.0, "")]
            status = reward_ctx.status
            assert (status["requests_done"], status["items_scored"]) == (2, 6)
            assert (status["score_errors"], status["score_timeouts"], status["score_crashes"]) == (1, 1, 0)
            # the router's per-worker figures follow on its status timer
            await wait_for("two requests done", lambda: worker_entry(router_ctx).get("done") == 2)
            entry = worker_entry(router_ctx)
            assert (entry["pool"], entry["in_flight"], entry["failed"], entry["leaving"]) == \
                ("reward", 0, 0, False)
            assert entry["capacity"] == topo.reward.capacity
            assert entry["p99_ms"] >= entry["p50_ms"] >= 1000.0  # the first waited for the timeout
            assert router_ctx.status["workers"] == 1  # heartbeats kept it registered throughout
            assert (router_ctx.status["answered"], router_ctx.status["resent"]) == (2, 0)
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


SLOW_FUNCTION = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(float(solution_str))
    return 1.0
'''


@contextlib.asynccontextmanager
async def request_at_the_worker(zctx, topo, router_ctx) -> AsyncIterator[AsyncSocket]:
    """A client whose request 5 (1.5 s of SLOW_FUNCTION's scoring) the router says is at the
    worker."""
    with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client:
        await client.send_multipart(routed(5, score_request(
            "1.5", data_source="mine", ground_truth="x")))
        await wait_for("in flight at the worker",
                       lambda: worker_entry(router_ctx).get("in_flight") == 1)
        yield client


@pytest.mark.anyio
async def test_a_stopped_worker_says_bye_and_answers_what_it_has(tmp_path, sockets):
    topo, zctx, reward_ctx, router_ctx = router_and_worker(
        tmp_path, sockets, SLOW_FUNCTION, "reward.timeout_s=5.0", "reward.processes=1")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(serve_actor, router_ctx, router_actor, None)
            async with anyio.create_task_group() as worker:
                await worker.start(serve_actor, reward_ctx, reward_actor, None)
                async with request_at_the_worker(zctx, topo, router_ctx) as client:
                    worker.cancel_scope.cancel()  # as SIGTERM: bye, then the reply, then gone
                    reply = await reply_to(client, 5)
                    assert [r.score for r in reply.results] == [1.0]
            assert reward_ctx.status["requests_done"] == 1
            # the router drops the worker once its last reply is in (its status on the next tick)
            await wait_for("worker gone", lambda: router_ctx.status.get("workers") == 0
                           and "reward-0" not in router_ctx.status)
            assert router_ctx.status["resent"] == 0 and router_ctx.status["answered"] == 1
            assert "waiting" not in router_ctx.status
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_a_worker_stopped_with_the_router_gone_leaves_once_it_has_answered(tmp_path, sockets):
    """A job's stop reaches the router and its workers at once: the router never acks the bye of
    a worker with a request in flight, which leaves once it has answered, not after drain_s (35 s
    here: reward.timeout_s + 5)."""
    topo, zctx, reward_ctx, router_ctx = router_and_worker(
        tmp_path, sockets, SLOW_FUNCTION, "reward.timeout_s=30.0", "reward.processes=1")
    with anyio.fail_after(25):
        async with anyio.create_task_group() as worker:
            async with anyio.create_task_group() as router:
                await router.start(serve_actor, router_ctx, router_actor, None)
                await worker.start(serve_actor, reward_ctx, reward_actor, None)
                async with request_at_the_worker(zctx, topo, router_ctx):
                    pass
                router.cancel_scope.cancel()  # the router is gone before the worker stops
            with anyio.fail_after(12):  # answered in 1.5 s, then one BYE_ACK_WAIT_S
                worker.cancel_scope.cancel()
                await anyio.sleep_forever()
    assert reward_ctx.status["requests_done"] == 1
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_a_drain_ends_when_requests_that_overlap_it_are_answered(tmp_path, sockets):
    """A request taken while the drain waits for an earlier one (sent before the router's ack)
    ends the same busy spell: the drain returns when both are answered."""
    from actors.router.worker import PoolWorker

    class Held(PoolWorker):  # answers request k when go[k] is set
        go = {b"1": anyio.Event(), b"2": anyio.Event()}

        async def reply(self, body: bytes) -> bytes:
            await self.go[body].wait()
            return body

    topo = live_topology(sockets)
    zctx = zmq.Context()
    ctx = actor_context("reward", topo, zctx, tmp_path)
    with make_socket(zctx, zmq.ROUTER, bind=f"ipc://{sockets}/w") as router, \
            make_socket(zctx, zmq.DEALER, identity=b"reward-0", connect=f"ipc://{sockets}/w") as sock:
        held = Held(ctx, sock, "reward", capacity=2, drain_s=60.0)
        held.acked.set()  # the router's ack came: only what is in flight is left
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(held.handle, Envelope(1), b"1")
                await wait_for("one in flight", lambda: held.in_flight == 1)
                drained = anyio.Event()

                async def drain() -> None:
                    await held.drain()
                    drained.set()

                tg.start_soon(drain)
                await wait_for("the bye sent", lambda: ctx.status.get("state") == "leaving")
                tg.start_soon(held.handle, Envelope(2), b"2")
                await wait_for("two in flight", lambda: held.in_flight == 2)
                Held.go[b"1"].set()
                await wait_for("one answered", lambda: held.in_flight == 1)
                assert not drained.is_set()
                Held.go[b"2"].set()
                await drained.wait()
        assert held.in_flight == 0 and len([await router.recv_multipart() for _ in range(3)]) == 3
    zctx.destroy(linger=0)
