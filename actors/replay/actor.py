"""The replay buffer actor: one ROUTER socket that samplers and the learner talk to.

Samplers ask for prompts (``PromptRequest``) and hand back scored groups (``GroupsDone``); the
learner asks for the batch of each step (``BatchRequest``) and announces new versions. A request
the buffer cannot serve yet is held, not refused: one waiting request per peer, answered when
admission or a full batch allows (the backpressure of the whole system). The decisions are
``ReplayState``'s; this module is the socket, the recording and the order of the two.
"""

from __future__ import annotations

import collections
import time

import anyio
import zmq

from actors.data.chat import prompt_token_counter
from actors.data.sources import make_task
from actors.replay.state import ReplayState
from actors.runtime.actor import ActorContext
from actors.runtime.recording import Recorder
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from messages.codec import Codec, DecodeError, encode
from messages.control import ErrorReply
from messages.rollout import (
    BatchRequest,
    GroupsDone,
    PromptBatch,
    PromptRequest,
    SamplerAlive,
    ToReplay,
    TrainBatch,
    VersionUpdate,
)

# the table order is the write-ahead order a resume relies on: a flush writes prompts, then
# the groups of those prompts, then the fates of those groups (see actors/replay/resume.py)
WAL_ORDER = ("prompts", "groups", "fates")


def make_state(ctx: ActorContext) -> ReplayState:
    """The buffer a topology describes (empty: ``ReplayState.restore`` fills it on resume)."""
    topo = ctx.topology
    filter_groups = topo.algorithm.filter_groups
    return ReplayState(
        task=make_task(topo.task, topo.run.seed),
        groups_per_step=topo.learner.groups_per_step,
        max_staleness=topo.algorithm.max_staleness,
        capacity=topo.replay.capacity,
        record=topo.run.record,
        reuse=topo.replay.reuse,
        filter_groups=filter_groups.enable,
        max_filtered=filter_groups.max_num_gen_batches * topo.learner.groups_per_step,
        max_prompt_length=topo.task.max_prompt_length,
        # the tokenizer (not the model) is loaded, and only when prompts are length-filtered
        prompt_length=(prompt_token_counter(topo.model.path) if topo.task.max_prompt_length
                       else None),
    )


