"""Teacher worker: a served model in the router's ``teacher`` pool.

Connects a DEALER to the router's worker address, announces itself (``WorkerHello``, pool
``teacher``), heartbeats, and answers each routed ``TeacherRequest`` (one group's token ids)
with a ``TeacherReply``: the teacher's log-prob of every response token (``model.py``), computed
on a worker thread one request at a time, so heartbeats keep flowing. A worker that dies or goes
silent has its requests re-sent by the router to another worker (or to itself once restarted:
``restart = "on-failure"``). A request whose forward fails is answered with its error, which the
sampler records on the group (dropped as ``score_failed``, never trained on without its
teacher log-probs).

Stopping (Stop, SIGTERM, SIGINT) is a drain, as for reward workers: bye, answer what the router
sent before its acknowledgement, exit.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import torch
import zmq

from actors.model_store import resolve_model_path
from actors.runtime.actor import ActorContext
from actors.runtime.devices import on_device
from actors.runtime.security import handshake_monitor, watch_handshake
from actors.runtime.tensors import from_wire, to_wire
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from actors.scoring.sleep import TorchSleep
from actors.teacher.model import TeacherModel
from messages.codec import Codec, DecodeError, encode
from messages.control import Finished
from messages.routing import Envelope, ToWorker, WorkerBye, WorkerHeartbeat, WorkerHello
from messages.teacher import TeacherReply, TeacherRequest, ToTeacherWorker

POOL = "teacher"
BYE_ACK_WAIT_S = 1.0  # with nothing in flight, how long to wait for the router's ack of a bye
DRAIN_S = 60.0  # most time a stopping worker spends answering what it holds


class TeacherWorker:
    """Takes routed requests up to ``capacity`` at once; forwards run one at a time."""

    def __init__(self, ctx: ActorContext, sock: AsyncSocket, model: TeacherModel) -> None:
        self.ctx, self.sock, self.model = ctx, sock, model
        self.cfg = ctx.topology.teacher
        self.codec: Codec[ToWorker] = Codec(ToWorker)
        self.body_codec: Codec[ToTeacherWorker] = Codec(ToTeacherWorker)
        self.slots = anyio.Semaphore(self.cfg.capacity)
        self.lock = anyio.Lock()  # one forward at a time: the model's threads are shared
        self.forward = on_device(model.device, model.logprobs)
        self.done = 0  # requests answered with log-probs
        self.errors = 0  # requests answered with an error
        self.tokens = 0  # response tokens scored
        self.busy_s = 0.0  # seconds spent in forwards
        self.in_flight = 0  # requests taken and not yet answered
        self.idle = anyio.Event()  # set while nothing is in flight
        self.idle.set()
        self.acked = anyio.Event()  # the router acknowledged our bye
        self.sleeper = TorchSleep(model.module, Path(model.path)) if self.cfg.sleep_idle_s > 0 else None
        self.last_request = time.monotonic()  # when the last forward ended (sleep_idle_s)

    def publish(self) -> None:
        self.ctx.status.update(requests_done=self.done, request_errors=self.errors,
                               tokens_scored=self.tokens, busy_s=round(self.busy_s, 3),
                               requests_in_flight=self.in_flight)
        if self.sleeper is not None:
            self.ctx.status.update(self.sleeper.clock.statistics().status())

    async def keep_sleeping(self) -> None:
        """Put the model to sleep whenever no request came for ``teacher.sleep_idle_s`` (beside
        the worker; a request wakes it first, in ``answer``)."""
        if self.sleeper is None:
            await anyio.sleep_forever()
        assert self.sleeper is not None
        while True:
            due = self.last_request + self.cfg.sleep_idle_s - time.monotonic()
            if due > 0:
                await anyio.sleep(due)
                continue
            async with self.lock:
                if (self.in_flight == 0 and not self.sleeper.asleep
                        and time.monotonic() - self.last_request >= self.cfg.sleep_idle_s):
                    await anyio.to_thread.run_sync(self.sleeper.sleep)
                    self.publish()
            await anyio.sleep(self.cfg.sleep_idle_s)

    async def answer(self, request: TeacherRequest) -> TeacherReply:
        prompt = from_wire(request.prompt_ids).tolist()
        responses = [from_wire(r).tolist() for r in request.responses]
        async with self.lock:
            started = time.monotonic()
            try:
                if self.sleeper is not None and self.sleeper.asleep:  # woken by the request
                    await anyio.to_thread.run_sync(self.sleeper.wake)
                lps = await anyio.to_thread.run_sync(self.forward, prompt, responses)
            except Exception as exc:  # a forward's failure is the request's error, not the worker's
                self.errors += 1
                return TeacherReply([], error=f"teacher: {type(exc).__name__}: {exc}"[:500])
            finally:
                self.busy_s += time.monotonic() - started
                self.last_request = time.monotonic()
        self.done += 1
        self.tokens += sum(len(r) for r in responses)
        return TeacherReply([to_wire(lp.to(torch.float32)) for lp in lps])

    async def handle(self, envelope: Envelope, body: bytes) -> None:
        self.in_flight += 1
        self.idle = anyio.Event()
        try:
            try:
                request = self.body_codec.decode(body)
            except DecodeError as exc:
                self.ctx.status["rejected_bodies"] = self.body_codec.rejected
                reply = TeacherReply([], error=f"undecodable request: {exc}"[:200])
            else:
                reply = await self.answer(request)
            self.publish()
            await self.sock.send_multipart([encode(Envelope(envelope.request_id)), encode(reply)])
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()
            self.slots.release()

    async def heartbeats(self) -> None:
        while True:
            await self.sock.send_multipart(
                [encode(WorkerHeartbeat(self.ctx.name, POOL, self.cfg.capacity))])
            self.publish()
            await anyio.sleep(min(1.0, self.ctx.topology.run.heartbeat_interval))

    async def receive(self, tg: anyio.abc.TaskGroup) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg = self.codec.decode(frames[0])
            except DecodeError:
                self.ctx.status["rejected_frames"] = self.codec.rejected
                continue
            match msg:
                case WorkerBye():
                    self.acked.set()
                case Envelope() if len(frames) == 2:
                    await self.slots.acquire()
                    tg.start_soon(self.handle, msg, frames[1])
                case _:  # a RouterError, or an envelope without its body
                    self.codec.rejected += 1
                    self.ctx.status["rejected_frames"] = self.codec.rejected

    async def drain(self) -> None:
        """Say bye, answer what was sent before the router's ack (bounded), then return."""
        await self.sock.send_multipart([encode(WorkerBye(name=self.ctx.name))])
        self.ctx.status["state"] = "leaving"
        with anyio.move_on_after(DRAIN_S):
            with anyio.move_on_after(BYE_ACK_WAIT_S if self.in_flight == 0 else DRAIN_S):
                await self.acked.wait()
            while self.in_flight:
                await self.idle.wait()


