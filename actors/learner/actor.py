"""The learner actor: pull a batch, take a step, publish weights, report, checkpoint.

Weights are served by long-poll on the ``weights`` ROUTER: each sampler's ``WeightsPoll``
is answered as soon as a version newer than the one it has exists (at once for a sampler that
has none), with a header frame and one zero-copy frame per parameter. Training runs in a
worker thread so polls, heartbeats and stop messages are served during a step. A stop
abandons the step in progress at the next micro-batch and writes a final checkpoint under a
shielded scope.
"""

from __future__ import annotations

import json
import time

import anyio
import torch
import zmq

from actors.learner.checkpoints import remove_partial
from actors.learner.trainer import Trainer
from actors.recording import Recorder
from actors.runtime.actor import ActorContext, run_compute
from actors.runtime.tensors import meta, raw_bytes
from actors.runtime.zmq_bridge import make_socket
from messages.codec import Codec, DecodeError, encode
from messages.control import ErrorReply, StepReport
from messages.rollout import BatchRequest, FromReplay, TrainBatch, VersionUpdate
from messages.weights import ToLearnerWeights, WeightsHeader, WeightsPoll


class WeightsServer:
    """Holds the newest published weights and answers pollers that lack them."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.version = -1
        self.frames: list = []  # [header, tensor bytes...] of ``version``
        self.waiting: dict[bytes, int] = {}  # poller identity -> version it has
        self.sent = 0

    async def publish(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        header = WeightsHeader(version=version, tensors=[meta(n, t) for n, t in tensors])
        self.version = version
        self.frames = [encode(header), *(raw_bytes(t) for _, t in tensors)]
        await self.flush()

    async def flush(self) -> None:
        for peer, have in list(self.waiting.items()):
            if self.version > have:
                del self.waiting[peer]
                await self.sock.send_multipart([peer, *self.frames], copy=False)
                self.sent += 1

    async def serve(self) -> None:
        codec: Codec[ToLearnerWeights] = Codec(ToLearnerWeights)
        while True:
            peer, *frames = await self.sock.recv_multipart()
            try:
                poll = codec.decode(frames[-1] if frames else b"")
            except DecodeError as exc:
                await self.sock.send_multipart([peer, encode(ErrorReply(error=f"weights: {exc}"))])
                continue
            if isinstance(poll, WeightsPoll):
                self.waiting[peer] = poll.have_version
                if self.version >= 0:
                    await self.flush()


async def learner_actor(ctx: ActorContext, *, task_status) -> str:
    topo = ctx.topology
    cfg = topo.learner
    torch.set_num_threads(cfg.threads)
    remove_partial(ctx.run_dir)  # a checkpoint write killed half-way (kill -9) left a temp folder
    trainer = await anyio.to_thread.run_sync(Trainer, topo, ctx.run_dir)
    weights_sock = make_socket(ctx.zmq, zmq.ROUTER, bind=cfg.weights_address, hwm=8,
                               curve=ctx.curve)
    replay = make_socket(ctx.zmq, zmq.DEALER, connect=topo.replay.address,
                         identity=ctx.name.encode(), curve=ctx.curve)
    server = WeightsServer(weights_sock)
    replay_codec: Codec[FromReplay] = Codec(FromReplay)
    metrics_file = ctx.run_dir / "metrics.jsonl"
    recorder = Recorder(ctx.run_dir, ["batches", "metrics"], enabled=topo.run.record)
    if trainer.resumed_from is not None:
        ctx.status["resumed_from"] = trainer.resumed_from.name
    task_status.started()

    flushing = anyio.Lock()  # one recording flush at a time

    async def flush_recording() -> None:
        # batches and metrics rows are not the replay buffer's write-ahead log (fates are), so
        # they need not be on disk before the next step: a kill loses at most the rows of
        # steps after the latest checkpoint, which a resume trains (and records) again
        async with flushing:
            await anyio.to_thread.run_sync(recorder.flush)

    async def train(tg: anyio.abc.TaskGroup) -> None:
        await server.publish(trainer.version, await anyio.to_thread.run_sync(trainer.snapshot))
        await replay.send_multipart([encode(VersionUpdate(version=trainer.version))])
        while trainer.step < cfg.total_steps:
            waited = time.monotonic()
            await replay.send_multipart([encode(BatchRequest(
                step=trainer.step, version=trainer.version, num_groups=cfg.groups_per_step))])
            batch = None
            while not isinstance(batch, TrainBatch):
                try:
                    batch = replay_codec.decode((await replay.recv_multipart())[-1])
                except DecodeError:
                    continue
            extra = {"timing_s/wait_batch": time.monotonic() - waited,
                     **{f"replay/{k}": float(v) for k, v in batch.counters.items()},
                     **{f"replay/{k}": v for k, v in batch.stats.items()}}

            def step_and_record(groups, extra=extra):
                # in the worker thread, so a step taken is always a step recorded: a stop can
                # come before the step or after its metrics line, never between the two
                version = trainer.version
                metrics = {**trainer.train_step(groups), **extra}
                with metrics_file.open("a") as f:
                    f.write(json.dumps({"step": trainer.step, **metrics}) + "\n")
                recorder.append("batches", {"step": trainer.step, "version": version,
                                            "group_ids": [g.prompt.prompt_id for g in groups]})
                recorder.append("metrics", {"step": trainer.step,
                                            "metrics": {k: float(v) for k, v in metrics.items()}})
                return metrics

            metrics = await run_compute(step_and_record, batch.groups, abort=trainer.abort)
            tg.start_soon(flush_recording)  # beside the next batch's wait, not before it
            snapshot = await anyio.to_thread.run_sync(trainer.snapshot)
            await server.publish(trainer.version, snapshot)
            await replay.send_multipart([encode(VersionUpdate(version=trainer.version))])
            await ctx.report(StepReport(step=trainer.step, metrics=metrics))
            ctx.status.update(step=trainer.step, version=trainer.version,
                              reward=round(metrics["critic/score/mean"], 3),
                              weights_sent=server.sent)
            if trainer.step % cfg.save_every == 0 and trainer.step < cfg.total_steps:
                await flush_recording()  # every step a checkpoint holds is in the recording
                await anyio.to_thread.run_sync(trainer.save_checkpoint)

    with weights_sock, replay:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve)
                await train(tg)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await flush_recording()
            if trainer.step > trainer.saved_step or trainer.step == cfg.total_steps:
                with anyio.CancelScope(shield=True):
                    path = await anyio.to_thread.run_sync(trainer.save_checkpoint)
                    ctx.status["checkpoint"] = str(path)
    return f"trained {trainer.step} steps"
