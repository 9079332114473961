"""Live actors (in this process, on trio, over real ipc sockets) survive malformed frames.

Each bad frame is answered with an error message or dropped and counted, and the actor goes on
serving the next valid request.
"""

from __future__ import annotations

import anyio
import msgspec
import pytest
import zmq

from actors.replay import replay_actor
from actors.reward import reward_actor
from actors.router import router_actor
from actors.runtime.actor import serve_actor
from actors.runtime.zmq_bridge import make_socket
from messages.codec import Codec, encode
from messages.control import ErrorReply
from messages.reward import (
    RouterError,
    ScoreItem,
    ScoreReply,
    ScoreRequest,
    ScoreResult,
    ToClient,
    ToWorker,
    WorkerHeartbeat,
    WorkerHello,
)
from messages.rollout import FromReplay, PromptBatch, PromptRequest
from tests.helpers import actor_context, live_topology

BAD_FRAMES = [b"", b"\xc1", encode(PromptRequest(4))[:-2], encode({"type": "Nope"}),
              encode({"type": "ScoreRequest", "request_id": "x", "items": []}), b"\x00" * 10_000]


@pytest.mark.anyio
async def test_replay_answers_bad_frames_and_keeps_serving(sockets):
    topo = live_topology(sockets)
    zctx = zmq.Context()
    ctx = actor_context("replay", topo, zctx)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_actor, ctx, replay_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.replay.address) as sock:
                replies = Codec(ErrorReply)
                for frame in BAD_FRAMES:
                    await sock.send_multipart([frame])
                    error = replies.decode((await sock.recv_multipart())[-1])
                    assert error.error.startswith("replay:")
                await sock.send_multipart([encode(PromptRequest(2, "me"))])
                batch = Codec(FromReplay).decode((await sock.recv_multipart())[-1])
                assert isinstance(batch, PromptBatch) and len(batch.prompts) == 2
            while ctx.status.get("rejected_frames") != len(BAD_FRAMES):  # noqa: ASYNC110 - status is a plain dict
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_router_and_reward_worker_survive_bad_frames(sockets):
    topo = live_topology(sockets)
    zctx = zmq.Context()
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            router_ctx = actor_context("router", topo, zctx)
            tg.start_soon(serve_actor, router_ctx, router_actor, None)
            tg.start_soon(serve_actor, actor_context("reward", topo, zctx), reward_actor, None)
            client_codec = Codec(ToClient)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client, \
                 make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address) as fake_worker:
                for frame in BAD_FRAMES:
                    await client.send_multipart([frame])
                    assert isinstance(client_codec.decode((await client.recv_multipart())[-1]),
                                      RouterError)
                    await fake_worker.send_multipart([frame])
                    assert isinstance(Codec(RouterError).decode((await fake_worker.recv_multipart())[-1]),
                                      RouterError)
                items = [ScoreItem("arithmetic", "2 + 2 = 4", "4", {"a": 2, "b": 2}),
                         ScoreItem("arithmetic", "5", "4", {"a": 2, "b": 2}),
                         ScoreItem("no_such_task", "x", "y")]
                await client.send_multipart([encode(ScoreRequest(request_id=9, items=items))])
                reply = client_codec.decode((await client.recv_multipart())[-1])
                assert isinstance(reply, ScoreReply) and reply.request_id == 9
                assert [r.score for r in reply.results] == [1.0, 0.0, 0.0]
                assert "no scorer" in reply.results[2].error
            assert router_ctx.status["rejected_frames"] == 2 * len(BAD_FRAMES)
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


def test_messages_are_plain_msgpack():
    # what crosses the wire is readable by any msgpack implementation: no pickle, no code
    frame = encode(ScoreRequest(request_id=1, items=[ScoreItem("a", "b", "c")]))
    assert msgspec.msgpack.decode(frame)["type"] == "ScoreRequest"


@pytest.mark.anyio
async def test_router_resends_a_timed_out_request_and_answers_it_once(sockets):
    """Live router: a worker that sits on a request loses it to another worker after
    ``request_timeout``; its late reply is discarded, so the client gets exactly one answer."""
    topo = live_topology(sockets, "router.request_timeout=0.5")
    zctx = zmq.Context()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            router_ctx = actor_context("router", topo, zctx)
            tg.start_soon(serve_actor, router_ctx, router_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client, \
                 make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address,
                             identity=b"slow") as slow, \
                 make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address,
                             identity=b"fast") as fast:
                worker_codec = Codec(ToWorker)
                await slow.send_multipart([encode(WorkerHello(name="slow", capacity=4))])
                while router_ctx.status.get("workers") != 1:  # noqa: ASYNC110 - plain dict
                    await anyio.sleep(0.02)
                await client.send_multipart([encode(ScoreRequest(7, [ScoreItem("a", "1", "1")]))])
                held = worker_codec.decode((await slow.recv_multipart())[-1])
                assert isinstance(held, ScoreRequest)
                await fast.send_multipart([encode(WorkerHello(name="fast", capacity=4))])
                # the slow worker stays alive (heartbeats) but never answers in time
                resent = None
                while resent is None:
                    await slow.send_multipart([encode(WorkerHeartbeat(name="slow", capacity=4))])
                    with anyio.move_on_after(0.1):
                        resent = worker_codec.decode((await fast.recv_multipart())[-1])
                assert isinstance(resent, ScoreRequest) and resent.request_id == held.request_id
                await fast.send_multipart([encode(ScoreReply(resent.request_id, [ScoreResult(1.0)]))])
                await slow.send_multipart([encode(ScoreReply(held.request_id, [ScoreResult(0.0)]))])
                reply = Codec(ToClient).decode((await client.recv_multipart())[-1])
                assert isinstance(reply, ScoreReply) and reply.request_id == 7
                assert [r.score for r in reply.results] == [1.0]
                while router_ctx.status.get("duplicates") != 1:  # noqa: ASYNC110 - plain dict
                    await anyio.sleep(0.02)
                assert router_ctx.status["answered"] == 1 and router_ctx.status["resent"] >= 1
                with anyio.move_on_after(0.3):  # nothing more for the client
                    extra = await client.recv_multipart()
                    raise AssertionError(f"second answer {extra}")
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)
