"""Property-based fuzzing (hypothesis) of every socket an actor receives on.

Each live test starts one actor in this process, on trio, over real ipc sockets, and runs
hypothesis in a worker thread: every example is a list of multipart messages (random bytes,
msgpack of random JSON-like values, valid messages of the wrong type, truncated messages,
messages with wrong field types, missing and extra frames) sent to the actor through
``anyio.from_thread``. After each example the actor must still be running and answer a valid
request, and its ``rejected_frames`` counter (where it has one) must have grown by exactly the
number of messages it cannot take. A fresh ``Codec`` of the socket's union, applied to the frame
the actor reads (the last one on most sockets; on routed sockets the envelope, frame 0, and the
frame count: an envelope and a body, or one frame) is the oracle for that: messages it accepts
are not sent (they would change the actor's state, not test its defences). The reward worker
also gets routed requests whose body is not a ``ScoreRequest``: dropped and counted
(``rejected_bodies``), never answered.

Sockets covered: replay ROUTER, router client and worker ROUTERs, reward worker DEALER, the
runner's control ROUTER (``Job.listen``), an actor's control DEALER (``_control_listener``),
the learner's weights ROUTER (``WeightsPublisher.serve``), and, unit-level, the sampler's four
decoders (replay, router envelope, scoring reply body, weights) and ``from_buffer`` (weights
frames) plus the codec's ``max_frame`` limit.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from actors.job.supervisor import Job
from actors.replay.actor import replay_actor
from actors.reward import reward_actor
from actors.router.actor import router_actor
from actors.runtime.actor import ActorContext, serve_actor
from actors.runtime.tensors import from_buffer
from actors.runtime.transports.zmq import ZmqSender
from actors.runtime.weights import WeightsPublisher
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from messages.codec import REJECT_LOG_INTERVAL_S, Codec, DecodeError, encode
from messages.control import (
    ErrorReply,
    Heartbeat,
    Ready,
    Stop,
    ToActor,
    ToRunner,
)
from messages.reward import ScoreReply, ToRewardWorker, ToScoringClient
from messages.rollout import (
    BatchRequest,
    FromReplay,
    GroupsDone,
    PromptBatch,
    PromptRequest,
    ToReplay,
    TrainBatch,
    VersionUpdate,
)
from messages.routing import (
    Envelope,
    RouterError,
    ToClient,
    ToRouterFromClient,
    ToRouterFromWorker,
    ToWorker,
    WorkerBye,
    WorkerHello,
)
from messages.tensor import DTYPES, ITEMSIZE
from messages.weights import FromLearnerWeights, ToLearnerWeights, WeightsPoll
from tests.helpers import (
    CASES,
    actor_context,
    live_topology,
    routed,
    sample_group,
    score_request,
    wait_for,
)

# ---------------------------------------------------------------- strategies

REQUEST = score_request("2 + 2 = 4", data_source="arithmetic", ground_truth="4",
                        extra_info={"a": 2, "b": 2})

# one valid message of every type on the wire
ALL_MESSAGES: list[msgspec.Struct] = [message for _, message in CASES]

_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
            | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=20))
json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def truncated(draw) -> bytes:
    frame = encode(draw(st.sampled_from(ALL_MESSAGES)))
    return frame[: draw(st.integers(0, len(frame) - 1))]


@st.composite
def wrong_field(draw) -> bytes:
    """A valid message with one field (top level or nested list element) replaced."""
    value = msgspec.to_builtins(draw(st.sampled_from(ALL_MESSAGES)))
    keys = [k for k in value if k != "type"]
    if not keys:
        return encode(value)
    key = draw(st.sampled_from(keys))
    replacement = draw(json_values | st.just("not an int") | st.just(-1) | st.just([]) | st.just({}))
    field = value[key]
    if isinstance(field, list) and field and draw(st.booleans()):
        i = draw(st.integers(0, len(field) - 1))
        field[i] = replacement  # e.g. a ScoreItem or Prompt that is not one
    elif draw(st.booleans()) or not keys:
        value[key] = replacement
    else:
        del value[key]  # a missing field
    return encode(value)


@st.composite
def flipped(draw) -> bytes:
    """A valid message with a few bits flipped: a string's bytes may stop being UTF-8."""
    frame = bytearray(encode(draw(st.sampled_from(ALL_MESSAGES))))
    for i in draw(st.lists(st.integers(0, len(frame) * 8 - 1), min_size=1, max_size=4)):
        frame[i // 8] ^= 1 << (i % 8)
    return bytes(frame)


# a tag and a field that are not UTF-8 (msgspec < 0.23 raises UnicodeDecodeError for them, not
# its own DecodeError)
NOT_UTF8 = [b"\x81\xa4type\xa4\xf0\x28\x8c\x28",
            b"\x82\xa4type\xa9Heartbeat\xa5actor\xa2\xff\xfe",
            b"\x83\xa4type\xadPromptRequest\xabmax_prompts\x01\xabincarnation\xa2\xff\xfe"]

frames_strategy = st.one_of(
    st.binary(max_size=200),
    flipped(),
    st.sampled_from(NOT_UTF8),
    json_values.map(encode),
    st.sampled_from(ALL_MESSAGES).map(encode),  # valid, and of the wrong type for most sockets
    truncated(),
    wrong_field(),
    st.dictionaries(st.just("type"), st.text(max_size=12)).map(encode),  # unknown tag
)

# a multipart message: most actors decode the last frame and ignore the ones before it; the
# routed sockets read frame 0 and refuse a wrong number of frames
multipart = st.lists(frames_strategy, min_size=1, max_size=3)
examples = st.lists(multipart, min_size=1, max_size=8)
bodies = st.lists(frames_strategy, max_size=4)  # bodies of routed requests

FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
LIVE = settings(FUZZ, max_examples=75)  # one long-lived actor, ~4 bad messages per example


def rejected(union: Any, parts: list[bytes]) -> bool:
    """The oracle of the sockets that read the last frame: does it fail to decode as ``union``?"""
    try:
        Codec(union).decode(parts[-1] if parts else b"")
    except DecodeError:
        return True
    return False


def invalid_only(union: Any, messages: list[list[bytes]]) -> list[list[bytes]]:
    return [m for m in messages if rejected(union, m)]


def envelope_of(union: Any, parts: list[bytes]) -> Any:
    """Frame 0 decoded as ``union``, or None when it does not decode."""
    try:
        return Codec(union).decode(parts[0] if parts else b"")
    except DecodeError:
        return None


def router_client_rejects(parts: list[bytes]) -> bool:
    """A request is an envelope and a body."""
    return envelope_of(ToRouterFromClient, parts) is None or len(parts) != 2


def router_worker_rejects(parts: list[bytes]) -> bool:
    """A reply is an envelope and a body; a hello, heartbeat or bye is one frame."""
    msg = envelope_of(ToRouterFromWorker, parts)
    return msg is None or len(parts) != (2 if isinstance(msg, Envelope) else 1)


def reward_worker_rejects(parts: list[bytes]) -> bool:
    """The worker takes a request (an envelope and a body) and the router's bye acknowledgement;
    anything else (a frame that does not decode, a RouterError, an envelope without its body or
    with more) is dropped and counted."""
    msg = envelope_of(ToWorker, parts)
    return not (isinstance(msg, WorkerBye) or isinstance(msg, Envelope) and len(parts) == 2)


# ---------------------------------------------------------------- live harness


async def fuzz_in_thread(strategy, check) -> None:
    """Run hypothesis in a worker thread; each example runs ``await check(example)`` on this loop."""

    @LIVE
    @given(strategy)
    def run(example) -> None:
        anyio.from_thread.run(check, example)

    await anyio.to_thread.run_sync(run)


async def recv_type(sock: AsyncSocket, union: Any, want: type | tuple[type, ...],
                    at: int = -1) -> Any:
    """The next message of type ``want`` on ``sock``, decoded from frame ``at`` (others, e.g.
    heartbeats, are skipped)."""
    codec = Codec(union)
    while True:
        frames = await sock.recv_multipart()
        msg = codec.decode(frames[at])
        if isinstance(msg, want):
            return msg


async def recv_routed_reply(sock: AsyncSocket, at: int = 0) -> tuple[Envelope, ScoreReply]:
    """The next routed reply on ``sock`` (its envelope at frame ``at``, the body after it);
    heartbeats and the like are skipped."""
    codec = Codec(ToRouterFromWorker if at else ToClient)
    while True:
        frames = await sock.recv_multipart()
        msg = codec.decode(frames[at])
        if isinstance(msg, Envelope):
            assert len(frames) == at + 2
            reply = Codec(ToScoringClient).decode(frames[at + 1])
            assert isinstance(reply, ScoreReply)
            return msg, reply


async def wait_status(ctx: ActorContext, key: str, value: Any) -> None:
    await wait_for(f"{ctx.name} status {key} == {value!r}", lambda: ctx.status.get(key, 0) == value)


# ---------------------------------------------------------------- live actors


@pytest.mark.anyio
async def test_fuzz_replay_router_socket(sockets):
    topo = live_topology(sockets)
    zctx = zmq.Context()
    ctx = actor_context("replay", topo, zctx)
    sent = {"bad": 0, "n": 0}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(serve_actor, ctx, replay_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.replay.address, identity=b"fuzzer") as sock:

                async def check(messages: list[list[bytes]]) -> None:
                    with anyio.fail_after(10):
                        for parts in invalid_only(ToReplay, messages):  # the last frame is read
                            await sock.send_multipart(parts)
                            reply = Codec(ErrorReply).decode((await sock.recv_multipart())[-1])
                            assert reply.error.startswith("replay:")
                            sent["bad"] += 1
                        # a new incarnation each time: the prompt issued before is issued again
                        sent["n"] += 1
                        await sock.send_multipart([encode(PromptRequest(1, f"inc-{sent['n']}"))])
                        batch = Codec(FromReplay).decode((await sock.recv_multipart())[-1])
                        assert isinstance(batch, PromptBatch) and len(batch.prompts) == 1
                        await wait_status(ctx, "rejected_frames", sent["bad"])

                await fuzz_in_thread(examples, check)
            assert sent["bad"] > 0 and ctx.status["state"] == "running"
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_replayed_replay_frames_are_refused_and_counted(sockets):
    """Old frames sent again by another peer: a batch request for a step already served (taken,
    it would hand the learner's next batch to the sender and leave the learner waiting for
    ever), a version notice older than one heard, and a group already trained. Each is refused
    and counted; the learner's next request still gets its batch."""
    topo = live_topology(sockets, "learner.groups_per_step=1")
    zctx = zmq.Context()
    ctx = actor_context("replay", topo, zctx)
    replies = Codec(FromReplay)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(serve_actor, ctx, replay_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.replay.address, identity=b"s") as sampler, \
                 make_socket(zctx, zmq.DEALER, connect=topo.replay.address, identity=b"l") as learner, \
                 make_socket(zctx, zmq.DEALER, connect=topo.replay.address, identity=b"x") as stranger:
                await sampler.send_multipart([encode(PromptRequest(2, "inc"))])
                batch = replies.decode((await sampler.recv_multipart())[-1])
                assert isinstance(batch, PromptBatch) and len(batch.prompts) == 2
                group = sample_group()
                await sampler.send_multipart([encode(GroupsDone(
                    [msgspec.structs.replace(group, prompt=p) for p in batch.prompts]))])
                await learner.send_multipart([encode(BatchRequest(step=0, version=0, num_groups=1))])
                first = replies.decode((await learner.recv_multipart())[-1])
                assert isinstance(first, TrainBatch) and first.step == 0
                trained = first.groups[0].prompt

                await stranger.send_multipart([encode(BatchRequest(step=0, version=0, num_groups=1))])
                refused = Codec(ErrorReply).decode((await stranger.recv_multipart())[-1])
                assert refused.error == "replay: the batch of step 1 was served already"
                await learner.send_multipart([encode(VersionUpdate(2))])
                await stranger.send_multipart([encode(VersionUpdate(1))])
                await stranger.send_multipart([encode(GroupsDone(
                    [msgspec.structs.replace(group, prompt=trained)]))])
                await wait_status(ctx, "stale_refused", 2)
                await wait_status(ctx, "rejected", 1)

                await learner.send_multipart([encode(BatchRequest(step=1, version=2, num_groups=1))])
                second = replies.decode((await learner.recv_multipart())[-1])
                assert isinstance(second, TrainBatch) and second.step == 1
                assert second.groups[0].prompt.prompt_id != trained.prompt_id
                await wait_status(ctx, "trained", 2)  # its status follows the send
                assert ctx.status["version"] == 2 and ctx.status["stale_refused"] == 2
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_fuzz_router_client_socket(sockets):
    topo = live_topology(sockets)
    zctx = zmq.Context()
    router_ctx = actor_context("router", topo, zctx)
    sent = {"bad": 0, "n": 0}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(serve_actor, router_ctx, router_actor, None)
            await tg.start(serve_actor, actor_context("reward", topo, zctx), reward_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client:

                async def check(messages: list[list[bytes]]) -> None:
                    with anyio.fail_after(10):
                        for parts in filter(router_client_rejects, messages):
                            await client.send_multipart(parts)
                            reply = Codec(ToClient).decode((await client.recv_multipart())[-1])
                            assert isinstance(reply, RouterError) and reply.error.startswith("router:")
                            sent["bad"] += 1
                        sent["n"] += 1
                        await client.send_multipart(routed(sent["n"], REQUEST))
                        envelope, reply = await recv_routed_reply(client)
                        assert envelope == Envelope(sent["n"])
                        assert [r.score for r in reply.results] == [1.0]
                        await wait_status(router_ctx, "rejected_frames", sent["bad"])

                await fuzz_in_thread(examples, check)
            await wait_status(router_ctx, "answered", sent["n"])  # its figures follow on a timer
            assert sent["bad"] > 0 and router_ctx.status["workers"] == 1
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_fuzz_router_worker_socket(sockets):
    topo = live_topology(sockets)
    zctx = zmq.Context()
    router_ctx = actor_context("router", topo, zctx)
    sent = {"bad": 0, "n": 0}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(serve_actor, router_ctx, router_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address,
                             identity=b"fake-worker") as worker:

                async def check(messages: list[list[bytes]]) -> None:
                    with anyio.fail_after(10):
                        for parts in filter(router_worker_rejects, messages):
                            await worker.send_multipart(parts)
                            reply = Codec(RouterError).decode((await worker.recv_multipart())[-1])
                            assert reply.error.startswith("router:")
                            sent["bad"] += 1
                        # a valid request the router answers: a bye is acknowledged
                        sent["n"] += 1
                        await worker.send_multipart([encode(WorkerBye(f"w{sent['n']}"))])
                        ack = Codec(ToWorker).decode((await worker.recv_multipart())[-1])
                        assert ack == WorkerBye(f"w{sent['n']}")
                        await wait_status(router_ctx, "rejected_frames", sent["bad"])

                await fuzz_in_thread(examples, check)
            assert sent["bad"] > 0
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_fuzz_reward_worker_dealer(sockets):
    topo = live_topology(sockets)
    zctx = zmq.Context()
    reward_ctx = actor_context("reward", topo, zctx)
    sent = {"bad": 0, "bad_bodies": 0, "n": 0}
    with anyio.fail_after(60):
        # a fake router: the worker connects to it and gets whatever it sends
        with make_socket(zctx, zmq.ROUTER, bind=topo.router.worker_address) as router:
            async with anyio.create_task_group() as tg:
                await tg.start(serve_actor, reward_ctx, reward_actor, None)
                identity = reward_ctx.name.encode()
                await recv_type(router, ToRouterFromWorker, WorkerHello)
                # every kind of rejection counts, once each (not only those hypothesis finds)
                known = [[encode(RouterError("x"))], [b"\xc1"], [encode(Envelope(1, "reward"))],
                         [encode(Envelope(2, "reward")), b"body", b"extra"]]
                for parts in known:
                    assert reward_worker_rejects(parts)
                    await router.send_multipart([identity, *parts])
                sent["bad"] = len(known)
                await wait_status(reward_ctx, "rejected_frames", sent["bad"])

                async def check(example: tuple[list[list[bytes]], list[bytes]]) -> None:
                    messages, request_bodies = example
                    with anyio.fail_after(10):
                        for parts in filter(reward_worker_rejects, messages):
                            await router.send_multipart([identity, *parts])
                            sent["bad"] += 1
                        for body in request_bodies:  # routed, but not a request it can read
                            if rejected(ToRewardWorker, [body]):
                                await router.send_multipart([identity, *routed(-1, body)])
                                sent["bad_bodies"] += 1
                        sent["n"] += 1
                        await router.send_multipart([identity, *routed(sent["n"], REQUEST)])
                        # each unreadable body is answered with no results, then the request
                        envelope, reply = await recv_routed_reply(router, at=1)
                        while envelope == Envelope(-1):
                            assert reply.results == []
                            envelope, reply = await recv_routed_reply(router, at=1)
                        assert envelope == Envelope(sent["n"]) and [r.score for r in reply.results] == [1.0]
                        await wait_status(reward_ctx, "rejected_frames", sent["bad"])
                        await wait_status(reward_ctx, "rejected_bodies", sent["bad_bodies"])

                await fuzz_in_thread(st.tuples(examples, bodies), check)
                assert sent["bad"] > 0 and sent["bad_bodies"] > 0
                assert reward_ctx.status["requests_done"] == sent["n"]
                tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_fuzz_actor_control_dealer(sockets):
    """``_control_listener``: bad frames from the runner are answered; a Stop still stops."""
    topo = live_topology(sockets)
    zctx = zmq.Context()
    ctx = actor_context("probe", topo, zctx)
    sent = {"bad": 0}

    async def idle_body(ctx: ActorContext, *, task_status) -> None:
        task_status.started()
        await anyio.sleep_forever()

    with anyio.fail_after(60):
        with make_socket(zctx, zmq.ROUTER, bind=topo.control_address) as control:
            async with anyio.create_task_group() as tg:
                await tg.start(serve_actor, ctx, idle_body, topo.control_address)
                await recv_type(control, ToRunner, Ready)

                async def check(messages: list[list[bytes]]) -> None:
                    with anyio.fail_after(10):
                        for parts in invalid_only(ToActor, messages):
                            await control.send_multipart([b"probe-0", *parts])
                            reply = await recv_type(control, ToRunner, ErrorReply)
                            assert reply.error.startswith("bad control frame:")
                            sent["bad"] += 1
                        # still serving: an empty frame is answered too
                        await control.send_multipart([b"probe-0", b""])
                        await recv_type(control, ToRunner, ErrorReply)
                        assert ctx.status["state"] == "running"

                await fuzz_in_thread(examples, check)
                assert sent["bad"] > 0
                await recv_type(control, ToRunner, Heartbeat)  # heartbeats still flow
                await control.send_multipart([b"probe-0", encode(Stop("done"))])
            # serve_actor returned: the Stop was obeyed after all that
            assert ctx.status["state"] == "stopping"
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_fuzz_runner_control_router(sockets, tmp_path):
    """``Job.listen``: bad frames (from known and unknown actors) are dropped; heartbeats still land."""
    topo = live_topology(sockets)
    job = Job(topo, tmp_path)
    proc = job.procs["replay-0"]
    sent = {"n": 0}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(job.listen)
            with make_socket(job.zmq, zmq.DEALER, connect=topo.control_address, identity=b"replay-0") as known, \
                 make_socket(job.zmq, zmq.DEALER, connect=topo.control_address, identity=b"\xff") as stranger:

                async def check(messages: list[list[bytes]]) -> None:
                    with anyio.fail_after(10):
                        for parts in invalid_only(ToRunner, messages):
                            await known.send_multipart(parts)
                            await stranger.send_multipart(parts)
                        sent["n"] += 1
                        await known.send_multipart([encode(Heartbeat("replay-0", {"probe": sent["n"]}))])
                        while proc.status.get("probe") != sent["n"]:  # noqa: ASYNC110
                            await anyio.sleep(0.005)

                await fuzz_in_thread(examples, check)
            tg.cancel_scope.cancel()
    job.control.close()
    job.zmq.destroy(linger=0)


@pytest.mark.anyio
async def test_fuzz_learner_weights_router(sockets):
    """``WeightsPublisher.serve`` (no model needed): bad polls are answered with an error; a valid
    poll still gets the published weights."""
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    weights = [("w", torch.arange(4, dtype=torch.float32).reshape(2, 2))]
    sent = {"bad": 0}
    with anyio.fail_after(60):
        with make_socket(zctx, zmq.ROUTER, bind=address) as sock, \
             make_socket(zctx, zmq.DEALER, connect=address) as sampler:
            server = WeightsPublisher(sock, ZmqSender())
            await server.publish(5, weights)
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve)

                async def check(messages: list[list[bytes]]) -> None:
                    with anyio.fail_after(10):
                        for parts in invalid_only(ToLearnerWeights, messages):
                            await sampler.send_multipart(parts)
                            reply = Codec(ErrorReply).decode((await sampler.recv_multipart())[-1])
                            assert reply.error.startswith("weights:")
                            sent["bad"] += 1
                        await sampler.send_multipart([encode(WeightsPoll(have_version=-1))])
                        frames = await sampler.recv_multipart()
                        header = Codec(FromLearnerWeights).decode(frames[0])
                        assert header.version == 5 and len(frames) == 2
                        got = from_buffer(header.tensors[0].dtype, header.tensors[0].shape, frames[1])
                        assert torch.equal(got, weights[0][1])

                await fuzz_in_thread(examples, check)
                assert sent["bad"] > 0 and server.sent > 0
                tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_a_peer_that_never_reads_does_not_stall_the_weights_server(sockets):
    """Bad polls from a peer that reads none of its error replies: once its queue is full the
    errors to it are dropped (still counted as rejected), and a sampler polling next still gets
    the weights; the socket's ROUTER_MANDATORY made each such send wait for room for ever."""
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    weights = [("w", torch.arange(4, dtype=torch.float32).reshape(2, 2))]
    with anyio.fail_after(30):
        with make_socket(zctx, zmq.ROUTER, bind=address, hwm=8) as sock, \
             make_socket(zctx, zmq.DEALER, connect=address, hwm=1) as deaf, \
             make_socket(zctx, zmq.DEALER, connect=address) as sampler:
            server = WeightsPublisher(sock, ZmqSender())
            await server.publish(5, weights)
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve)
                for _ in range(500):
                    await deaf.send_multipart([b"\xc1"])
                await wait_for("every bad poll read", lambda: server.codec.rejected == 500)
                await sampler.send_multipart([encode(WeightsPoll(have_version=-1))])
                frames = await sampler.recv_multipart()
                assert Codec(FromLearnerWeights).decode(frames[0]).version == 5
                assert server.unanswered > 0  # the deaf peer's errors past its queue
                tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


