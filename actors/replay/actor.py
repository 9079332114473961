"""The replay buffer actor: one ROUTER socket that samplers and the learner talk to.

Samplers ask for prompts (``PromptRequest``) and hand back scored groups (``GroupsDone``); the
learner asks for the batch of each step (``BatchRequest``) and announces new versions. A request
the buffer cannot serve yet is held, not refused: one waiting request per peer, answered when
admission or a full batch allows (the backpressure of the whole system). The decisions are
``ReplayState``'s; this module is the socket, the recording and the order of the two.

Validation (``actors/validation/``): when the learner's version reaches a step that is due, the
round's prompts go to samplers asking for prompts before any training prompt; their groups
come back as ``ValidationDone``; a complete round is summarised (on a worker thread), recorded
(``validation``, ``validation_metrics``) and reported to the runner (``ValidationReport``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import anyio
import zmq

from actors.data.chat import prompt_token_counter
from actors.data.sources import make_task
from actors.replay.errors import count_errors, over_bound, stop_reason
from actors.replay.schedule import FixedSchedule
from actors.replay.state import ReplayState
from actors.runtime.actor import ActorContext
from actors.runtime.recording import Recorder, read_table
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from actors.validation.metrics import ScoredPrompt, outcomes, validation_metrics
from actors.validation.prompts import validation_prompts, validation_sampling
from actors.validation.rounds import Round, ValidationRounds
from messages.codec import Codec, DecodeError, encode
from messages.control import Abort, ErrorReply, ValidationReport
from messages.rollout import (
    BatchRequest,
    GroupsDone,
    LeaveAck,
    PromptBatch,
    PromptRequest,
    PublishReady,
    PublishRequest,
    SamplerAlive,
    SamplerLeaving,
    SamplingParams,
    ToReplay,
    TrainBatch,
    ValidationDone,
    VersionUpdate,
)

# the table order is the write-ahead order a resume relies on: a flush writes prompts, then
# the groups of those prompts, then the fates of those groups (see actors/replay/resume.py)
WAL_ORDER = ("prompts", "groups", "fates")
VALIDATION_TABLES = ("validation", "validation_metrics")


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
        schedule=(FixedSchedule(topo.learner.groups_per_step, topo.algorithm.max_staleness,
                                topo.run.seed) if topo.run.deterministic else None),
    )


def make_rounds(ctx: ActorContext) -> ValidationRounds:
    """The validation rounds a topology asks for (no prompts: none), knowing the rounds a
    resumed run recorded already."""
    topo = ctx.topology
    V = topo.validation
    rounds = ValidationRounds(validation_prompts(topo), V.every, V.before_training,
                              topo.learner.total_steps)
    if topo.learner.resume and rounds.prompts:
        rounds.recorded = set(read_table(ctx.run_dir, "validation_metrics", ["step"])
                              ["step"].to_pylist())
    return rounds


@dataclass(frozen=True)
class ValidationSetup:
    sampling: SamplingParams
    n: int
    pass_threshold: float


class ReplayServer:
    """Answers the socket's requests from ``state`` and records what the state decided."""

    def __init__(self, state: ReplayState, sock: AsyncSocket, recorder: Recorder,
                 rounds: ValidationRounds | None = None, setup: ValidationSetup | None = None,
                 ctx: ActorContext | None = None) -> None:
        self.state = state
        self.sock = sock
        self.recorder = recorder
        self.rounds = rounds
        self.setup = setup
        self.ctx = ctx
        self.codec: Codec[ToReplay] = Codec(ToReplay, socket="" if ctx is None else
                                            f"[{ctx.name}] ROUTER {ctx.topology.replay.address}")
        # waiting requests: one per peer at most, since each peer waits for its answer
        self.prompt_waiters: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.batch_waiter: tuple[bytes, BatchRequest] | None = None
        self.publish_waiter: tuple[bytes, int] | None = None  # deterministic: (learner, version)
        self.incarnations: dict[bytes, str] = {}  # sampler -> its process's incarnation
        self.flushing = anyio.Lock()  # one flush at a time, so the tables' parts keep WAL order
        self.heard: dict[bytes, float] = {}  # sampler -> when it last sent anything
        self.silent: set[bytes] = set()  # samplers past the timeout: issued nothing until heard
        self.reissued_silent = 0  # prompts taken back from silent samplers and issued again
        self.reissued_restarted = 0  # prompts a restarted sampler lost, issued again
        self.samplers_left = 0  # samplers that said they leave (detached or preempted)
        self.handed_back = 0  # prompts those samplers held, issued again to the others
        self.max_error_share = ctx.topology.reward.max_error_share if ctx is not None else 1.0
        self.aborted = False  # scoring failed past its bound: no batch is served any more
        self.next_step = 0  # the learner step a batch request must be for: older ones were served
        self.stale_refused = 0  # batch requests and version notices older than what was served

    async def abort(self, reason: str) -> None:
        """Scoring failed past reward.max_error_share: drop the failed groups (recorded), keep
        serving nothing, and ask the runner to stop the job (actors/replay/errors.py)."""
        self.aborted = True
        self.state.drop_failed()
        await self.record()
        if self.ctx is not None:
            self.ctx.status["stopped_for"] = reason.splitlines()[0]
            await self.ctx.report(Abort(actor=self.ctx.name, reason=reason))

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
        if self.batch_waiter is not None and not self.aborted:
            peer, req = self.batch_waiter
            state.drop_stale()
            ahead = state.peek_batch(req.num_groups)
            count = count_errors(ahead or [])
            if over_bound(count, self.max_error_share):
                await self.abort(stop_reason(count, f"the batch of step {req.step + 1}",
                                             self.max_error_share))
                return
            groups = state.take_batch(req.num_groups, step=req.step + 1)
            if groups is not None:
                state.batch_stats.update(score_errors=float(count.failed),
                                         score_error_share=count.share)
                self.batch_waiter = None
                await self.record()  # what this batch consumed is on disk before it is sent
                msg = TrainBatch(step=req.step, groups=groups, counters=state.counters(),
                                 stats=state.batch_stats)
                self.next_step = req.step + 1
                await self.sock.send_multipart([peer, encode(msg)])
        S = state.schedule
        for peer in list(self.prompt_waiters):
            if peer in self.silent:
                continue  # its answer could be lost with it; it asks again when it is back
            if self.rounds is not None and self.setup is not None:  # validation goes first
                chunk = self.prompt_waiters[peer] if S is None else S.groups_per_step
                step, prompts = self.rounds.issue(peer, chunk, time.monotonic())
                if prompts:
                    del self.prompt_waiters[peer]
                    seed = -1 if S is None else S.validation_seed(step, prompts[0].prompt_id)
                    await self.sock.send_multipart([peer, encode(PromptBatch(
                        prompts=prompts, version=step, validation=True,
                        sampling=self.setup.sampling, n=self.setup.n, seed=seed))])
                    continue
            prompts = state.issue(peer, self.prompt_waiters[peer])
            if not prompts:
                break  # admission closed: later waiters would get nothing either
            del self.prompt_waiters[peer]
            version, seed = state.issued_as(prompts)
            await self.sock.send_multipart(
                [peer, encode(PromptBatch(prompts=prompts, version=version, seed=seed))])
        if self.publish_waiter is not None:
            await self.answer_publish()

    async def answer_publish(self) -> None:
        """A deterministic run: let the learner publish its version once the groups due on the
        version before are back and recorded, and its validation round too
        (``FixedSchedule.publish_ready``)."""
        assert self.publish_waiter is not None
        peer, version = self.publish_waiter
        if not self.state.publish_ready(version):
            return
        if self.rounds is not None and version >= 1 and self.rounds.due(version - 1):
            return  # its round is not back yet
        self.publish_waiter = None
        await self.record()  # a checkpoint after this version finds those groups on disk
        await self.sock.send_multipart([peer, encode(PublishReady(version=version))])

    async def handle(self, peer: bytes, msg: ToReplay, tg: anyio.abc.TaskGroup) -> None:
        state = self.state
        if isinstance(msg, PromptRequest | GroupsDone | SamplerAlive):
            self.heard[peer] = time.monotonic()
            self.silent.discard(peer)
        match msg:
            case SamplerAlive():
                pass
            case SamplerLeaving():
                await self.leave(peer)
            case PromptRequest(max_prompts=k, incarnation=inc):
                if self.incarnations.get(peer, inc) != inc:
                    # a restarted sampler: its prompts are lost
                    self.reissued_restarted += state.requeue_from(peer)
                    if self.rounds is not None:
                        self.rounds.requeue_from(peer)
                self.incarnations[peer] = inc
                self.prompt_waiters[peer] = max(1, k)
            case GroupsDone(groups=groups):
                for g in groups:
                    state.accept(g)
                if self.recorder.enabled and not self.flushing.locked():
                    tg.start_soon(self.record, WAL_ORDER[:2])
            case BatchRequest(step=step) if step < self.next_step:
                # an old request again (replayed): taking it would hand the learner's next batch
                # to whoever sent it, and leave the learner waiting for ever
                self.stale_refused += 1
                await self.sock.send_multipart([peer, encode(ErrorReply(
                    error=f"replay: the batch of step {step + 1} was served already"))])
            case BatchRequest() as req:
                self.new_version(req.version)
                self.batch_waiter = (peer, req)
            case VersionUpdate(version=v) if v < state.version:
                self.stale_refused += 1  # a notice older than one heard: it changes nothing
            case VersionUpdate(version=v):
                self.new_version(v)
            case PublishRequest(version=v):
                self.publish_waiter = (peer, v)
            case ValidationDone(step=step, groups=groups):
                done = self.rounds.accept(step, groups) if self.rounds is not None else None
                if done is not None:
                    tg.start_soon(self.finish_round, done)

    async def leave(self, peer: bytes) -> None:
        """A sampler leaves: what it was issued and sent no group for is issued again (the
        groups it sent before this came first on its connection, so they were accepted), and it
        is forgotten (not watched for silence, its waiting request dropped)."""
        requeued = self.state.requeue_from(peer)
        if self.rounds is not None:
            requeued += self.rounds.requeue_from(peer)
        self.prompt_waiters.pop(peer, None)
        self.heard.pop(peer, None)
        self.silent.discard(peer)
        self.incarnations.pop(peer, None)
        self.samplers_left += 1
        self.handed_back += requeued
        await self.sock.send_multipart([peer, encode(LeaveAck(requeued=requeued))])

    def new_version(self, version: int) -> None:
        self.state.version = max(self.state.version, version)
        if self.rounds is not None:
            self.rounds.advance(self.state.version)

    async def finish_round(self, r: Round) -> None:
        """Summarise a complete validation round, record it, report it to the runner."""
        assert self.setup is not None
        seconds = time.monotonic() - (r.started or time.monotonic())
        groups = [r.done[pid] for pid in sorted(r.done)]
        scored = [ScoredPrompt(
            g.prompt.data_source, [s.reward for s in ss], [s.answer for s in ss],
            [s.response_ids.shape[0] for s in ss], [s.finish_reason == "length" for s in ss],
            [s.reward_extra for s in ss])
            for g in groups if not g.score_error for ss in [outcomes(g.samples)]]
        metrics = await anyio.to_thread.run_sync(validation_metrics, scored,
                                                 self.setup.pass_threshold)
        count = count_errors(groups)
        metrics.update({"val-aux/score_errors": float(count.failed),
                        "timing_s/validation": seconds,
                        "timing_s/validation_generate": r.generate_s,
                        "val-aux/score_failed": float(sum(bool(g.score_error) for g in groups))})
        if self.recorder.enabled:
            for g in groups:
                self.recorder.append("validation", validation_row(r.step, g))
            self.recorder.append("validation_metrics", {"step": r.step, "metrics": metrics,
                                                        "seconds": seconds})
            async with self.flushing:
                await anyio.to_thread.run_sync(self.recorder.flush, VALIDATION_TABLES)
        if self.ctx is not None:
            await self.ctx.report(ValidationReport(step=r.step, metrics=metrics))
        if over_bound(count, self.max_error_share) and not self.aborted:
            await self.abort(stop_reason(count, f"the validation round of step {r.step}",
                                         self.max_error_share))

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
                                  stale_refused=self.stale_refused,
                                  samplers_silent=len(self.silent),
                                  reissued_silent=self.reissued_silent,
                                  reissued_restarted=self.reissued_restarted,
                                  samplers_left=self.samplers_left, handed_back=self.handed_back)
                if self.rounds is not None and self.rounds.prompts:
                    ctx.status.update(self.rounds.status())


