"""The sampler actor.

With a batch engine (hf), the loop asks the replay buffer for prompts (the answer waits for
admission), applies the newest weights if the learner has published some, generates ``n``
completions per prompt (a ``Rollout`` over the engine), then hands the batch to a scoring task
(router -> reward workers) and goes straight on to the next prompts. At most ``MAX_SCORING``
batches are being scored at once (backpressure).

With a continuous engine (vllm), each admitted prompt is submitted alone as soon as it arrives,
up to ``sampler.max_concurrent_prompts`` in the engine; a group goes to scoring as soon as its
own completions are done, and the freed place is filled with the next prompt. Weights are
loaded as soon as they arrive (``ContinuousSampler.load_weights``), into the running engine:
between its requests or in flight (``sampler.weight_update``). A prompt the engine refuses for
good goes back to the replay buffer as a group without samples, to be dropped as ``rejected``.

Detach and preemption (``ActorContext.draining``, set by the first SIGTERM or Ctrl-C): the sampler
asks for no more prompts, finishes the groups it holds for at most ``sampler.drain_grace_s``,
then stops its work and sends the replay buffer ``SamplerLeaving``: the buffer issues again every
prompt it gave this sampler and got no group for, so none is lost or trained twice.

Weights arrive on their own task by long-poll (the weights channel), so generation never waits
for the learner, except for weights already published: the first prompts wait for the
learner's initial weights, and prompts issued at version ``v`` wait for the weights of ``v``
(they are already on the wire) rather than going stale.

Validation prompts (``PromptBatch.validation``) come between training prompts: they are
generated with the batch's own sampling parameters and ``n``, with the weights of the validated
version (a batch engine loads newer ones at the next training batch; a continuous engine holds
its weight loads while a validation batch generates, so it may validate a newer version when one
arrived first: each sample records its version), and handed back as ``ValidationDone``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import msgspec
import torch
import zmq

from actors.data.chat import ChatTokenizer
from actors.runtime.actor import ActorContext
from actors.runtime.config import score_targets
from actors.runtime.tensors import from_wire
from actors.runtime.weights import WeightsSubscriber
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from actors.sampler.engines.base import Engine, Rejected
from actors.sampler.leaving import Holdings
from actors.sampler.lending import lend_idle
from actors.sampler.rollout import Generated, Rollout
from actors.sampler.scoring_client import ScoringClient
from actors.sampler.setup import placement, prompts_in_flight, receive_into, start_engine
from actors.sampler.strategies import start_strategy
from messages.codec import Codec, DecodeError, encode
from messages.control import Abort
from messages.rollout import (
    FromReplay,
    GroupsDone,
    Prompt,
    PromptBatch,
    PromptRequest,
    SamplerAlive,
    SamplingParams,
    ScoredGroup,
    ValidationDone,
)

MAX_SCORING = 2  # generated batches waiting for rewards at once


class Sampler:
    """Prompts from the replay buffer, weights from the learner, groups back to the buffer."""

    def __init__(self, ctx: ActorContext, engine: Engine, rollout: Rollout, replay: AsyncSocket,
                 weights: WeightsSubscriber, scoring: ScoringClient) -> None:
        self.ctx, self.engine, self.rollout = ctx, engine, rollout
        self.replay, self.weights, self.scoring = replay, weights, scoring
        self.codec: Codec[FromReplay] = Codec(FromReplay,
                                              socket=f"[{ctx.name}] DEALER to the replay buffer")
        self.slots = anyio.Semaphore(MAX_SCORING)
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"  # a restart is a new one
        self.groups = self.tokens = self.weight_loads = self.score_errors = self.rejected = 0
        self.first_score_error = ""  # the first sample's scoring error, shown on the panel
        self.aborted = False  # asked the runner to stop the job (a broken tool)
        self.gen_s = 0.0
        self.started = time.monotonic()
        self.sync_sent = 0.0  # of the engine's weight_sync_s, what groups sent already carry
        self.multi_version = 0  # samples sent whose tokens span more than one version
        self.val_groups = 0  # validation groups handed back
        self.in_flight = 0  # prompts taken and not handed back yet (generating or scoring)
        self.val_rollouts: dict[tuple[SamplingParams, int], Rollout] = {}
        self.weights_lock = anyio.Lock()  # held while validating: no weights load meanwhile
        self.holdings = Holdings(replay, self.incarnation, ctx.topology.sampler.drain_grace_s)

    async def wait_for_prompts(self, count: int | None = None) -> PromptBatch | None:
        """The next prompts, or None once the sampler drains."""
        batch = await self.holdings.take(lambda: self.next_prompts(count))
        if batch is not None:
            self.in_flight += len(batch.prompts)
        return batch

    async def leave(self) -> str:
        """Hand back what it holds (``Holdings.leave``); returns the line for the runner."""
        unfinished, requeued = await self.holdings.leave()
        self.ctx.status.update(handed_back=len(unfinished), left=True)
        self.publish()
        answer = (f"the replay buffer issues {requeued} again" if requeued is not None else
                  "no answer from the replay buffer (its sampler_timeout_s issues them again)")
        line = f"left after {self.groups} groups; {len(unfinished)} prompts unfinished, {answer}"
        print(f"[{self.ctx.name}] {line}", flush=True)
        return line

    async def next_prompts(self, count: int | None = None) -> PromptBatch:
        cfg = self.ctx.topology.sampler
        while True:
            await self.replay.send_multipart(
                [encode(PromptRequest(count or cfg.prompts_per_request, self.incarnation))])
            frames = await self.replay.recv_multipart()
            try:
                msg = self.codec.decode(frames[-1])
            except DecodeError:
                continue
            if isinstance(msg, PromptBatch) and msg.prompts:
                return msg

    async def keep_alive(self) -> None:
        """Tell the replay buffer this sampler is alive, also while it generates for long."""
        while True:
            await self.replay.send_multipart([encode(SamplerAlive(self.incarnation))])
            await anyio.sleep(self.ctx.topology.run.heartbeat_interval)

    async def apply_weights(self, at_least: int) -> None:
        """Load the newest received weights, after waiting for version ``at_least``."""
        await self.weights.wait_for(at_least)
        newest = self.weights.take()
        if newest is not None:
            await self.engine.load_weights(*newest)
            self.weight_loads += 1

    async def send(self, groups: list[ScoredGroup]) -> None:
        """Hand groups to the replay buffer; the first carries the weight-sync time not
        reported yet (``ScoredGroup.weight_sync_s``: every swap counted once)."""
        sync = self.engine.weight_sync_s - self.sync_sent
        if groups and sync > 0:
            groups[0] = msgspec.structs.replace(groups[0], weight_sync_s=sync)
            self.sync_sent += sync
        for g in groups:
            for s in g.samples:
                if s.token_versions is not None and len(set(from_wire(s.token_versions).tolist())) > 1:
                    self.multi_version += 1
        await self.replay.send_multipart([encode(GroupsDone(groups=groups))])
        self.holdings.gave(groups)
        self.groups += len(groups)
        agent = self.rollout.agent
        if agent is not None and agent.broken and not self.aborted:
            self.aborted = True  # once: the runner stops the job
            await self.ctx.report(Abort(actor=self.ctx.name, reason=agent.broken))

    def note_score_errors(self, groups: list[ScoredGroup]) -> None:
        """Count the samples whose scoring failed; keep the first one's error for the panel."""
        for s in (s for g in groups for s in g.samples if s.reward_error):
            self.score_errors += 1
            self.first_score_error = self.first_score_error or s.reward_error[:200]

    async def score_and_send(self, generated: list[Generated], rollout: Rollout | None = None,
                             validation_step: int | None = None) -> None:
        try:
            groups = await (rollout or self.rollout).score(generated)
            self.note_score_errors(groups)
            if validation_step is None:
                await self.send(groups)
            else:
                await self.replay.send_multipart(
                    [encode(ValidationDone(step=validation_step, groups=groups))])
                self.holdings.gave(groups)
                self.val_groups += len(groups)
        finally:
            self.in_flight -= len(generated)
            self.slots.release()

    async def validate(self, batch: PromptBatch, tg: anyio.abc.TaskGroup) -> None:
        """Generate validation prompts with the weights of the validated version, then score
        and hand them back (the scoring runs on ``tg``)."""
        key = (batch.sampling or self.rollout.params, batch.n or self.rollout.n)
        if key not in self.val_rollouts:
            self.val_rollouts[key] = Rollout(
                self.engine, self.rollout.tokenizer, self.scoring, params=key[0], n=key[1],
                greedy_baseline=False, sampler=self.rollout.sampler, agent=self.rollout.agent)
        rollout = self.val_rollouts[key]
        await self.weights_for_validation(batch.version)
        self.check_version(batch)
        async with self.weights_lock:
            generated = await rollout.generate(batch.prompts, seed_of(batch))
        self.gen_s += generated[0].generate_seconds
        self.tokens += sum(len(c.token_ids) for g in generated for c in g.completions)
        self.publish()
        await self.slots.acquire()
        tg.start_soon(self.score_and_send, generated, rollout, batch.version)

    async def weights_for_validation(self, version: int) -> None:
        """The validated version's weights (or the newest received, when the engine lacks
        them); newer ones wait for the next training batch."""
        await self.weights.wait_for(version)
        if self.engine.version < version:
            await self.apply_weights(version)

    def check_version(self, batch: PromptBatch) -> None:
        """A deterministic run's batch finds exactly its version as the newest
        (``actors/replay/schedule.py``); anything else is a broken schedule, not a result."""
        if batch.seed >= 0 and self.engine.version != batch.version:
            raise RuntimeError(f"run.deterministic: a batch of version {batch.version} found "
                               f"the engine at version {self.engine.version}")

    def publish(self) -> None:
        s = self.scoring.statistics()
        wall = max(time.monotonic() - self.started, 1e-9)
        self.ctx.status.update(
            version=self.engine.version, groups=self.groups,
            tokens_per_s=round(self.tokens / max(self.gen_s, 1e-9), 1),
            weight_loads=self.weight_loads, score_errors=self.score_errors,
            first_score_error=self.first_score_error,
            weight_sync_s=round(self.engine.weight_sync_s, 3),
            weight_sync_share=round(self.engine.weight_sync_s / wall, 4),
            multi_version_samples=self.multi_version, rejected_prompts=self.rejected,
            scoring=self.scoring_now(), score_resent=s.resent, score_failed=s.failed,
            val_groups=self.val_groups, in_flight=self.in_flight, draining=self.holdings.draining,
            score_late=s.late, rejected_frames=s.rejected, weights_stale=self.weights.stale)
        if self.rollout.agent is not None:
            self.ctx.status.update(self.rollout.agent.statistics())
        for key, value in (("weights_error", self.weights.error),
                           ("router_error", self.scoring.router_error)):
            if value:
                self.ctx.status[key] = value
        if hasattr(self.engine, "statistics"):
            self.ctx.status.update(self.engine.statistics())

    def scoring_now(self) -> int:
        """Generated groups (or batches) being scored now."""
        return MAX_SCORING - self.slots.value

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        await self.weights.wait_for(0)
        while True:
            batch = await self.wait_for_prompts()
            if batch is None:
                return  # draining: the batches being scored finish on ``tg``
            self.publish()
            if batch.validation:
                await self.validate(batch, tg)
                continue
            await self.apply_weights(batch.version)  # published before these were issued
            self.check_version(batch)
            generated = await self.rollout.generate(batch.prompts, seed_of(batch))
            self.gen_s += generated[0].generate_seconds
            self.tokens += sum(len(c.token_ids) for g in generated for c in g.completions)
            self.publish()
            await self.slots.acquire()
            tg.start_soon(self.score_and_send, generated)
            self.publish()  # its figures while the batch is scored (in flight, scoring)