# ---------------------------------------------------------------- unit level


UNIONS = {  # the sampler's four decoders first
    "sampler-FromReplay": FromReplay, "sampler-ToClient": ToClient,
    "sampler-ToScoringClient": ToScoringClient, "sampler-FromLearnerWeights": FromLearnerWeights,
    "ToRunner": ToRunner, "ToActor": ToActor, "ToReplay": ToReplay, "ToWorker": ToWorker,
    "ToRewardWorker": ToRewardWorker, "ToRouterFromClient": ToRouterFromClient,
    "ToRouterFromWorker": ToRouterFromWorker, "ToLearnerWeights": ToLearnerWeights,
}


@pytest.mark.parametrize("union", list(UNIONS.values()), ids=list(UNIONS))
@FUZZ
@example(frames=NOT_UTF8)  # escaped as UnicodeDecodeError, past every actor's except clause
@given(frames=st.lists(frames_strategy, max_size=20))
def test_codec_only_raises_decode_error_and_counts(union, frames):
    """The sampler's four decoders (and every other socket's): any frame either decodes to a
    message of the union or raises ``DecodeError``, and every rejection is counted."""
    codec = Codec(union)
    bad = 0
    for frame in frames:
        try:
            codec.decode(frame)
        except DecodeError:
            bad += 1
    assert codec.rejected == bad


