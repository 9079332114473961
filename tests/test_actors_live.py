"""Live actors (in this process, on trio, over real ipc sockets) survive malformed frames; the
router forwards envelopes and bodies as they came, fails over a timed-out request and answers it
once; the sampler's scoring client re-sends what was lost and gives up in bounded time; and no
code that handles frames can unpickle or eval what it receives.

Each bad frame is answered with an error message or dropped and counted, and the actor goes on
serving the next valid request.
"""

from __future__ import annotations

import ast
from pathlib import Path

import anyio
import pytest
import zmq

from actors.replay.actor import replay_actor
from actors.reward import reward_actor
from actors.router.actor import router_actor
from actors.runtime.actor import serve_actor
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from actors.sampler.scoring_client import ClientStatistics, ScoringClient
from messages.codec import Codec, encode
from messages.control import ErrorReply
from messages.reward import ScoreReply, ScoreResult, ToRewardWorker, ToScoringClient
from messages.rollout import FromReplay, PromptBatch, PromptRequest
from messages.routing import (
    Envelope,
    RouterError,
    ToClient,
    ToWorker,
    WorkerHeartbeat,
    WorkerHello,
)
from tests.helpers import actor_context, is_pickle, live_topology, routed, score_request, wait_for

ROOT = Path(__file__).resolve().parent.parent

BAD_FRAMES = [b"", b"\xc1", encode(PromptRequest(4))[:-2], encode({"type": "Nope"}),
              encode({"type": "Envelope", "request_id": "x"}), b"\x00" * 10_000]


@pytest.mark.anyio
async def test_replay_answers_bad_frames_and_keeps_serving(sockets):
    topo = live_topology(sockets)
    zctx = zmq.Context()
    ctx = actor_context("replay", topo, zctx)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(serve_actor, ctx, replay_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.replay.address) as sock:
                replies = Codec(ErrorReply)
                for frame in BAD_FRAMES:
                    await sock.send_multipart([frame])
                    error = replies.decode((await sock.recv_multipart())[-1])
                    assert error.error.startswith("replay:")
                await sock.send_multipart([encode(PromptRequest(2, "me"))])
                batch = Codec(FromReplay).decode((await sock.recv_multipart())[-1])
                assert isinstance(batch, PromptBatch) and len(batch.prompts) == 2
            await wait_for("rejections counted",
                           lambda: ctx.status.get("rejected_frames") == len(BAD_FRAMES))
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


def client_bad_messages() -> list[list[bytes]]:
    """What a client may not send: bad envelopes, and good ones without their body or with more."""
    envelope = encode(Envelope(1, "reward"))
    return [[frame, b"body"] for frame in BAD_FRAMES] + [
        [envelope], [envelope, b"body", b"extra"], [encode(ScoreReply([])), b"body"]]


def worker_bad_messages() -> list[list[bytes]]:
    """What a worker may not send: bad frames, a reply without its body, a hello with one."""
    return [[frame] for frame in BAD_FRAMES] + [
        [encode(Envelope(1))], [encode(WorkerHello("w")), b"body"],
        [encode(WorkerHeartbeat("w")), b"x", b"y"]]


async def receive_reply(sock: AsyncSocket, request_id: int) -> ScoreReply:
    frames = await sock.recv_multipart()
    assert not any(is_pickle(f) for f in frames)  # what actually crossed the wire
    assert len(frames) == 2 and Codec(ToClient).decode(frames[0]) == Envelope(request_id)
    reply = Codec(ToScoringClient).decode(frames[1])
    assert isinstance(reply, ScoreReply)
    return reply