class ReplayServer:
    """Answers the socket's requests from ``state`` and records what the state decided."""

    def __init__(self, state: ReplayState, sock: AsyncSocket, recorder: Recorder) -> None:
        self.state = state
        self.sock = sock
        self.recorder = recorder
        self.codec: Codec[ToReplay] = Codec(ToReplay)
        # waiting requests: one per peer at most, since each peer waits for its answer
        self.prompt_waiters: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.batch_waiter: tuple[bytes, BatchRequest] | None = None
        self.incarnations: dict[bytes, str] = {}  # sampler -> its process's incarnation
        self.flushing = anyio.Lock()  # one flush at a time, so the tables' parts keep WAL order
        self.heard: dict[bytes, float] = {}  # sampler -> when it last sent anything
        self.silent: set[bytes] = set()  # samplers past the timeout: issued nothing until heard
        self.reissued_silent = 0  # prompts taken back from silent samplers and issued again

    async def record(self, tables: tuple[str, ...] | None = None) -> None:
        """Hand the state's rows to the recorder and write ``tables`` (default all) in a worker
        thread, in the WAL order. ``("prompts", "groups")`` is written ahead, when groups come
        in, so the flush a batch waits for is mostly its fates."""
        if not self.recorder.enabled:
            self.state.records.clear()
            return
        async with self.flushing:
            for table, row in self.state.records:
                self.recorder.append(table, row)
            self.state.records.clear()
            await anyio.to_thread.run_sync(self.recorder.flush, tables)

    async def serve_waiting(self) -> None:
        """Answer the batch request and the prompt requests that can be answered now."""
        state = self.state
        if self.batch_waiter is not None:
            peer, req = self.batch_waiter
            groups = state.take_batch(req.num_groups, step=req.step + 1)
            if groups is not None:
                self.batch_waiter = None
                await self.record()  # what this batch consumed is on disk before it is sent
                msg = TrainBatch(step=req.step, groups=groups, counters=state.counters(),
                                 stats=state.batch_stats)
                await self.sock.send_multipart([peer, encode(msg)])
        for peer in list(self.prompt_waiters):
            if peer in self.silent:
                continue  # its answer could be lost with it; it asks again when it is back
            prompts = state.issue(peer, self.prompt_waiters[peer])
            if not prompts:
                break  # admission closed: later waiters would get nothing either
            del self.prompt_waiters[peer]
            await self.sock.send_multipart(
                [peer, encode(PromptBatch(prompts=prompts, version=state.version))])

    async def handle(self, peer: bytes, msg: ToReplay, tg: anyio.abc.TaskGroup) -> None:
        state = self.state
        if isinstance(msg, PromptRequest | GroupsDone | SamplerAlive):
            self.heard[peer] = time.monotonic()
            self.silent.discard(peer)
        match msg:
            case SamplerAlive():
                pass
            case PromptRequest(max_prompts=k, incarnation=inc):
                if self.incarnations.get(peer, inc) != inc:
                    state.requeue_from(peer)  # a restarted sampler: its prompts are lost
                self.incarnations[peer] = inc
                self.prompt_waiters[peer] = max(1, k)
            case GroupsDone(groups=groups):
                for g in groups:
                    state.accept(g)
                if self.recorder.enabled and not self.flushing.locked():
                    tg.start_soon(self.record, WAL_ORDER[:2])
            case BatchRequest() as req:
                state.version = max(state.version, req.version)
                self.batch_waiter = (peer, req)
            case VersionUpdate(version=v):
                state.version = max(state.version, v)

    async def watch_samplers(self, ctx: ActorContext, timeout_s: float) -> None:
        """Issue again the prompts of a sampler silent past ``timeout_s`` (hung, or its host cut
        off): what it sends back later is accepted once, whichever copy of a group comes first
        (``ReplayState.accept`` takes a group only for a prompt still in flight)."""
        while True:
            await anyio.sleep(min(1.0, timeout_s / 4))
            now = time.monotonic()
            for peer, heard in self.heard.items():
                if peer not in self.silent and now - heard > timeout_s:
                    self.silent.add(peer)
                    self.reissued_silent += self.state.requeue_from(peer)
            ctx.status.update(samplers_silent=len(self.silent), reissued_silent=self.reissued_silent)
            await self.serve_waiting()

    async def serve(self, ctx: ActorContext) -> None:
        async with anyio.create_task_group() as tg:
            if ctx.topology.replay.sampler_timeout_s > 0:
                tg.start_soon(self.watch_samplers, ctx, ctx.topology.replay.sampler_timeout_s)
            while True:
                peer, *frames = await self.sock.recv_multipart()
                try:
                    msg = self.codec.decode(frames[-1] if frames else b"")
                except DecodeError as exc:
                    await self.sock.send_multipart(
                        [peer, encode(ErrorReply(error=f"replay: {exc}"))])
                    continue
                await self.handle(peer, msg, tg)
                await self.serve_waiting()
                ctx.status.update(self.state.counters(), version=self.state.version,
                                  rejected_frames=self.codec.rejected,
                                  samplers_silent=len(self.silent),
                                  reissued_silent=self.reissued_silent)


async def replay_actor(ctx: ActorContext, *, task_status) -> None:
    """Serve prompts to samplers and batches to the learner over one ROUTER socket."""
    topo = ctx.topology
    state = make_state(ctx)
    if topo.learner.resume:  # continue the recorded run from the learner's latest checkpoint
        restored = state.restore(ctx.run_dir)
        if restored is not None:
            ctx.status.update(resumed_step=restored.step, redone=restored.redone)
    sock = make_socket(ctx.zmq, zmq.ROUTER, bind=topo.replay.address, curve=ctx.curve)
    sock.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted sampler reclaims its name
    server = ReplayServer(state, sock, Recorder(ctx.run_dir, WAL_ORDER, enabled=topo.run.record))
    task_status.started()
    with sock:
        try:
            await server.serve(ctx)
        finally:
            with anyio.CancelScope(shield=True):
                await server.record()  # what was accepted since the last batch survives a stop