async def replay_actor(ctx: ActorContext, *, task_status) -> None:
    """Serve prompts to samplers and batches to the learner over one ROUTER socket."""
    topo = ctx.topology
    state = make_state(ctx)
    if topo.learner.resume:  # continue the recorded run from the learner's latest checkpoint
        restored = state.restore(ctx.run_dir)
        if restored is not None:
            ctx.status.update(resumed_step=restored.step, redone=restored.redone)
    rounds = make_rounds(ctx)
    rounds.advance(state.version)  # the start's (or the resumed checkpoint's) round, if due
    setup = ValidationSetup(validation_sampling(topo), topo.validation.n,
                            topo.validation.pass_threshold)
    sock = make_socket(ctx.zmq, zmq.ROUTER, bind=topo.replay.address, curve=ctx.curve)
    sock.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted sampler reclaims its name
    recorder = Recorder(ctx.run_dir, WAL_ORDER + VALIDATION_TABLES, enabled=topo.run.record)
    server = ReplayServer(state, sock, recorder, rounds, setup, ctx)
    task_status.started()
    with sock:
        try:
            await server.serve(ctx)
        finally:
            with anyio.CancelScope(shield=True):
                await server.record()  # what was accepted since the last batch survives a stop


def validation_row(step: int, g) -> dict[str, Any]:
    """A ``validation`` row: one prompt's samples in the round of ``step``, one per episode
    (``outcomes``: those the round's metrics count)."""
    ss = outcomes(g.samples)
    return {
        "step": step, "prompt_id": g.prompt.prompt_id, "data_source": g.prompt.data_source,
        "prompt": "\n".join(f"{m.role}: {m.content}" for m in g.prompt.messages),
        "ground_truth": g.prompt.ground_truth, "sampler": g.sampler,
        "completions": [s.text for s in ss], "rewards": [s.reward for s in ss],
        "answers": [s.answer for s in ss],
        "reward_errors": [s.reward_error or g.score_error for s in ss],
        "finish_reasons": [s.finish_reason for s in ss],
        "response_lengths": [s.response_ids.shape[0] for s in ss],
        "policy_versions": [s.policy_version for s in ss],
        "generate_seconds": g.generate_seconds, "score_seconds": g.score_seconds,
    }