@pytest.mark.anyio
async def test_router_and_reward_worker_survive_bad_frames(sockets):
    topo = live_topology(sockets)
    zctx = zmq.Context()
    client_bad, worker_bad = client_bad_messages(), worker_bad_messages()
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            router_ctx = actor_context("router", topo, zctx)
            reward_ctx = actor_context("reward", topo, zctx)
            await tg.start(serve_actor, router_ctx, router_actor, None)
            await tg.start(serve_actor, reward_ctx, reward_actor, None)
            client_codec = Codec(ToClient)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client, \
                 make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address) as fake_worker:
                for parts in client_bad:
                    await client.send_multipart(parts)
                    error = client_codec.decode((await client.recv_multipart())[-1])
                    assert isinstance(error, RouterError) and error.error.startswith("router:")
                for parts in worker_bad:
                    await fake_worker.send_multipart(parts)
                    error = Codec(ToWorker).decode((await fake_worker.recv_multipart())[-1])
                    assert isinstance(error, RouterError) and error.error.startswith("router:")
                # a body the worker cannot read is answered with no results (the router never
                # reads it): the client sees a failed request at once, no capacity is held
                await client.send_multipart(routed(8, b"\xc1 not a ScoreRequest"))
                assert (await receive_reply(client, 8)).results == []
                assert reward_ctx.status.get("rejected_bodies") == 1
                await client.send_multipart(routed(9, score_request(
                    "2 + 2 = 4", "5", data_source="arithmetic", ground_truth="4",
                    extra_info={"a": 2, "b": 2})))
                reply = await receive_reply(client, 9)
                assert [(r.score, r.error) for r in reply.results] == [(1.0, ""), (0.0, "")]
                await client.send_multipart(routed(10, score_request("x", data_source="no_such_task")))
                reply = await receive_reply(client, 10)
                assert reply.results[0].score == 0.0 and "no scorer" in reply.results[0].error
            await wait_for("rejections counted", lambda: router_ctx.status.get("rejected_frames")
                           == len(client_bad) + len(worker_bad))
            assert reward_ctx.status["requests_done"] == 2  # scored; the bad body is not
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_router_resends_a_timed_out_request_and_answers_it_once(sockets):
    """Live router: a worker that sits on a request loses it to another worker after
    ``request_timeout``; its late reply is discarded, so the client gets exactly one answer.
    Both workers get the body byte for byte as the client sent it."""
    topo = live_topology(sockets, "router.request_timeout=0.5")
    zctx = zmq.Context()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            router_ctx = actor_context("router", topo, zctx)
            await tg.start(serve_actor, router_ctx, router_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client, \
                 make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address,
                             identity=b"slow") as slow, \
                 make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address,
                             identity=b"fast") as fast:
                worker_codec = Codec(ToWorker)
                await slow.send_multipart([encode(WorkerHello(name="slow", capacity=4))])
                # the slow worker must be the only one when the request comes
                await wait_for("slow registered", lambda: router_ctx.status.get("workers") == 1)
                body = encode(score_request("1"))
                await client.send_multipart(routed(7, body))
                held_envelope, held_body = await slow.recv_multipart()
                held = worker_codec.decode(held_envelope)
                assert isinstance(held, Envelope) and held.pool == "reward" and held_body == body
                await fast.send_multipart([encode(WorkerHello(name="fast", capacity=4))])
                # the slow worker stays alive (heartbeats) but never answers in time
                resent = None
                while resent is None:
                    await slow.send_multipart([encode(WorkerHeartbeat(name="slow", capacity=4))])
                    with anyio.move_on_after(0.1):
                        resent = await fast.recv_multipart()
                resent_envelope = worker_codec.decode(resent[0])
                assert resent_envelope == held and resent[1] == body
                await fast.send_multipart([encode(Envelope(held.request_id)),
                                           encode(ScoreReply([ScoreResult(1.0)]))])
                await slow.send_multipart([encode(Envelope(held.request_id)),
                                           encode(ScoreReply([ScoreResult(0.0)]))])
                reply = await receive_reply(client, 7)
                assert [r.score for r in reply.results] == [1.0]
                await wait_for("late reply counted", lambda: router_ctx.status.get("duplicates") == 1)
                assert router_ctx.status["answered"] == 1 and router_ctx.status["resent"] >= 1
                assert router_ctx.status["worker/slow"]["failed"] >= 1 and router_ctx.status["worker/fast"]["done"] == 1
                with anyio.move_on_after(0.3):  # nothing more for the client
                    extra = await client.recv_multipart()
                    raise AssertionError(f"second answer {extra}")
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


# ---------------------------------------------------------------- the sampler's scoring client


class FakeWorker:
    """A worker DEALER driven by the test: it records what it gets and answers when told."""

    def __init__(self, sock: AsyncSocket) -> None:
        self.sock = sock
        self.got: list[tuple[Envelope, bytes]] = []  # (envelope, body) in arrival order
        self.arrived = anyio.Event()  # set and replaced at every arrival

    async def serve(self) -> None:
        await self.sock.send_multipart([encode(WorkerHello(name="fake", capacity=8))])
        codec = Codec(ToWorker)
        while True:
            envelope, body = await self.sock.recv_multipart()
            msg = codec.decode(envelope)
            assert isinstance(msg, Envelope)
            self.got.append((msg, body))
            self.arrived.set()
            self.arrived = anyio.Event()

    async def wait_for_requests(self, n: int) -> None:
        while len(self.got) < n:
            await self.arrived.wait()

    async def answer(self, index: int, *scores: float) -> None:
        envelope, _ = self.got[index]
        await self.sock.send_multipart([encode(Envelope(envelope.request_id)),
                                        encode(ScoreReply([ScoreResult(s) for s in scores]))])