async def teacher_actor(ctx: ActorContext, *, task_status) -> None:
    cfg = ctx.topology.teacher
    address = ctx.topology.router.worker_address
    model = TeacherModel(resolve_model_path(cfg.path), device=cfg.device, dtype=cfg.dtype,
                         model_dtype=ctx.topology.model.dtype, threads=cfg.threads,
                         batch_size=cfg.batch_size)
    ctx.status["state"] = "loading the teacher"
    await anyio.to_thread.run_sync(on_device(model.device, model.load))
    sock = make_socket(ctx.zmq, zmq.DEALER, identity=ctx.name.encode(), curve=ctx.curve)
    monitor = handshake_monitor(sock) if ctx.curve is not None else None
    sock.socket.connect(address)
    worker = TeacherWorker(ctx, sock, model)
    stopping = anyio.Event()  # cancelled from outside (Stop, SIGTERM, SIGINT): drain, then go

    async def watch_cancel() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stopping.set()

    await sock.send_multipart([encode(WorkerHello(name=ctx.name, pool=POOL, capacity=cfg.capacity))])
    task_status.started()
    try:
        with sock:
            async with anyio.create_task_group() as outer:
                outer.start_soon(watch_cancel)  # the only task the outside cancellation reaches
                with anyio.CancelScope(shield=True):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(worker.heartbeats)
                        tg.start_soon(worker.keep_sleeping)
                        if monitor is not None:  # a refused key fails the worker, loudly
                            assert ctx.curve is not None
                            tg.start_soon(watch_handshake, monitor, address, ctx.curve.public)
                        tg.start_soon(worker.receive, tg)
                        await stopping.wait()
                        await worker.drain()
                        if ctx.status.get("attached"):  # its runner drops its row now
                            await ctx.report(Finished(actor=ctx.name, status=dict(ctx.status),
                                                      detail=f"detached: {worker.done} requests done"))
                        tg.cancel_scope.cancel()
    finally:
        if ctx.control is None or ctx.status.get("attached"):  # by hand, or in a test
            print(f"=== {ctx.name} detached: {worker.done} requests done", flush=True)
