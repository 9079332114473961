"""The sampler actor.

Loop: ask the replay buffer for prompts (the answer waits for admission), apply the newest
weights if the learner has published some, generate ``n`` completions per prompt in a worker
thread, then hand the group to a scoring task (router -> reward workers) and go straight on
to the next prompts. At most ``MAX_SCORING`` batches are being scored at once (backpressure).
Weights arrive on their own task by long-poll, so generation never waits for the learner,
except once at start: the first batch waits for the learner's current weights.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from pathlib import Path

import anyio
import torch
import zmq

from actors.runtime.actor import ActorContext, run_compute
from actors.runtime.tensors import from_buffer, to_wire
from actors.runtime.zmq_bridge import make_socket
from actors.sampler.engine import Completion, HFEngine
from messages.codec import Codec, DecodeError, encode
from messages.reward import RouterError, ScoreItem, ScoreReply, ScoreRequest, ToClient
from messages.rollout import (
    FromReplay,
    GroupsDone,
    Prompt,
    PromptBatch,
    PromptRequest,
    Sample,
    ScoredGroup,
)
from messages.weights import FromLearnerWeights, WeightsHeader, WeightsPoll

MAX_SCORING = 2  # generated batches waiting for rewards at once


async def sampler_actor(ctx: ActorContext, *, task_status) -> None:
    topo = ctx.topology
    cfg = topo.sampler
    torch.set_num_threads(cfg.threads)
    engine = await anyio.to_thread.run_sync(
        HFEngine, Path(topo.model.path), cfg, topo.model.dtype, topo.run.seed * 1009 + ctx.index
    )
    replay = make_socket(ctx.zmq, zmq.DEALER, connect=topo.replay.address, identity=ctx.name.encode(),
                         curve=ctx.curve)
    router = make_socket(ctx.zmq, zmq.DEALER, connect=topo.router.address, curve=ctx.curve)
    weights = make_socket(ctx.zmq, zmq.DEALER, connect=topo.learner.weights_address, hwm=4,
                          curve=ctx.curve)
    replay_codec: Codec[FromReplay] = Codec(FromReplay)
    router_codec: Codec[ToClient] = Codec(ToClient)
    weights_codec: Codec[FromLearnerWeights] = Codec(FromLearnerWeights)

    version = -1  # version of the weights in the engine; -1 until the learner's first arrive
    newest: tuple[int, dict[str, torch.Tensor]] | None = None  # received, not yet applied
    received = -1  # newest version received (applied or not)
    got_weights = anyio.Event()  # replaced after each arrival: wakes a loop waiting for a version
    replies: dict[int, tuple[anyio.Event, list[ScoreReply]]] = {}
    request_ids = itertools.count()
    scoring = anyio.Semaphore(MAX_SCORING)
    stats = {"groups": 0, "tokens": 0, "gen_s": 0.0, "weight_loads": 0, "score_errors": 0}

    async def receive_weights() -> None:
        nonlocal newest, received, got_weights
        have = -1
        while True:
            await weights.send_multipart([encode(WeightsPoll(have_version=have))])
            frames = await weights.recv_multipart(copy=False)
            try:
                header = weights_codec.decode(frames[0].buffer)
                if not isinstance(header, WeightsHeader) or len(frames) != len(header.tensors) + 1:
                    raise DecodeError("weights header does not match its frames")
                tensors = {m.name: from_buffer(m.dtype, m.shape, f.buffer)
                           for m, f in zip(header.tensors, frames[1:], strict=True)}
            except (DecodeError, ValueError) as exc:
                ctx.status["weights_error"] = str(exc)[:200]
                await anyio.sleep(1.0)
                continue
            newest, have = (header.version, tensors), header.version
            received = have
            got_weights.set()
            got_weights = anyio.Event()

    async def receive_scores() -> None:
        while True:
            frames = await router.recv_multipart()
            try:
                msg = router_codec.decode(frames[-1])
            except DecodeError:
                continue
            if isinstance(msg, RouterError):
                ctx.status["router_error"] = msg.error[:200]
                continue
            waiter = replies.pop(msg.request_id, None)
            if waiter is not None:
                waiter[1].append(msg)
                waiter[0].set()

    async def score_and_send(prompts: list[Prompt], prompt_ids: list[list[int]],
                             groups: list[list[Completion]], greedy: list[Completion] | None,
                             used_version: int, gen_s: float) -> None:
        try:
            started = time.monotonic()
            items = [ScoreItem(p.data_source, c.text, p.ground_truth, p.extra_info,
                               len(c.response_ids), p.messages)
                     for p, group in zip(prompts, groups, strict=True) for c in group]
            if greedy is not None:  # remax baselines are scored after the samples
                items += [ScoreItem(p.data_source, c.text, p.ground_truth, p.extra_info,
                                    len(c.response_ids), p.messages)
                          for p, c in zip(prompts, greedy, strict=True)]
            rid = next(request_ids)
            done = anyio.Event()
            box: list[ScoreReply] = []
            replies[rid] = (done, box)
            await router.send_multipart([encode(ScoreRequest(request_id=rid, items=items))])
            await done.wait()
            score_s = time.monotonic() - started
            results = iter(box[0].results)  # samples in order, then the greedy baselines
            baselines = ([r.score for r in box[0].results[-len(prompts):]] if greedy is not None
                         else [None] * len(prompts))
            out = []
            for p, ids, group, baseline in zip(prompts, prompt_ids, groups, baselines, strict=True):
                samples = []
                for c in group:
                    r = next(results)
                    stats["score_errors"] += bool(r.error)
                    samples.append(Sample(
                        response_ids=to_wire(c.response_ids), behaviour_logprobs=to_wire(c.logprobs),
                        policy_version=used_version, text=c.text, finish_reason=c.finish_reason,
                        reward=r.score, reward_error=r.error,
                    ))
                out.append(ScoredGroup(prompt=p, prompt_ids=to_wire(torch.tensor(ids, dtype=torch.int32)),
                                       samples=samples, sampler=ctx.name, generate_seconds=gen_s,
                                       score_seconds=score_s, baseline_reward=baseline))
            await replay.send_multipart([encode(GroupsDone(groups=out))])
            stats["groups"] += len(out)
        finally:
            scoring.release()

    async def generate_loop(tg) -> None:
        nonlocal newest, version
        incarnation = f"{os.getpid()}-{time.time_ns()}"
        while received < 0:
            await got_weights.wait()
        while True:
            await replay.send_multipart([encode(PromptRequest(cfg.prompts_per_request, incarnation))])
            frames = await replay.recv_multipart()
            try:
                msg = replay_codec.decode(frames[-1])
            except DecodeError:
                continue
            if not isinstance(msg, PromptBatch) or not msg.prompts:
                continue
            while received < msg.version:  # published before these prompts were issued
                await got_weights.wait()
            if newest is not None:
                (new_version, tensors), newest = newest, None
                await anyio.to_thread.run_sync(engine.load_weights, tensors)
                version = new_version
                stats["weight_loads"] += 1
            prompts = msg.prompts
            ids = [engine.prompt_ids([{"role": m.role, "content": m.content} for m in p.messages])
                   for p in prompts]
            started = time.monotonic()
            groups = await run_compute(engine.generate, ids, topo.algorithm.n, abort=engine.abort)
            greedy = None
            if topo.algorithm.adv_estimator == "remax":
                greedy = [g[0] for g in await run_compute(
                    functools.partial(engine.generate, greedy=True), ids, 1, abort=engine.abort)]
            gen_s = time.monotonic() - started
            stats["gen_s"] += gen_s
            stats["tokens"] += sum(len(c.response_ids) for g in groups for c in g)
            ctx.status.update(version=version, groups=stats["groups"],
                              tokens_per_s=round(stats["tokens"] / max(stats["gen_s"], 1e-9), 1),
                              weight_loads=stats["weight_loads"], score_errors=stats["score_errors"],
                              scoring=MAX_SCORING - scoring.value)
            await scoring.acquire()
            tg.start_soon(score_and_send, prompts, ids, groups, greedy, version, gen_s)

    task_status.started()
    with replay, router, weights:
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive_weights)
            tg.start_soon(receive_scores)
            tg.start_soon(generate_loop, tg)
