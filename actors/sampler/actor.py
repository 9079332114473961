"""The sampler actor.

Loop: ask the replay buffer for prompts (the answer waits for admission), apply the newest
weights if the learner has published some, generate ``n`` completions per prompt (a
``Rollout`` over the engine), then hand the batch to a scoring task (router -> reward workers)
and go straight on to the next prompts. At most ``MAX_SCORING`` batches are being scored at
once (backpressure). Weights arrive on their own task by long-poll (the weights channel), so
generation never waits for the learner, except for weights already published: the first batch
waits for the learner's initial weights, and a batch of prompts issued at version ``v`` waits
for the weights of ``v`` (they are already on the wire) rather than going stale.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import torch
import zmq

from actors.data.chat import ChatTokenizer
from actors.runtime.actor import ActorContext
from actors.runtime.devices import resolve_device, resolve_dtype
from actors.runtime.weights import WeightsSubscriber
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from actors.sampler.engines.base import Engine
from actors.sampler.engines.hf import HFEngine
from actors.sampler.rollout import Generated, Rollout
from actors.sampler.scoring_client import ScoringClient
from messages.codec import Codec, DecodeError, encode
from messages.rollout import FromReplay, GroupsDone, PromptBatch, PromptRequest, SamplingParams

MAX_SCORING = 2  # generated batches waiting for rewards at once


class Sampler:
    """Prompts from the replay buffer, weights from the learner, groups back to the buffer."""

    def __init__(self, ctx: ActorContext, engine: Engine, rollout: Rollout, replay: AsyncSocket,
                 weights: WeightsSubscriber, scoring: ScoringClient) -> None:
        self.ctx, self.engine, self.rollout = ctx, engine, rollout
        self.replay, self.weights, self.scoring = replay, weights, scoring
        self.codec: Codec[FromReplay] = Codec(FromReplay)
        self.slots = anyio.Semaphore(MAX_SCORING)
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"  # a restart is a new one
        self.groups = self.tokens = self.weight_loads = self.score_errors = 0
        self.gen_s = 0.0

    async def next_prompts(self) -> PromptBatch:
        cfg = self.ctx.topology.sampler
        while True:
            await self.replay.send_multipart(
                [encode(PromptRequest(cfg.prompts_per_request, self.incarnation))])
            frames = await self.replay.recv_multipart()
            try:
                msg = self.codec.decode(frames[-1])
            except DecodeError:
                continue
            if isinstance(msg, PromptBatch) and msg.prompts:
                return msg

    async def apply_weights(self, at_least: int) -> None:
        """Load the newest received weights, after waiting for version ``at_least``."""
        await self.weights.wait_for(at_least)
        newest = self.weights.take()
        if newest is not None:
            await self.engine.load_weights(*newest)
            self.weight_loads += 1

    async def score_and_send(self, generated: list[Generated]) -> None:
        try:
            groups = await self.rollout.score(generated)
            self.score_errors += sum(bool(s.reward_error) for g in groups for s in g.samples)
            await self.replay.send_multipart([encode(GroupsDone(groups=groups))])
            self.groups += len(groups)
        finally:
            self.slots.release()

    def publish(self) -> None:
        s = self.scoring.statistics()
        self.ctx.status.update(
            version=self.engine.version, groups=self.groups,
            tokens_per_s=round(self.tokens / max(self.gen_s, 1e-9), 1),
            weight_loads=self.weight_loads, score_errors=self.score_errors,
            scoring=MAX_SCORING - self.slots.value, score_resent=s.resent, score_failed=s.failed,
            score_late=s.late, rejected_frames=s.rejected)
        for key, value in (("weights_error", self.weights.error),
                           ("router_error", self.scoring.router_error)):
            if value:
                self.ctx.status[key] = value

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        await self.weights.wait_for(0)
        while True:
            batch = await self.next_prompts()
            await self.apply_weights(batch.version)  # published before these were issued
            generated = await self.rollout.generate(batch.prompts)
            self.gen_s += generated[0].generate_seconds
            self.tokens += sum(len(c.token_ids) for g in generated for c in g.completions)
            self.publish()
            await self.slots.acquire()
            tg.start_soon(self.score_and_send, generated)


def placement(setting: str, index: int) -> torch.device:
    """``sampler.device``: ``auto``/``cuda`` put sampler i on GPU i (modulo the GPUs there are)."""
    return resolve_device(setting, index % max(1, torch.cuda.device_count()))


def sampling_params(ctx: ActorContext) -> SamplingParams:
    cfg = ctx.topology.sampler
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_tokens=cfg.max_tokens, stop=tuple(cfg.stop))


async def sampler_actor(ctx: ActorContext, *, task_status) -> None:
    topo = ctx.topology
    cfg = topo.sampler
    torch.set_num_threads(cfg.threads)
    model = Path(topo.model.path)
    device = placement(cfg.device, ctx.index)
    dtype = str(resolve_dtype(cfg.dtype, device, topo.model.dtype)).removeprefix("torch.")
    ctx.status.update(device=str(device), dtype=dtype)
    engine = await anyio.to_thread.run_sync(
        HFEngine, model, dtype, topo.run.seed * 1009 + ctx.index, device)
    tokenizer = await anyio.to_thread.run_sync(ChatTokenizer, model)
    replay = make_socket(ctx.zmq, zmq.DEALER, connect=topo.replay.address,
                         identity=ctx.name.encode(), curve=ctx.curve)
    router = make_socket(ctx.zmq, zmq.DEALER, connect=topo.router.address, curve=ctx.curve)
    weights_sock = make_socket(ctx.zmq, zmq.DEALER, connect=topo.learner.weights_address, hwm=4,
                               curve=ctx.curve)
    weights = WeightsSubscriber(weights_sock)
    scoring = ScoringClient(router, timeout_s=cfg.score_timeout_s, attempts=cfg.score_attempts)
    rollout = Rollout(engine, tokenizer, scoring, params=sampling_params(ctx), n=topo.algorithm.n,
                      greedy_baseline=topo.algorithm.adv_estimator == "remax", sampler=ctx.name)
    sampler = Sampler(ctx, engine, rollout, replay, weights, scoring)
    task_status.started()
    with replay, router, weights_sock:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(weights.serve)
                tg.start_soon(scoring.serve)
                tg.start_soon(sampler.run, tg)
        finally:
            with anyio.CancelScope(shield=True):
                await engine.aclose()