@pytest.mark.anyio
async def test_scoring_client_resends_then_gives_up_and_counts_a_late_reply(sockets):
    topo = live_topology(sockets)
    zctx = zmq.Context()
    request = score_request("a", "b")
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            router_ctx = actor_context("router", topo, zctx)
            await tg.start(serve_actor, router_ctx, router_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as sock, \
                 make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address) as wsock:
                worker = FakeWorker(wsock)
                tg.start_soon(worker.serve)
                client = ScoringClient(sock, timeout_s=0.2, attempts=3)
                tg.start_soon(client.serve)
                started = anyio.current_time()
                assert await client.score(request) is None  # the worker never answers
                assert anyio.current_time() - started >= 3 * 0.2
                assert client.statistics() == ClientStatistics(sent=1, resent=2, failed=1, late=0,
                                                               in_flight=0, rejected=0)
                # the router held the request all along: the re-sends changed nothing there, and
                # the worker got it once, under the router's own id, the body unchanged
                await wait_for("re-sends absorbed", lambda: router_ctx.status.get("resubmitted") == 2)
                await worker.wait_for_requests(1)
                assert len(worker.got) == 1 and router_ctx.status["pending"] == 0
                assert Codec(ToRewardWorker).decode(worker.got[0][1]) == request
                # the worker answers after all: late for the client, never delivered
                await worker.answer(0, 1.0, 1.0)
                await wait_for("late reply", lambda: client.statistics().late == 1)
                # the next request is not confused with the late one (a patient timeout now:
                # this one must not be re-sent while the test answers it)
                client.timeout_s = 10.0
                result: list[ScoreReply | None] = []

                async def score_next() -> None:
                    result.append(await client.score(score_request("c")))

                async with anyio.create_task_group() as inner:
                    inner.start_soon(score_next)
                    await worker.wait_for_requests(2)
                    await worker.answer(1, 0.5)
                assert [r.score for r in result[0].results] == [0.5]
                assert client.statistics() == ClientStatistics(sent=2, resent=2, failed=1, late=1,
                                                               in_flight=0, rejected=0)
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_a_request_a_worker_dropped_is_resent_by_the_router_not_the_client(sockets):
    """A worker that silently drops a request is the router's to catch (``request_timeout``);
    the client's own timeout is longer, so its re-send, absorbed by the router, is not needed."""
    topo = live_topology(sockets, "router.request_timeout=0.3")
    zctx = zmq.Context()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            router_ctx = actor_context("router", topo, zctx)
            await tg.start(serve_actor, router_ctx, router_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as sock, \
                 make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address) as wsock:
                worker = FakeWorker(wsock)
                tg.start_soon(worker.serve)
                client = ScoringClient(sock, timeout_s=5.0, attempts=3)
                tg.start_soon(client.serve)
                result: list[ScoreReply | None] = []

                async def score() -> None:
                    result.append(await client.score(score_request("a", "b")))

                async with anyio.create_task_group() as inner:
                    inner.start_soon(score)
                    await worker.wait_for_requests(2)  # the first is dropped: the router re-sends
                    assert worker.got[0][1] == worker.got[1][1]
                    await worker.answer(1, 1.0, 0.0)
                assert [r.score for r in result[0].results] == [1.0, 0.0]
                assert client.statistics() == ClientStatistics(sent=1, resent=0, failed=0, late=0,
                                                               in_flight=0, rejected=0)
                await wait_for("router figures", lambda: router_ctx.status.get("answered") == 1)
                assert router_ctx.status["resent"] >= 1 and router_ctx.status["in_flight"] == 0
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_a_request_the_router_gives_up_on_fails_at_the_client_at_once(sockets):
    """Workers sit on a request past ``request_timeout`` three times: the router gives it up and
    tells the client, which fails it then, long before its own timeout would."""
    topo = live_topology(sockets, "router.request_timeout=0.2")
    zctx = zmq.Context()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            router_ctx = actor_context("router", topo, zctx)
            await tg.start(serve_actor, router_ctx, router_actor, None)
            with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as sock, \
                 make_socket(zctx, zmq.DEALER, connect=topo.router.worker_address) as wsock:
                worker = FakeWorker(wsock)
                tg.start_soon(worker.serve)
                client = ScoringClient(sock, timeout_s=60.0, attempts=3)
                tg.start_soon(client.serve)
                with anyio.fail_after(10):  # well inside the client's own 60 s
                    assert await client.score(score_request("a")) is None
                assert client.statistics() == ClientStatistics(sent=1, resent=0, failed=1, late=0,
                                                               in_flight=0, rejected=0)
                assert "gave up after 3 workers failed" in client.router_error
                await wait_for("router figures", lambda: router_ctx.status.get("failed") == 1)
                assert len(worker.got) == 3
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