@FUZZ
@given(msg=st.sampled_from(ALL_MESSAGES), limit=st.integers(0, 64))
def test_codec_refuses_frames_over_max_frame(msg, limit):
    frame = encode(msg)
    codec = Codec(type(msg), max_frame=limit)
    if len(frame) > limit:
        with pytest.raises(DecodeError, match="exceeds"):
            codec.decode(frame)
        assert codec.rejected == 1
    else:
        assert codec.decode(frame) == msg and codec.rejected == 0


@st.composite
def weights_frame(draw) -> tuple[str, tuple[int, ...], bytes]:
    """A header entry and its frame: often a byte count that matches ``|prod(shape)|``, so
    negative dimensions get past the size check."""
    dtype = draw(st.sampled_from(DTYPES) | st.text(max_size=10))
    shape = tuple(draw(st.lists(st.integers(-4, 4), max_size=4)))
    n = 1
    for d in shape:
        n *= d
    size = abs(n) * ITEMSIZE.get(dtype, 1)
    data = draw(st.sampled_from([b"\0" * size, b"\1" * size]) | st.binary(max_size=64))
    return dtype, shape, data


@settings(FUZZ, max_examples=300)
@example(frame=("uint8", (-1, -4), b"\0" * 4))  # torch raised RuntimeError before the fix
@example(frame=("float32", (0, -1), b""))
@given(frame=weights_frame())
def test_weights_frame_to_tensor_only_raises_value_error(frame):
    """The sampler turns each weights frame into a tensor with ``from_buffer`` and catches
    ValueError (and DecodeError) only: any header/frame mismatch must be a ValueError."""
    dtype, shape, data = frame
    try:
        t = from_buffer(dtype, shape, data)
    except ValueError:
        return
    assert tuple(t.shape) == shape and t.numel() * t.element_size() == len(data)