class ContinuousSampler(Sampler):
    """The sampler of a continuous engine: prompts enter one by one, groups leave one by one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        limit = prompts_in_flight(self.ctx.topology.sampler.max_concurrent_prompts,
                                  gpu=str(self.ctx.status.get("device", "cpu")).startswith("cuda"))
        self.limit = limit
        self.in_engine = anyio.Semaphore(limit)  # prompts generating now
        self.scoring_slots = anyio.Semaphore(limit)  # generated groups being scored now
        self.loaded = anyio.Event()  # set and replaced at every weights load
        self.active = 0  # prompts generating now
        self.busy_since = 0.0  # when ``active`` last went from 0 to 1

    def scoring_now(self) -> int:
        return self.limit - self.scoring_slots.value

    async def load_weights(self) -> None:
        """Load every newer version as soon as it arrives (into the running engine)."""
        while True:
            newest = self.weights.take()
            if newest is None:
                await self.weights.wait_for(self.weights.received + 1)
                continue
            async with self.weights_lock:  # not while a validation batch generates
                await self.engine.load_weights(*newest)
            self.weight_loads += 1
            self.loaded.set()
            self.loaded = anyio.Event()
            self.publish()

    async def wait_for_version(self, version: int) -> None:
        while self.engine.version < version:  # prompts issued at v are generated with >= v
            await self.loaded.wait()

    async def weights_for_validation(self, version: int) -> None:
        await self.wait_for_version(version)  # loads go on as weights arrive

    async def validate_here(self, batch: PromptBatch, tg: anyio.abc.TaskGroup) -> None:
        """A validation batch beside the training prompts; its engine places are freed once it
        is generated."""
        try:
            await self.validate(batch, tg)
        finally:
            for _ in batch.prompts:
                self.in_engine.release()

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        await self.weights.wait_for(0)
        await self.apply_weights(0)
        tg.start_soon(self.load_weights)
        cfg = self.ctx.topology.sampler
        while not self.holdings.draining:
            await self.in_engine.acquire()  # one free place at least, then every free one
            free = 1
            while free < min(cfg.prompts_per_request, self.limit):
                try:
                    self.in_engine.acquire_nowait()
                except anyio.WouldBlock:
                    break
                free += 1
            batch = await self.wait_for_prompts(free)
            if batch is None:
                return  # draining: the prompts in the engine finish on ``tg``
            for _ in range(free - len(batch.prompts)):
                self.in_engine.release()
            self.publish()
            if batch.validation:
                tg.start_soon(self.validate_here, batch, tg)
                continue
            await self.wait_for_version(batch.version)
            for prompt in batch.prompts:
                tg.start_soon(self.one_prompt, prompt)

    async def one_prompt(self, prompt: Prompt) -> None:
        """Generate one prompt's group, then score and send it; its place in the engine is
        freed once it is generated (and a scoring place is held: backpressure)."""
        if self.active == 0:
            self.busy_since = time.monotonic()
        self.active += 1
        try:
            generated = await self.rollout.generate_one(prompt)
        except Rejected as exc:
            self.rejected += 1
            self.in_engine.release()
            await self.send([self.rollout.rejected(prompt, str(exc))])
            self.in_flight -= 1
            return
        finally:
            self.active -= 1
            if self.active == 0:  # gen_s: the time the engine had work, not the wall time
                self.gen_s += time.monotonic() - self.busy_since
        await self.scoring_slots.acquire()
        self.in_engine.release()
        try:
            self.tokens += sum(len(c.token_ids) for c in generated.completions)
            groups = await self.rollout.score([generated])
            self.note_score_errors(groups)
            await self.send(groups)
            self.in_flight -= 1
            self.publish()
        finally:
            self.scoring_slots.release()


def seed_of(batch: PromptBatch) -> int | None:
    """The seed a batch's draws start from (``PromptBatch.seed``; None: the engine's own)."""
    return batch.seed if batch.seed >= 0 else None


def sampling_params(ctx: ActorContext) -> SamplingParams:
    cfg = ctx.topology.sampler
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_tokens=cfg.max_tokens, stop=tuple(cfg.stop))


async def sampler_actor(ctx: ActorContext, *, task_status) -> str:
    topo = ctx.topology
    cfg = topo.sampler
    torch.set_num_threads(cfg.threads)
    ctx.status["state"] = "loading model"
    model = Path(topo.model.path)
    engine = await start_engine(ctx)
    if ctx.index >= 0:  # an attached sampler is no part of the job's plan of this host's cores
        engine = lend_idle(engine, ctx.run_dir, ctx.index, cfg.count, cfg.threads,
                           placement(cfg.device, ctx.index))
    tokenizer = await anyio.to_thread.run_sync(ChatTokenizer, model)
    replay = make_socket(ctx.zmq, zmq.DEALER, connect=topo.replay.address,
                         identity=ctx.name.encode(), curve=ctx.curve)
    router = make_socket(ctx.zmq, zmq.DEALER, connect=topo.router.address, curve=ctx.curve)
    weights_sock = make_socket(ctx.zmq, zmq.DEALER, connect=topo.learner.weights_address, hwm=4,
                               curve=ctx.curve)
    lora = topo.learner.lora.rank > 0  # adapters: received here, not by the engine's workers
    weights = WeightsSubscriber(weights_sock, topo.learner.weights_transport, receive_into(
        cfg.engine, placement(cfg.device, ctx.index), topo.learner.collective_timeout_s, lora))
    scoring = ScoringClient(router, timeout_s=cfg.score_timeout_s, attempts=cfg.score_attempts,
                            targets=score_targets(topo.reward))
    agent = await start_strategy(engine, tokenizer, topo.agent)  # None: single-turn
    rollout = Rollout(engine, tokenizer, scoring, params=sampling_params(ctx), n=topo.algorithm.n,
                      greedy_baseline=topo.algorithm.adv_estimator.greedy_baseline, sampler=ctx.name,
                      agent=agent, teacher=bool(topo.teacher.path))
    sampler = (ContinuousSampler if engine.continuous else Sampler)(
        ctx, engine, rollout, replay, weights, scoring)
    ctx.status["engine"] = cfg.engine.name
    ctx.drain_grace_s = cfg.drain_grace_s
    task_status.started()
    with replay, router, weights_sock:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(weights.serve)
                tg.start_soon(scoring.serve)
                tg.start_soon(engine.watch)
                if agent is not None:
                    tg.start_soon(agent.serve)
                async with anyio.create_task_group() as work:  # ends only by a drain
                    work.start_soon(sampler.keep_alive)
                    work.start_soon(sampler.run, work)
                    assert ctx.draining is not None
                    work.start_soon(sampler.holdings.drain, ctx.draining, work.cancel_scope)
                detail = await sampler.leave()
                tg.cancel_scope.cancel()
            return detail
        finally:
            with anyio.CancelScope(shield=True):
                if agent is not None:
                    await agent.aclose()
                await engine.aclose()
                weights.close()
