"""Teacher worker: a served model in the router's ``teacher`` pool.

Connects a DEALER to the router's worker address, announces itself (``WorkerHello``, pool
``teacher``), heartbeats, and answers each routed ``TeacherRequest`` (one group's token ids)
with a ``TeacherReply``: the teacher's log-prob of every response token (``model.py``), computed
on a worker thread one request at a time, so heartbeats keep flowing. A worker that dies or goes
silent has its requests re-sent by the router to another worker (or to itself once restarted:
``restart = "on-failure"``). A request whose forward fails is answered with its error, which the
sampler records on the group (dropped as ``score_failed``, never trained on without its
teacher log-probs).

The protocol (hello, heartbeats, up to ``capacity`` requests at once, the drain on stopping) is
every pool worker's: ``actors/router/worker.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import torch

from actors.model_store import resolve_model_path
from actors.router.worker import PoolWorker, serve, worker_socket
from actors.runtime.actor import ActorContext
from actors.runtime.devices import on_device
from actors.runtime.tensors import from_wire, to_wire
from actors.runtime.zmq_bridge import AsyncSocket
from actors.scoring.sleep import TorchSleep
from actors.teacher.model import TeacherModel
from messages.codec import Codec, DecodeError, encode
from messages.teacher import TeacherReply, TeacherRequest, ToTeacherWorker

POOL = "teacher"
DRAIN_S = 60.0  # most time a stopping worker spends answering what it holds


class TeacherWorker(PoolWorker):
    """Answers each routed ``TeacherRequest``; forwards run one at a time."""

    def __init__(self, ctx: ActorContext, sock: AsyncSocket, model: TeacherModel) -> None:
        self.cfg = ctx.topology.teacher
        super().__init__(ctx, sock, POOL, self.cfg.capacity, drain_s=DRAIN_S)
        self.model = model
        self.body_codec: Codec[ToTeacherWorker] = Codec(
            ToTeacherWorker, socket=f"[{ctx.name}] request bodies from the router")
        self.lock = anyio.Lock()  # one forward at a time: the model's threads are shared
        self.forward = on_device(model.device, model.logprobs)
        self.errors = 0  # requests answered with an error
        self.tokens = 0  # response tokens scored
        self.busy_s = 0.0  # seconds spent in forwards
        self.sleeper = TorchSleep(model.module, Path(model.path)) if self.cfg.sleep_idle_s > 0 else None
        self.last_request = time.monotonic()  # when the last forward ended (sleep_idle_s)

    def publish(self) -> None:
        self.ctx.status.update(requests_done=self.done, request_errors=self.errors,
                               tokens_scored=self.tokens, busy_s=round(self.busy_s, 3),
                               requests_in_flight=self.in_flight)
        if self.sleeper is not None:
            self.ctx.status.update(self.sleeper.clock.statistics().status())

    async def background(self) -> None:
        """Put the model to sleep whenever no request came for ``teacher.sleep_idle_s`` (a
        request wakes it first, in ``answer``)."""
        if self.sleeper is None:
            return
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

    async def reply(self, body: bytes) -> bytes:
        try:
            request = self.body_codec.decode(body)
        except DecodeError as exc:
            self.ctx.status["rejected_bodies"] = self.body_codec.rejected
            return encode(TeacherReply([], error=f"undecodable request: {exc}"[:200]))
        return encode(await self.answer(request))

    async def answer(self, request: TeacherRequest) -> TeacherReply:
        prompt = from_wire(request.prompt_ids).tolist()
        responses = [from_wire(r).tolist() for r in request.responses]
        async with self.lock:
            started = time.monotonic()
            try:
                if self.sleeper is not None and self.sleeper.asleep:  # woken by the request
                    await anyio.to_thread.run_sync(self.sleeper.wake)
                lps = await anyio.to_thread.run_sync(self.forward, prompt, responses,
                                                     request.images)
            except Exception as exc:  # a forward's failure is the request's error, not the worker's
                self.errors += 1
                return TeacherReply([], error=f"teacher: {type(exc).__name__}: {exc}"[:500])
            finally:
                self.busy_s += time.monotonic() - started
                self.last_request = time.monotonic()
        self.done += 1
        self.tokens += sum(len(r) for r in responses)
        return TeacherReply([to_wire(lp.to(torch.float32)) for lp in lps])


async def teacher_actor(ctx: ActorContext, *, task_status) -> None:
    cfg = ctx.topology.teacher
    model = TeacherModel(resolve_model_path(cfg.path), device=cfg.device, dtype=cfg.dtype,
                         model_dtype=ctx.topology.model.dtype, threads=cfg.threads,
                         batch_size=cfg.batch_size)
    ctx.status["state"] = "loading the teacher"
    await anyio.to_thread.run_sync(on_device(model.device, model.load))
    sock, monitor = worker_socket(ctx)
    await serve(ctx, TeacherWorker(ctx, sock, model), monitor, task_status=task_status)