def test_rejections_are_logged_once_per_kind_naming_the_socket(capsys):
    """A peer sending garbage fast gets one line per kind of damage, then one a minute per kind
    saying how many came since; the counts are exact whatever is logged."""
    now = [0.0]
    codec = Codec(ToReplay, socket="[replay-0] ROUTER ipc:///x/replay", clock=lambda: now[0])
    frames = [b"\xc1", encode(PromptRequest(1, "x"))[:3], b"\xc1", NOT_UTF8[0],
              encode(Stop("x")), b"\xc1"]
    for frame in frames:
        with pytest.raises(DecodeError):
            codec.decode(frame)
    assert codec.rejected == 6
    assert codec.kinds == {"not msgpack": 3, "truncated": 1, "not utf-8": 1, "wrong type": 1}
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[1].split(")")[0] for line in lines] == [
        "not msgpack", "truncated", "not utf-8", "wrong type"]
    assert all(line.startswith("[replay-0] ROUTER ipc:///x/replay: rejected a frame") for line in lines)
    now[0] = REJECT_LOG_INTERVAL_S  # a minute on: the next of a kind is logged with the count
    codec.decode(encode(PromptRequest(1, "x")))  # a good frame says nothing
    with pytest.raises(DecodeError):
        codec.decode(b"\xc1")
    (line,) = capsys.readouterr().err.splitlines()
    assert "(not msgpack)" in line and "(3 of this kind since the last line)" in line
    with pytest.raises(DecodeError, match="a request is"):
        raise codec.refuse("a request is an envelope and a body", "frame count")
    assert codec.rejected == 8 and codec.kinds["frame count"] == 1
    assert "(frame count): a request is" in capsys.readouterr().err
    assert Codec(ToReplay).refuse("x") and not capsys.readouterr().err  # unnamed: silent
