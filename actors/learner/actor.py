"""The learner actor: pull a batch, take a step, publish weights, report, checkpoint.

Training runs in a worker thread (``Trainer``), so weight polls, heartbeats and stop messages
are served during a step. New weights go out through the weights channel after every step
(``actors/runtime/weights.py``). A stop abandons the step in progress at the next micro-batch
and writes a final checkpoint under a shielded scope. Every step taken is reported to the
runner (``StepReport``), whose metric sinks record it: a step the thread finished while the
actor was being stopped is reported before the final checkpoint.
"""

from __future__ import annotations

import time

import anyio
import torch
import zmq

from actors.learner.trainer import Trainer
from actors.runtime.actor import ActorContext, run_compute
from actors.runtime.recording import Recorder
from actors.runtime.rundir import remove_partial
from actors.runtime.weights import WeightsPublisher, remove_orphaned_shm
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from messages.codec import Codec, DecodeError, encode
from messages.control import StepReport
from messages.rollout import BatchRequest, FromReplay, ScoredGroup, TrainBatch, VersionUpdate

FINAL_WEIGHTS_TIMEOUT_S = 30.0  # the most the learner waits for samplers to take its last weights


class Learner:
    """The training loop of one learner: batches from the replay buffer, weights to samplers."""

    def __init__(self, ctx: ActorContext, trainer: Trainer, replay: AsyncSocket,
                 weights: WeightsPublisher) -> None:
        self.ctx, self.trainer, self.replay, self.weights = ctx, trainer, replay, weights
        self.cfg = ctx.topology.learner
        self.codec: Codec[FromReplay] = Codec(FromReplay)
        self.unreported: list[StepReport] = []  # steps taken, not yet reported to the runner
        self.recorder = Recorder(ctx.run_dir, ["batches", "metrics"],
                                 enabled=ctx.topology.run.record)
        self.flushing = anyio.Lock()  # one recording flush at a time

    async def flush_recording(self) -> None:
        # batches and metrics rows are not the replay buffer's write-ahead log (fates are), so
        # they need not be on disk before the next step: a kill loses at most the rows of
        # steps after the latest checkpoint, which a resume trains (and records) again
        async with self.flushing:
            await anyio.to_thread.run_sync(self.recorder.flush)

    async def publish(self) -> None:
        """Send the current weights to the samplers, then tell the replay buffer the version
        (its admission opens for it only once the weights are on their way)."""
        policy = self.trainer.policy
        await self.weights.publish(policy.version, await anyio.to_thread.run_sync(policy.snapshot))
        await self.replay.send_multipart([encode(VersionUpdate(version=policy.version))])

    async def next_batch(self) -> TrainBatch:
        policy = self.trainer.policy
        await self.replay.send_multipart([encode(BatchRequest(
            step=policy.step, version=policy.version, num_groups=self.cfg.groups_per_step))])
        while True:
            try:
                batch = self.codec.decode((await self.replay.recv_multipart())[-1])
            except DecodeError:
                continue
            if isinstance(batch, TrainBatch):
                return batch

    def step_and_record(self, groups: list[ScoredGroup], extra: dict[str, float]
                        ) -> dict[str, float]:
        """One step, in the worker thread, so a step taken is always a step recorded: a stop
        can come before the step or after its report is queued, never between the two."""
        policy = self.trainer.policy
        version = policy.version
        metrics = {**self.trainer.train_step(groups), **extra}
        self.unreported.append(StepReport(step=policy.step, metrics=metrics))
        self.recorder.append("batches", {"step": policy.step, "version": version,
                                         "group_ids": [g.prompt.prompt_id for g in groups]})
        self.recorder.append("metrics", {"step": policy.step,
                                         "metrics": {k: float(v) for k, v in metrics.items()}})
        return metrics

    async def report_steps(self) -> None:
        """Report the steps taken and not reported yet, oldest first."""
        while self.unreported:
            await self.ctx.report(self.unreported[0])
            self.unreported.pop(0)

    async def save(self) -> None:
        policy = self.trainer.policy
        self.ctx.status["state"] = f"writing checkpoint step_{policy.step}"
        path = await anyio.to_thread.run_sync(policy.save_checkpoint)
        self.ctx.status.update(state="running", checkpoint=str(path))

    async def train(self, tg: anyio.abc.TaskGroup) -> None:
        policy = self.trainer.policy
        await self.publish()
        while policy.step < self.cfg.total_steps:
            waited = time.monotonic()
            self.ctx.status["state"] = "waiting for batch"
            batch = await self.next_batch()
            self.ctx.status.update(state=f"training step {policy.step + 1}",
                                   wait_batch_s=round(time.monotonic() - waited, 2))
            extra = {"timing_s/wait_batch": time.monotonic() - waited,
                     **{f"replay/{k}": float(v) for k, v in batch.counters.items()},
                     **{f"replay/{k}": v for k, v in batch.stats.items()}}
            metrics = await run_compute(self.step_and_record, batch.groups, extra,
                                        abort=self.trainer.abort)
            tg.start_soon(self.flush_recording)  # beside the next batch's wait, not before it
            await self.publish()
            await self.report_steps()
            self.ctx.status.update(step=policy.step, version=policy.version,
                                   reward=round(metrics["critic/score/mean"], 3),
                                   weights_sent=self.weights.sent)
            if policy.step % self.cfg.save_every == 0 and policy.step < self.cfg.total_steps:
                await self.flush_recording()  # every step a checkpoint holds is in the recording
                await self.save()
        V = self.ctx.topology.validation
        if V.datasets and V.every > 0:  # the last step is validated: its weights must arrive
            self.ctx.status["state"] = "sending the last weights"
            await self.weights.wait_received(FINAL_WEIGHTS_TIMEOUT_S)

    async def finish(self) -> None:
        """At exit, whatever ended the loop: the recording, and a checkpoint of the last step."""
        policy = self.trainer.policy
        with anyio.CancelScope(shield=True):
            await self.report_steps()  # a step finished while the actor was being stopped
            await self.flush_recording()
            if policy.step > policy.saved_step or policy.step == self.cfg.total_steps:
                await self.save()


async def learner_actor(ctx: ActorContext, *, task_status) -> str:
    topo = ctx.topology
    cfg = topo.learner
    torch.set_num_threads(cfg.threads)
    remove_partial(ctx.run_dir)  # a checkpoint write killed half-way (kill -9) left a temp folder
    ctx.status["state"] = "loading model"
    trainer = await anyio.to_thread.run_sync(Trainer, topo, ctx.run_dir)
    weights_sock = make_socket(ctx.zmq, zmq.ROUTER, bind=cfg.weights_address, hwm=8,
                               curve=ctx.curve)
    replay = make_socket(ctx.zmq, zmq.DEALER, connect=topo.replay.address,
                         identity=ctx.name.encode(), curve=ctx.curve)
    transport = cfg.weights_transport
    if transport == "auto":  # ipc:// means every sampler shares this host, and its /dev/shm
        transport = "shm" if cfg.weights_address.startswith("ipc://") else "zmq"
    remove_orphaned_shm()
    weights = WeightsPublisher(weights_sock, transport)
    ctx.status["weights_transport"] = transport
    learner = Learner(ctx, trainer, replay, weights)
    if trainer.policy.resumed_from is not None:
        ctx.status["resumed_from"] = trainer.policy.resumed_from.name
    task_status.started()
    with weights_sock, replay:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(weights.serve)
                await learner.train(tg)
                tg.cancel_scope.cancel()
        finally:
            await learner.finish()
            weights.close()
    return f"trained {trainer.policy.step} steps"
