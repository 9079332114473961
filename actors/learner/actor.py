"""The learner actor: pull a batch, take a step, publish weights, report, checkpoint.

Training runs in a worker thread (``Trainer``), so weight polls, heartbeats and stop messages
are served during a step. New weights go out through the weights channel after every step
(``actors/runtime/weights.py``). A stop abandons the step in progress at the next micro-batch
and writes a final checkpoint under a shielded scope. Every step taken is reported to the
runner (``StepReport``), whose metric sinks record it: a step the thread finished while the
actor was being stopped is reported before the final checkpoint.

A learner of several ranks (``learner.nproc_per_node``, ``learner.nnodes``) is one process per
rank, all running this body. Rank 0 is the learner above: it alone talks to the replay buffer,
the samplers and the runner, and before each collective it tells the other ranks which one
(``messages/learner_ranks.py``): a step on the batch it received, a weights gather, a
checkpoint, the end. The other ranks follow (``follow``) until rank 0 ends the group; they
ignore stops of their own (rank 0's stop is theirs: it ends the step at the same micro-batch on
every rank and then saves and ends the group), and the runner stops the whole group when any
rank dies.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import anyio
import torch
import zmq

from actors.learner.distributed import Group
from actors.learner.memory import announce
from actors.learner.policy import learner_group
from actors.learner.trainer import Aborted, Trainer
from actors.learner.vision import image_samples
from actors.runtime.actor import ActorContext
from actors.runtime.compute import run_compute
from actors.runtime.config import ProcessName, process_share, samplers_dtype
from actors.runtime.cores import LEARNERS, SAMPLERS, Borrower, CoreTable, Lender, Share, table_path
from actors.runtime.devices import CudaMemory, on_device
from actors.runtime.memory_lending import MemoryBorrower, holder_slot, lenders_among
from actors.runtime.profiling import profile_dir, profiled
from actors.runtime.ranks import Rank
from actors.runtime.recording import Recorder
from actors.runtime.rundir import remove_partial
from actors.runtime.transports.shm import remove_orphaned_shm
from actors.runtime.transports.table import TRANSPORTS
from actors.runtime.weights import WeightsPublisher
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from messages.codec import Codec, DecodeError, encode
from messages.control import StepReport
from messages.learner_ranks import RanksEnd, RanksPublish, RanksSave, RanksStep, ToLearnerRanks
from messages.rollout import (
    BatchRequest,
    FromReplay,
    PublishReady,
    PublishRequest,
    ScoredGroup,
    TrainBatch,
    VersionUpdate,
)

FINAL_WEIGHTS_TIMEOUT_S = 30.0  # the most the learner waits for samplers to take its last weights


class Learner:
    """The training loop of one learner: batches from the replay buffer, weights to samplers."""

    def __init__(self, ctx: ActorContext, trainer: Trainer, replay: AsyncSocket,
                 weights: WeightsPublisher, share: Share | None = None,
                 memory: MemoryBorrower | None = None) -> None:
        self.ctx, self.trainer, self.replay, self.weights = ctx, trainer, replay, weights
        self.cfg = ctx.topology.learner
        self.codec: Codec[FromReplay] = Codec(FromReplay)
        self.unreported: list[StepReport] = []  # steps taken, not yet reported to the runner
        self.recorder = Recorder(ctx.run_dir, ["batches", "metrics"],
                                 enabled=ctx.topology.run.record)
        self.flushing = anyio.Lock()  # one recording flush at a time
        self.group: Group = trainer.group
        self.weight_sync_s = 0.0  # the last publish: gathering the weights and handing them out
        self.share = share  # the samplers' idle threads taken, its own lent (a CPU; or None)
        self.memory = memory  # GPU memory its GPU's sleeping samplers lend (or None)
        self.published = -1  # the newest version published (a deterministic run saves no other)
        self.publishing = anyio.Event()  # set: no publish beside the training under way
        self.publishing.set()

    def tell(self, message: ToLearnerRanks) -> None:
        """Tell the other ranks the collective that follows (in the thread that runs it)."""
        if self.group.world > 1:
            self.group.broadcast_control(encode(message))

    def gather_weights(self):
        """The weights in the samplers' dtype: on the learner's device for a GPU transport,
        on the CPU otherwise; with LoRA the adapters only (``Policy.adapter_snapshot``)."""
        policy = self.trainer.policy
        dtype = weights_dtype(self.cfg.weights_dtype, policy.compute_dtype,
                              samplers=samplers_dtype(self.ctx.topology, torch.cuda.is_available())
                              if self.cfg.lora.rank else None)
        self.tell(RanksPublish(dtype=str(dtype).removeprefix("torch.")))
        on_gpu = TRANSPORTS[self.cfg.weights_transport].gpu
        return policy.published(dtype, policy.device if on_gpu else "cpu",
                                live=self.weights.sender.reads_at_prepare)

    def save_checkpoint(self):
        self.tell(RanksSave())
        return self.trainer.policy.save_checkpoint()

    async def flush_recording(self) -> None:
        # batches and metrics rows are not the replay buffer's write-ahead log (fates are), so
        # they need not be on disk before the next step: a kill loses at most the rows of
        # steps after the latest checkpoint, which a resume trains (and records) again
        async with self.flushing:
            await anyio.to_thread.run_sync(self.recorder.flush)

    async def publish(self, read: threading.Event | None = None) -> None:
        """Send the current weights to the samplers, then tell the replay buffer the version
        (its admission opens for it only once the weights are on their way). ``read`` is set
        once the weights have been read out (copied into the transport's file or messages)."""
        policy = self.trainer.policy
        started = time.monotonic()
        tensors = await anyio.to_thread.run_sync(on_device(self.group.device, self.gather_weights))
        await self.weights.publish(policy.version, tensors,
                                   bucket_bytes=self.cfg.weights_bucket_mb << 20,
                                   adapter=policy.adapter_spec(),
                                   read=read.set if read is not None else None)
        self.weight_sync_s = time.monotonic() - started
        self.published = policy.version
        await self.replay.send_multipart([encode(VersionUpdate(version=policy.version))])

    def publishes_beside(self) -> bool:
        """Whether a step's publish runs beside the next step rather than before it: with one
        rank (a gather over several is a collective, in step with theirs), a transport that
        reads the weights on the CPU, and not in a deterministic run (it publishes at fixed
        points of its schedule)."""
        return (self.group.world == 1 and not TRANSPORTS[self.cfg.weights_transport].gpu
                and not self.ctx.topology.run.deterministic)

    async def publish_beside(self, tg: anyio.abc.TaskGroup) -> None:
        """Publish the step just taken beside the next one: copying out hundreds of MiB (the
        shm file, zmq's messages) is then no longer a pause between steps. The next optimizer
        update, the first thing to change the weights, waits until they have been read out."""
        await self.publishing.wait()  # the one before has sent its version
        read, self.publishing = threading.Event(), anyio.Event()
        self.trainer.before_update = read.wait

        async def publish() -> None:
            try:
                await self.publish(read)
            finally:
                read.set()  # a publish that failed or was cancelled holds no update back
                self.publishing.set()

        tg.start_soon(publish)

    async def wait_publish_ready(self) -> None:
        """A deterministic run: wait until the replay buffer lets the new version out (every
        group due on the one before is back: ``actors/replay/schedule.py``)."""
        version = self.trainer.policy.version
        self.ctx.status["state"] = f"waiting to publish version {version}"
        await self.replay.send_multipart([encode(PublishRequest(version=version))])
        while True:
            try:
                msg = self.codec.decode((await self.replay.recv_multipart())[-1])
            except DecodeError:
                continue
            if isinstance(msg, PublishReady) and msg.version == version:
                return

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
        self.tell(RanksStep(groups=groups))
        borrower = self.share.borrower if self.share is not None else None
        if borrower is not None:  # the step's first count, before anything it computes
            borrower.take_trace()
            borrower.check()
        step = policy.step + 1
        profile = profile_dir(self.ctx.run_dir, self.ctx.name) \
            if step in self.cfg.profile_steps else None
        with borrowing(self.memory) as lent_mib, \
                profiled(profile, step, self.group.device) as facts:
            metrics = {**self.trainer.train_step(groups), **extra}
            facts.update(samples=sum(len(g.samples) for g in groups))
        if self.memory is not None:
            metrics["perf/gpu_memory_borrowed_mib"] = float(lent_mib)
        threads = None
        if borrower is not None:
            metrics["perf/borrowed_share"] = borrower.take_share()
            threads = borrower.take_trace()  # what ``runner.py rerun`` sets again
        run = self.ctx.topology.run
        shown = image_samples(groups, policy.tokenizer, run.image_samples) \
            if policy.processor is not None and policy.step % run.image_interval == 0 else []
        self.unreported.append(StepReport(step=policy.step, metrics=metrics, samples=shown))
        self.recorder.append("batches", {"step": policy.step, "version": version,
                                         "group_ids": [g.prompt.prompt_id for g in groups],
                                         "threads": threads})
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
        path = await anyio.to_thread.run_sync(on_device(self.group.device, self.save_checkpoint))
        self.ctx.status.update(state="running", checkpoint=str(path))

    def lending(self) -> contextlib.AbstractContextManager[None]:
        """This rank's threads lent to the samplers of its host while it waits (a CPU)."""
        return self.share.lender.idle() if self.share is not None else contextlib.nullcontext()

    async def train(self, tg: anyio.abc.TaskGroup) -> None:
        policy = self.trainer.policy
        await self.publish()
        stepped = None  # when the last step's computation ended
        while policy.step < self.cfg.total_steps:
            waited = time.monotonic()
            self.ctx.status["state"] = "waiting for batch"
            with self.lending():
                batch = await self.next_batch()
            arrived = time.monotonic()
            self.ctx.status.update(state=f"training step {policy.step + 1}",
                                   wait_batch_s=round(arrived - waited, 2))
            extra = {"timing_s/wait_batch": arrived - waited,
                     "timing_s/weight_publish": self.weight_sync_s,  # of the weights this batch follows
                     # the learner's own work between the last step and this one, waiting
                     # for the batch left out: the publish, reports, status, the request
                     "timing_s/between_steps": (waited - stepped if stepped is not None else 0.0),
                     **{f"replay/{k}": float(v) for k, v in batch.counters.items()},
                     **{f"replay/{k}": v for k, v in batch.stats.items()}}
            metrics = await run_compute(on_device(self.group.device, self.step_and_record),
                                        batch.groups, extra, abort=self.trainer.abort)
            stepped = time.monotonic()
            tg.start_soon(self.flush_recording)  # beside the next batch's wait, not before it
            if self.ctx.topology.run.deterministic:
                await self.wait_publish_ready()
            if self.publishes_beside():
                await self.publish_beside(tg)
            else:
                await self.publish()
            await self.report_steps()
            self.ctx.status.update(step=policy.step, version=policy.version,
                                   reward=round(metrics["critic/score/mean"], 3),
                                   weights_sent=self.weights.sent,
                                   weights_failed=self.weights.failed)
            if policy.step % self.cfg.save_every == 0 and policy.step < self.cfg.total_steps:
                await self.flush_recording()  # every step a checkpoint holds is in the recording
                await self.save()
        await self.publishing.wait()
        V = self.ctx.topology.validation
        if V.datasets and V.every > 0:  # the last step is validated: its weights must arrive
            self.ctx.status["state"] = "sending the last weights"
            with self.lending():  # the last validation generates meanwhile
                await self.weights.wait_received(FINAL_WEIGHTS_TIMEOUT_S, first=True)

    async def finish(self) -> None:
        """At exit, whatever ended the loop: the recording, and a checkpoint of the last step."""
        policy = self.trainer.policy
        with anyio.CancelScope(shield=True):
            await self.report_steps()  # a step finished while the actor was being stopped
            await self.flush_recording()
            # a deterministic run's step that never went out is trained again on resume: a
            # checkpoint of it would come before groups due on the version before it are on disk
            unpublished = self.ctx.topology.run.deterministic and policy.version != self.published
            if (policy.step > policy.saved_step or policy.step == self.cfg.total_steps) \
                    and not unpublished:
                await self.save()
            await anyio.to_thread.run_sync(on_device(self.group.device, self.tell), RanksEnd())


async def learner_actor(ctx: ActorContext, *, task_status) -> str:
    topo = ctx.topology
    cfg = topo.learner
    torch.set_num_threads(cfg.threads)
    rank = Rank.from_env()
    if rank.rank == 0:
        remove_partial(ctx.run_dir)  # a checkpoint write killed half-way (kill -9) left a temp folder
    ctx.status["state"] = "loading model"
    group = await anyio.to_thread.run_sync(learner_group, topo, rank)  # every rank joins first
    share = None
    try:
        trainer = await anyio.to_thread.run_sync(on_device(group.device, Trainer), topo,
                                                 ctx.run_dir, "latest", group)
        if group.leader:  # what this learner will hold, once its micro-batches are known
            def estimate(tokens: int, patches: int) -> None:
                if (text := announce(trainer.policy, tokens, patches)) is not None:
                    print(f"[{ctx.name}] {text}", file=sys.stderr, flush=True)

            trainer.on_first_batch = estimate
        ctx.status.update(rank=group.rank, ranks=group.world, device=str(group.device))
        share = share_threads(ctx, trainer, rank)
        memory = borrow_memory(ctx, group.device, rank)
        if not group.leader:
            task_status.started()
            with anyio.CancelScope(shield=True):  # rank 0 ends the group, not a stop of ours
                steps = await anyio.to_thread.run_sync(on_device(group.device, follow), trainer,
                                                       memory)
            return f"rank {group.rank}: trained {steps} steps"
        return await lead(ctx, trainer, task_status, share, memory)
    finally:
        if share is not None:
            share.close()
        if memory is not None:
            memory.close()
        group.close()


def share_threads(ctx: ActorContext, trainer: Trainer, rank: Rank) -> Share | None:
    """``learner.share_threads``: on a CPU, the policy computes also on the threads the
    samplers of this host lend while they wait (split between this host's ranks). Never in a
    deterministic run: a sequence's numbers depend on the threads it was computed on."""
    cfg = ctx.topology.learner
    if not cfg.share_threads or ctx.topology.run.deterministic or trainer.group.device.type != "cpu":
        return None
    table = CoreTable(table_path(ctx.run_dir))
    borrower = Borrower(table, SAMPLERS, cfg.threads, rank=rank.local_rank,
                        ranks=rank.local_world_size, keep_trace=rank.rank == 0)
    borrower.attach(trainer.policy.model, trainer.policy.optimizer)
    # and its own threads, lent while it waits for a batch (a sampler's engine takes them)
    return Share(table, Lender(table, LEARNERS[rank.local_rank % len(LEARNERS)], cfg.threads),
                 borrower)


def borrow_memory(ctx: ActorContext, device: torch.device, rank: Rank) -> MemoryBorrower | None:
    """On a GPU this rank shares with samplers that sleep (``sampler.sleep_idle_s``): the
    memory their sleeping engines lend, borrowed per step (``memory_lending.py``)."""
    topo = ctx.topology
    own = process_share()
    if device.type != "cuda" or topo.sampler.sleep_idle_s <= 0 or not own:
        return None
    name = str(ProcessName("learner", 0, rank.rank))
    me = next((p for p in topo.placement if p.name == name), None)
    lenders = lenders_among(me.shared_with) if me is not None else []
    if not lenders:
        return None
    return MemoryBorrower(CoreTable(table_path(ctx.run_dir)), holder_slot(rank.rank), lenders,
                          own, CudaMemory(device))


def borrowing(memory: MemoryBorrower | None) -> contextlib.AbstractContextManager[int]:
    """One step on the memory lent now (0 MiB: none, or no lender)."""
    return memory.step() if memory is not None else contextlib.nullcontext(0)


async def lead(ctx: ActorContext, trainer: Trainer, task_status,
               share: Share | None = None, memory: MemoryBorrower | None = None) -> str:
    """Rank 0 (the whole learner when it has one rank)."""
    topo, cfg = ctx.topology, ctx.topology.learner
    weights_sock = make_socket(ctx.zmq, zmq.ROUTER, bind=cfg.weights_address, hwm=8,
                               curve=ctx.curve)
    replay = make_socket(ctx.zmq, zmq.DEALER, connect=topo.replay.address,
                         identity=ctx.name.encode(), curve=ctx.curve)
    remove_orphaned_shm()
    sender = TRANSPORTS[cfg.weights_transport].load().sender.build(cfg, trainer.group.device)
    weights = WeightsPublisher(weights_sock, sender, ctx.name, ctx.status)
    ctx.status["weights_transport"] = cfg.weights_transport
    learner = Learner(ctx, trainer, replay, weights, share, memory)
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


def follow(trainer: Trainer, memory: MemoryBorrower | None = None) -> int:
    """A rank other than 0: run the collectives rank 0 announces until it ends the group."""
    codec: Codec[ToLearnerRanks] = Codec(ToLearnerRanks)
    group, policy = trainer.group, trainer.policy
    while True:
        match codec.decode(group.broadcast_control(None)):
            case RanksStep(groups=groups):
                try:
                    with borrowing(memory):
                        trainer.train_step(groups)
                except Aborted:  # rank 0 is stopping: a checkpoint and the end come next
                    pass
            case RanksPublish(dtype=dtype):
                policy.published(getattr(torch, dtype))
            case RanksSave():
                policy.save_checkpoint()
            case RanksEnd():
                return policy.step


def weights_dtype(setting: str, compute: torch.dtype, samplers: str | None = None) -> torch.dtype:
    """``learner.weights_dtype``: auto sends what the learner computes in, or with LoRA the
    samplers' dtype (``samplers``: adapters are cast once here, not on every sampler)."""
    if setting != "auto":
        return getattr(torch, setting)
    return getattr(torch, samplers) if samplers else compute