SLOW_FUNCTION = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(float(solution_str))
    return 1.0
'''


@pytest.mark.anyio
async def test_scoring_client_outlives_a_router_restart(tmp_path, sockets):
    """The request's router dies while a real reward worker scores it: the reply goes nowhere
    (the new router never saw that id), and the client's re-send is answered by the new one."""
    scorer = tmp_path / "slow.py"
    scorer.write_text(SLOW_FUNCTION)
    topo = live_topology(sockets, f'reward.functions=[{{path="{scorer}"}}]')
    zctx = zmq.Context()
    result: list[ScoreReply | None] = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            reward_ctx = actor_context("reward", topo, zctx, tmp_path)
            first, second = (actor_context("router", topo, zctx, tmp_path) for _ in range(2))
            async with anyio.create_task_group() as old_router:
                await old_router.start(serve_actor, first, router_actor, None)
                await tg.start(serve_actor, reward_ctx, reward_actor, None)
                sock = make_socket(zctx, zmq.DEALER, connect=topo.router.address)
                client = ScoringClient(sock, timeout_s=2.0, attempts=3)
                tg.start_soon(client.serve)

                async def score() -> None:
                    result.append(await client.score(score_request("1.0", data_source="mine")))

                tg.start_soon(score)
                await wait_for("at the worker", lambda: first.status.get(
                    "worker/reward-0", {}).get("in_flight") == 1)
                old_router.cancel_scope.cancel()
            await tg.start(serve_actor, second, router_actor, None)
            await wait_for("answered", lambda: len(result) == 1, limit_s=10)
            assert [r.score for r in result[0].results] == [1.0]
            assert client.statistics() == ClientStatistics(sent=1, resent=1, failed=0, late=0,
                                                           in_flight=0, rejected=0)
            assert first.status["answered"] == 0
            await wait_for("new router's figures", lambda: second.status.get("answered") == 1)
            assert reward_ctx.status["requests_done"] == 2  # the lost reply, then the re-send's
            sock.close()
            tg.cancel_scope.cancel()
    zctx.destroy(linger=0)


# ---------------------------------------------------------------- no pickle, no eval, in the code

FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve",
                     "joblib"}


def scanned_files() -> list[Path]:
    files = [ROOT / "runner.py"]
    for package in ("actors", "messages", "kernels"):
        files += sorted((ROOT / package).rglob("*.py"))
    return files


def findings(path: Path) -> list[str]:
    """Imports of a pickle-like module, eval/exec calls, and unpickling ``torch.load``s."""
    out = []
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where} import {a.name}" for a in node.names
                    if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                out.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Call):
            fn = node.func
            called = (fn.id if isinstance(fn, ast.Name) else
                      fn.attr if isinstance(fn, ast.Attribute) else "")
            if isinstance(fn, ast.Name) and called in ("eval", "exec", "compile", "__import__"):
                out.append(f"{where} {called}(...)")
            if called in ("import_module", "__import__") and node.args and \
                    isinstance(node.args[0], ast.Constant) and \
                    str(node.args[0].value).split(".")[0] in FORBIDDEN_MODULES:
                out.append(f"{where} {called}({node.args[0].value!r})")
            for kw in node.keywords:  # opting back in to unpickling
                if kw.arg in ("allow_pickle", "pickle_module") or (
                        kw.arg == "weights_only" and not (isinstance(kw.value, ast.Constant)
                                                          and kw.value.value is True)):
                    out.append(f"{where} {called}({kw.arg}=...)")
    return out


def test_the_code_scan_finds_what_it_looks_for(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import pickle\nfrom dill import loads\nimport marshal as m\n"
                       "eval(data)\nexec(code)\n__import__('cloudpickle')\n"
                       "importlib.import_module('_pickle')\ntorch.load(f, weights_only=False)\n"
                       "np.load(f, allow_pickle=True)\n")
    assert len(findings(planted)) == 10  # __import__ is both a dynamic import and a pickle one


def test_no_code_that_handles_frames_can_unpickle_or_eval():
    """What crosses a socket or a pipe is decoded by msgspec into typed Structs only: no module
    under actors/, messages/, kernels/ or runner.py imports pickle or its kin, calls eval or
    exec, or asks ``torch.load`` to unpickle (torch >= 2.6 loads weights only by default; the
    learner's ``torch.load``s read its own checkpoint files, never a received frame)."""
    files = scanned_files()
    assert len(files) > 40 and any(p.parts[-2:] == ("router", "actor.py") for p in files)
    found = [f for path in files for f in findings(path)]
    assert found == []
